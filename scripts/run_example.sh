#!/usr/bin/env bash
# README command 1: sets the machine up (scripts/setup.sh) and runs the example
# job on $NP ranks (default 2) of this machine. The job is one line below:
# repoint EXAMPLE (and its arguments) to run another example.
set -euo pipefail
cd "$(dirname "$0")/.."

NP="${NP:-2}"
# ResNet-50 data-parallel at 64x64, batch 8 per rank: 1 rank, then $NP ranks
# (scaling.py launches both through nvgrouprun) -> img/s and scaling efficiency.
# Fair comparison: the 1-rank baseline and each of the $NP ranks get the same
# CPU share -- CORES_PER_RANK cores each (pinned by train.py) and as many TF
# intra-op threads -- so the figure measures scaling, not a baseline that had
# the whole machine against ranks that share it.
CORES_PER_RANK="${CORES_PER_RANK:-1}"
NCORES="$(nproc)"
if [ $((NP * CORES_PER_RANK)) -gt "$NCORES" ]; then
  echo "run_example.sh: $NP ranks x $CORES_PER_RANK core(s) need more than this machine's $NCORES cores;" \
       "set NP or CORES_PER_RANK lower" >&2
  exit 2
fi
EXAMPLE=(examples/resnet50/scaling.py --np "$NP" --tag run_example --
         --image-size 64 --batch-size 8 --steps 10 --warmup-steps 2 --log-every 5
         --cores-per-rank "$CORES_PER_RANK" --intra-op-threads "$CORES_PER_RANK")

bash scripts/setup.sh
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMPI_MCA_rmaps_base_oversubscribe=1 TF_CPP_MIN_LOG_LEVEL=2 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "run_example.sh: 1-rank baseline vs $NP ranks; every rank (the baseline too) pinned to" \
     "$CORES_PER_RANK core(s) with $CORES_PER_RANK TF intra-op thread(s), on a $NCORES-core machine"
.venv/bin/python "${EXAMPLE[@]}"
