#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv on a fresh machine.
# torch is pinned here, and only here, to the CPU wheel this workplace ships; the package itself
# accepts any torch>=2.6 so users elsewhere keep theirs (CUDA, or torch_npu's matching build).
# The bench extra (peers and plots of benchmarks/run.py) comes along so that one set-up runs everything.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
.venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install --quiet -e ".[dev,bench]"
