#!/usr/bin/env bash
# XLA on one GPU, through the TF GPU kit (../shared/tfgpu, TFGPU_FULL=1 for
# ResNet-50: real cuBLAS/cuDNN). On the GPU machine, project root, after the
# kit's last part installed TF:
#
#   bash .tfgpu/carry/device.sh && bash scripts/xla_gpu.sh [tests] [fp32] [mixed]
#
#   tests  tests/tf/workers/xla.py (every lowered collective under
#          jit_compile=True on GPU:0 vs the non-XLA result and a float64
#          reference, mismatch errors, Keras fit with jit_compile=True) on 1
#          and 2 ranks (sharing the GPU); tests/tf/workers/xla_scatter_alltoall.py
#          (reducescatter, alltoall, grouped allgather, broadcast_, process sets, their
#          gradients and errors; 2 ranks); a killed rank inside an XLA
#          program (2 ranks)
#   fp32   ResNet-50 batch 128 fp32: nvgroup_tf with XLA, plain Keras with
#          XLA, nvgroup_tf without XLA (scripts/xla_resnet.py)
#   mixed  the same at batch 256 with --mixed-precision (without the no-XLA run)
#   scatter_alltoall  the xla_scatter_alltoall worker of `tests` alone
#   mixedab, fp32ab  the CUDA handler's two waits against plain Keras, alternated
#          (NVGROUP_XLA_CUDA_WAIT, ops/xla_ops_gpu.cc): nvgroup stream, plain,
#          nvgroup host, nvgroup stream, plain
#   fp32alt, mixedalt  nvgroup_tf (the defaults) and plain Keras, both with XLA,
#          alternated XLA_ALT_ROUNDS times (default 3)
# Default: all three. Logs and the NVG_RESULT lines go to $OUT (default /tmp/out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. /tmp/tfgpu/env.sh || { echo "xla_gpu: /tmp/tfgpu/env.sh missing: install the kit first"; exit 2; }
export NCCL_NVLS_ENABLE=0 TF_FORCE_GPU_ALLOW_GROWTH=true
X="$MPIRUN_X -x TF_FORCE_GPU_ALLOW_GROWTH"
STAGES=${*:-tests fp32 mixed}
STATUS=0
LOG="$OUT/xla_gpu.log"
exec > >(tee -a "$LOG") 2>&1
step() { echo "=== $* ($(date -u +%H:%M:%S))"; }
run() { "$@"; local rc=$?; [ $rc -eq 0 ] || { echo "!!! FAILED rc=$rc: $*"; STATUS=1; }; return 0; }

nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
for stage in $STAGES; do
  case $stage in
    tests)
      for np in 1 2; do
        step "xla worker, $np rank(s)"
        # The mismatch checks ("errors") need a second rank to disagree with.
        sections="collectives fit"; [ $np -gt 1 ] && sections="collectives errors fit"
        run timeout 400 mpirun -np $np $X python3 tests/tf/workers/xla.py $sections
      done
      step "xla_scatter_alltoall worker (reducescatter, alltoall, grouped allgather, broadcast_, process sets), 2 ranks"
      run timeout 500 mpirun -np 2 $X python3 tests/tf/workers/xla_scatter_alltoall.py collectives gradients errors
      step "xla worker, rank 1 killed inside an XLA program"
      timeout 200 mpirun -np 2 $X -x NVGROUP_TIMEOUT=60 python3 tests/tf/workers/xla.py dead 1 \
        | tee "$OUT/dead.log"
      grep -q "rank 0: CAUGHT UnavailableError .*rank 1" "$OUT/dead.log" || { echo "!!! no UnavailableError on rank 0"; STATUS=1; }
      ;;
    scatter_alltoall)
      step "xla_scatter_alltoall worker alone, 2 ranks"
      run timeout 400 mpirun -np 2 $X python3 tests/tf/workers/xla_scatter_alltoall.py collectives gradients errors
      ;;
    fp32|mixed)
      if [ "$stage" = fp32 ]; then args="--batch-size 128"; modes="nvgroup plain nvgroup-nojit"
      else args="--batch-size 256 --mixed-precision"; modes="nvgroup plain"; fi
      for mode in $modes; do
        step "ResNet-50 $stage $mode"
        run timeout 300 mpirun -np 1 $X python3 scripts/xla_resnet.py $mode $args --image-size 224 \
          --steps 60 --warmup-steps 10 --log-every 20 | tee -a "$OUT/resnet_$stage.log"
      done
      ;;
    mixedab|fp32ab)
      if [ "$stage" = fp32ab ]; then args="--batch-size 128"; else args="--batch-size 256 --mixed-precision"; fi
      for pair in "nvgroup stream" "plain stream" "nvgroup host" "nvgroup stream" "plain stream"; do
        set -- $pair
        export NVGROUP_XLA_CUDA_WAIT=$2
        step "ResNet-50 $stage $1 NVGROUP_XLA_CUDA_WAIT=$2"
        run timeout 300 mpirun -np 1 $X -x NVGROUP_XLA_CUDA_WAIT python3 scripts/xla_resnet.py $1 $args \
          --image-size 224 --steps 60 --warmup-steps 10 --log-every 20 | tee -a "$OUT/resnet_$stage.log"
      done
      unset NVGROUP_XLA_CUDA_WAIT
      ;;
    fp32alt|mixedalt)
      if [ "$stage" = fp32alt ]; then args="--batch-size 128"; else args="--batch-size 256 --mixed-precision"; fi
      for round in $(seq "${XLA_ALT_ROUNDS:-3}"); do
        for mode in nvgroup plain; do
          step "ResNet-50 $stage $mode, round $round"
          run timeout 300 mpirun -np 1 $X python3 scripts/xla_resnet.py $mode $args --image-size 224 \
            --steps 60 --warmup-steps 10 --log-every 20 | tee -a "$OUT/resnet_$stage.log"
        done
      done
      ;;
    *) echo "unknown stage $stage"; STATUS=1 ;;
  esac
done
step "summary"
grep -h "NVG_MODE\|NVG_RESULT\|checks, .* failures" "$OUT"/*.log
exit $STATUS
