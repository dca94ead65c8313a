#!/usr/bin/env bash
# The whole check: set-up + build, the Python lint, the GPU adapter compile
# check, and the test suite. `.ci/run` runs exactly this.
#   --fast   set-up + build, the lint and the fast tier only: the tests that
#            start no mpirun (`pytest -m "not mpi"`, tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."

fast=0
for arg in "$@"; do
  case "$arg" in
    --fast) fast=1 ;;
    *) echo "usage: bash scripts/test.sh [--fast]" >&2; exit 2 ;;
  esac
done

bash scripts/setup.sh
.venv/bin/ruff check .
bash scripts/format_check.sh
# pytest exits 5 when it collected no tests; under `set -e` that (like any
# failure) fails this script.
if [ "$fast" = 1 ]; then
  .venv/bin/python -m pytest tests/ -q -m "not mpi"
  exit 0
fi
bash scripts/check_gpu_build.sh
.venv/bin/python -m pytest tests/ -v
