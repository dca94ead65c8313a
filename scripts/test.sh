#!/usr/bin/env bash
# The whole check: set-up + build, the GPU adapter compile check, and the test
# suite. `.ci/run` runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
bash scripts/check_gpu_build.sh
# pytest exits 5 when it collected no tests; under `set -e` that (like any
# failure) fails this script.
.venv/bin/python -m pytest tests/ -v
