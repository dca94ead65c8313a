#!/usr/bin/env bash
# README command 1: sets the machine up (scripts/setup.sh) and runs the example
# job on $NP ranks (default 2) of this machine. The job is one line below:
# repoint EXAMPLE (and its arguments) to run another example.
set -euo pipefail
cd "$(dirname "$0")/.."

EXAMPLE=(examples/allreduce_demo.py)
NP="${NP:-2}"

bash scripts/setup.sh
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMPI_MCA_rmaps_base_oversubscribe=1 TF_CPP_MIN_LOG_LEVEL=2 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mpirun -np "$NP" --bind-to none -x PYTHONPATH -x TF_CPP_MIN_LOG_LEVEL .venv/bin/python "${EXAMPLE[@]}"
