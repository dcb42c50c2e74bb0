#!/usr/bin/env bash
# The prepared command for a CUDA machine: benchmarks/bench_accel.py under whichever python has torch
# (the machine's own CUDA build; scripts/setup.sh would pin the CPU wheel, so it is not used here).
#
#   bash benchmarks/accel.sh                 # full: ~1B llama, under 8 minutes on one H200
#   bash benchmarks/accel.sh --quick         # shorter
#   PYTHON=/path/to/python bash benchmarks/accel.sh
#
# With $OUT set (the device runner's output folder) and no --json given, the JSON record, the
# section and the log go there (accelerator.json, accelerator.md, accelerator.log); copy the JSON
# to benchmarks/results/accelerator.json and rebuild the report (python benchmarks/run.py --report-only).
# ckpt also imports numpy, lmdb, xxhash, zstandard and fsspec: the missing ones are listed first
# (our rows are then skipped, the rest runs); a folder benchmarks/_deps, when present, goes on
# PYTHONPATH for them (e.g. copied from a matching Python's site-packages).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
    for candidate in python3 python; do
        if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then
            PY=$candidate
            break
        fi
    done
fi
if [ -z "$PY" ]; then
    echo "accel.sh: no python with torch found (set PYTHON=...)" >&2
    exit 1
fi
if [ -d benchmarks/_deps ]; then
    export PYTHONPATH="$PWD/benchmarks/_deps${PYTHONPATH:+:$PYTHONPATH}"
fi

"$PY" - <<'EOF'
import importlib.util, sys
import torch
print(f"accel.sh: {sys.executable} (Python {sys.version.split()[0]}), torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}"
      + (f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
missing = [m for m in ("numpy", "lmdb", "xxhash", "zstandard", "fsspec") if importlib.util.find_spec(m) is None]
print("accel.sh: ckpt's dependencies missing: " + (", ".join(missing) + " (our rows will be skipped)" if missing else "none"))
EOF

args=("$@")
if [ -n "${OUT:-}" ] && [[ " $* " != *" --json "* ]]; then
    args+=(--json "$OUT/accelerator.json" --out "$OUT/accelerator.md")
    # a hard stop under the device runner's 10-minute limit, so that the log still comes back
    timeout 570 "$PY" benchmarks/bench_accel.py "${args[@]}" 2>&1 | tee "$OUT/accelerator.log"
    exit "${PIPESTATUS[0]}"
fi
exec "$PY" benchmarks/bench_accel.py "${args[@]}"
