#!/usr/bin/env bash
# Fetch, here, the wheels the lent device machine's image lacks (it reaches no package index):
# cp312 manylinux builds of lmdb and zstandard, and torchtitan with what its checkpoint manager
# imports (tyro, docstring_parser, typeguard, typing_extensions, spmd_types at torchtitan 0.3.0's
# pin; all pure Python), into the ignored benchmarks/_wheels, which benchmarks/device_checks.py
# installs into a scratch site-packages at its start (about 3 MB). Carry the folder:
#   run(command="python3 benchmarks/device_checks.py", carry=["benchmarks/_wheels"], timeout_s=540)
# Without the torchtitan wheels the trainer section runs torchtitan's DCP calls in place of its manager.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d benchmarks/_wheels "lmdb>=1.4" "zstandard>=0.22" "torchtitan>=0.3,<0.4" "spmd_types==0.2.3" \
    "tyro" "docstring_parser>=0.16" "typeguard>=4" "typing_extensions>=4.13"
ls benchmarks/_wheels
