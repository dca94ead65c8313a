#!/usr/bin/env bash
# README command 1: sets the machine up (scripts/setup.sh) and runs the example
# job on $NP ranks (default 2) of this machine. The job is one line below:
# repoint EXAMPLE (and its arguments) to run another example.
set -euo pipefail
cd "$(dirname "$0")/.."

NP="${NP:-2}"
# ResNet-50 data-parallel at 64x64, batch 8 per rank: 1 rank, then $NP ranks
# (scaling.py launches both through nvgrouprun) -> img/s and scaling efficiency.
EXAMPLE=(examples/resnet50/scaling.py --np "$NP" --tag run_example --
         --image-size 64 --batch-size 8 --steps 10 --warmup-steps 2 --log-every 5)

bash scripts/setup.sh
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMPI_MCA_rmaps_base_oversubscribe=1 TF_CPP_MIN_LOG_LEVEL=2 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
.venv/bin/python "${EXAMPLE[@]}"
