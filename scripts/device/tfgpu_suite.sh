#!/usr/bin/env bash
# The TF GPU op on a GPU machine without TensorFlow, through the kit in ../shared/tfgpu: the kit's last
# step (install TF and the staged op), the TF GPU suite (tests/gpu/test_tf_gpu.py) and the step benchmark
# (tf_gpu_step_bench.py), in one command. How to get here (README 'Builds and checks'):
#   here:   bash ../shared/tfgpu/prepare.sh; then for each part N: bash scripts/device/tfgpu_carry.sh N
#           and send .tfgpu/carry with the project, running `bash .tfgpu/carry/device.sh` for every part
#           but the last; for the last one run instead:
#   there:  bash .tfgpu/carry/tfgpu_suite.sh [STAGE...]       (default: suite bench)
# Stages: suite  the TF GPU suite (parallel part, then the *memory* tests alone: they take the GPU's memory)
#         bench  step cost, 1 and 2 ranks sharing the GPU
#         old    if tfgpu_carry.sh carried a baseline op library (TFGPU_OLD_LIB): the adapter-defect checks
#                and the benchmark against it, to show what the fixes change
# Logs go to $OUT (at most 8 files come back); a summary is printed last.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${*:-suite bench}
bash "$HERE/device.sh" || { echo "the kit's install failed"; exit 1; }
. /tmp/tfgpu/env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NVGROUP_TEST_GPU_MB=${NVGROUP_TEST_GPU_MB:-2048} NVG_COMMIT=$(cat "$HERE/commit" 2>/dev/null || echo "?")
cd "$NVG_REPO"
SUMMARY=$OUT/summary.txt; : > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
note "machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1), $(nproc) cores; commit $NVG_COMMIT; $(date -u +%FT%TZ)"
status=0

for stage in $STAGES; do
  case $stage in
    suite)
      timeout 420 python3 -m pytest -q -rs -n 8 -p no:cacheprovider tests/gpu/test_tf_gpu.py -k "not memory" \
        > "$OUT/suite.log" 2>&1; rc=$?
      note "suite (parallel): rc=$rc $(tail -1 "$OUT/suite.log")"; [ $rc = 0 ] || status=1
      timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_tf_gpu.py -k memory \
        > "$OUT/suite_memory.log" 2>&1; rc=$?
      note "suite (memory, alone): rc=$rc $(tail -1 "$OUT/suite_memory.log")"; [ $rc = 0 ] || status=1 ;;
    bench)
      for np in 1 2; do
        timeout 150 mpirun -np $np $MPIRUN_X -x NVG_COMMIT python3 "$HERE/tf_gpu_step_bench.py" --label fixed \
          --json "$OUT/step.jsonl" >> "$OUT/bench.log" 2>&1 || { status=1; note "bench np=$np failed"; }
      done
      grep '^STEP' "$OUT/bench.log" | tee -a "$SUMMARY" ;;
    old)
      [ -f "$HERE/old/libnvgroup_tf_ops.so" ] || { note "old: no baseline library carried"; continue; }
      rm -rf /tmp/tfgpu/old && mkdir -p /tmp/tfgpu/old
      if [ -d "$HERE/old/nvgroup_tf" ]; then cp -r "$HERE/old/nvgroup_tf" /tmp/tfgpu/old/  # the baseline's own package
      else cp -r /tmp/tfgpu/proj/nvgroup_tf /tmp/tfgpu/old/; fi
      mkdir -p /tmp/tfgpu/old/nvgroup_tf/lib && cp "$HERE/old/libnvgroup_tf_ops.so" /tmp/tfgpu/old/nvgroup_tf/lib/
      note "old: baseline $(cat "$HERE/old/ref" 2>/dev/null)"
      OLDPP=/tmp/tfgpu/old:/tmp/tfgpu/proj/tests/gpu/workers:/tmp/tfgpu/site
      W=/tmp/tfgpu/proj/tests/gpu/workers
      {
        echo "== baseline: allgather race (2 ranks)"; PYTHONPATH=$OLDPP timeout 120 mpirun -np 2 $MPIRUN_X python3 $W/tf_gpu_collectives.py race; echo "rc=$?"
        echo "== baseline: memory taken after init (1 rank)"; PYTHONPATH=$OLDPP timeout 90 mpirun -np 1 $MPIRUN_X python3 $W/tf_gpu_memory.py after_init; echo "rc=$?"
        echo "== baseline: memory taken before init (2 ranks)"; PYTHONPATH=$OLDPP timeout 90 mpirun -np 2 $MPIRUN_X python3 $W/tf_gpu_memory.py before_init; echo "rc=$?"
      } > "$OUT/old.log" 2>&1
      grep -E "^== |rc=|FAIL|PASSED|checks," "$OUT/old.log" | tee -a "$SUMMARY"
      for np in 1 2; do
        PYTHONPATH=$OLDPP timeout 150 mpirun -np $np $MPIRUN_X -x NVG_COMMIT python3 "$HERE/tf_gpu_step_bench.py" \
          --label baseline --json "$OUT/step.jsonl" >> "$OUT/bench.log" 2>&1 || note "baseline bench np=$np failed"
      done
      grep '^STEP baseline' "$OUT/bench.log" | tee -a "$SUMMARY" ;;
    *) note "unknown stage $stage"; status=1 ;;
  esac
done
grep -E "passed|failed|error" "$OUT/suite.log" "$OUT/suite_memory.log" 2>/dev/null | tail -4
echo "=== summary"; cat "$SUMMARY"
exit $status
