#!/usr/bin/env bash
# Measures the cores each test of make test's selection keeps busy (tests/cores_probe.py), one test at a time, and
# rewrites tests/cores_measured.txt, the table `pytest -n` packs tests onto the cores with (tests/cores.py).
# About 20 minutes on 2 cores; run it on an otherwise idle machine. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}
.venv/bin/python -m pytest -q -p tests.cores_probe -p no:xdist -m "not bigmodel and not matrix and not install" "$@"
