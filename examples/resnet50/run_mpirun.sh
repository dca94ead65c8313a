#!/usr/bin/env bash
# ResNet-50 with nvgroup_tf through mpirun (via nvgrouprun), outside a scheduler.
#
#   examples/resnet50/run_mpirun.sh                        # 2 ranks here, small CPU config
#   NP=8 HOSTS=node1:4,node2:4 examples/resnet50/run_mpirun.sh --batch-size 64 --image-size 224
#
# Arguments replace the default train.py flags. NVGROUP_* variables set here
# reach every rank.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"

LAUNCH=(-np "${NP:-2}")
[ -n "${HOSTS:-}" ] && LAUNCH+=(-H "$HOSTS")
if [ $# -eq 0 ]; then
  set -- --image-size 64 --batch-size 8 --steps 10 --warmup-steps 3 --log-every 5
fi
exec "$PY" -m nvgroup_tf.runner "${LAUNCH[@]}" "$PY" "$ROOT/examples/resnet50/train.py" "$@"
