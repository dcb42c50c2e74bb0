#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv.
#
# torch is pinned here, and only here, to a CPU build (TORCH_VERSION, default 2.13.0): the tests and
# the debug job run on CPUs, and an unpinned torch from the default index is a multi-GB CUDA build
# on Linux. PyTorch's CPU wheel index is used when it can be reached (TORCH_INDEX_URL to choose
# another); otherwise the default index, which on some machines holds the CPU wheel itself. The
# package accepts any torch>=2.6, so an install elsewhere keeps the user's torch (CUDA, or the build
# torch_npu needs). The dev and bench extras come along so that one set-up runs everything.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip)
"${PIP[@]}" install --quiet --upgrade pip >/dev/null
if .venv/bin/python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" \
        "$TORCH_INDEX_URL/torch/" 2>/dev/null; then
    "${PIP[@]}" install --quiet "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL" \
        --extra-index-url https://pypi.org/simple
else
    "${PIP[@]}" install --quiet "torch==$TORCH_VERSION"
fi
"${PIP[@]}" install --quiet -e ".[dev,bench]"
# Nothing activates the environment for the shell that ran this script (a child process cannot):
# every documented command assumes the line below, once per new shell (docs/TOOLS.md and the others
# say so where their commands start; tests/tools/test_docs_run.py runs them after it and nothing else).
echo "Set up in .venv. In each new shell, activate it first (every documented command assumes it):"
echo "source .venv/bin/activate"
