#!/usr/bin/env bash
# The TF GPU op on a GPU machine without TensorFlow, through the kit in ../shared/tfgpu: the kit's last
# step (install TF and the staged op), the TF GPU suite (tests/gpu/test_tf_gpu.py) and the step benchmark
# (tf_gpu_step_bench.py), in one command. How to get here (README 'Builds and checks'):
#   here:   bash ../shared/tfgpu/prepare.sh; then for each part N: bash scripts/device/tfgpu_carry.sh N
#           and send .tfgpu/carry with the project, running `bash .tfgpu/carry/device.sh` for every part
#           but the last; for the last one run instead:
#   there:  bash .tfgpu/carry/tfgpu_suite.sh [STAGE...]       (default: suite bench)
# Stages: suite  the TF GPU suite (parallel part, then the *memory* tests alone: they take the GPU's memory)
#         full   (kit in TFGPU_FULL=1 mode: real cuBLAS/cuDNN) the XLA worker (default lowering), Keras fit of Dense and Conv models, with and
#                without XLA, and examples/resnet50/train.py on the GPU (NVGROUP_TEST_TF_GPU_DENSE=1)
#         mps    the suite's parallel part again with the ranks sharing the GPU under MPS, as one NV-group
#                (NVGROUP_ONE_GPU_GROUP=1) and as groups of 1 (=0: every collective through the host-staged
#                cross step over MPI); with NVGROUP_TEST_TF_GPU_DENSE=1 also its Dense/Conv/XLA cases;
#                TFGPU_MPS_TESTS: the tests (a pytest -k expression, default "not memory")
#         bench  step cost, 1 and 2 ranks sharing the GPU
#         race   the allgather-race check alone (2 ranks), and on the baseline when one is carried
#         old    if tfgpu_carry.sh carried a baseline op library (TFGPU_OLD_LIB): the adapter-defect checks
#                (during `suite`) and the benchmark against it, to show what the fixes change
# Logs go to $OUT (at most 8 files come back); a summary is printed last.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${*:-suite bench}
bash "$HERE/device.sh" || { echo "the kit's install failed"; exit 1; }
. /tmp/tfgpu/env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NVGROUP_TEST_GPU_MB=${NVGROUP_TEST_GPU_MB:-2048} NVG_COMMIT=$(cat "$HERE/commit" 2>/dev/null || echo "?")
# The kit's stage carries the package and tests/; the example the suite trains comes from this tree.
[ -d examples/resnet50 ] && cp -r examples "$NVG_REPO/"
cd "$NVG_REPO"
SUMMARY=$OUT/summary.txt; : > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
note "machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1), $(nproc) cores; commit $NVG_COMMIT; $(date -u +%FT%TZ)"
status=0

# Every step gets at most what is left of TFGPU_SUITE_SECONDS (default 540, counted from this script's
# start, the install included), so the call ends in time and its logs come back.
DEADLINE=${TFGPU_SUITE_SECONDS:-540}
left() { local l=$((DEADLINE - SECONDS)); [ $l -lt 1 ] && l=1; [ $l -lt "$1" ] && echo $l || echo "$1"; }
OLD=""
if [[ " $STAGES " == *" old "* || " $STAGES " == *" race "* ]] && [ -f "$HERE/old/libnvgroup_tf_ops.so" ]; then
  rm -rf /tmp/tfgpu/old && mkdir -p /tmp/tfgpu/old
  if [ -d "$HERE/old/nvgroup_tf" ]; then cp -r "$HERE/old/nvgroup_tf" /tmp/tfgpu/old/  # the baseline's own package
  else cp -r /tmp/tfgpu/proj/nvgroup_tf /tmp/tfgpu/old/; fi
  mkdir -p /tmp/tfgpu/old/nvgroup_tf/lib && cp "$HERE/old/libnvgroup_tf_ops.so" /tmp/tfgpu/old/nvgroup_tf/lib/
  OLD=/tmp/tfgpu/old:/tmp/tfgpu/proj/tests/gpu/workers:/tmp/tfgpu/site
  note "old: baseline $(cat "$HERE/old/ref" 2>/dev/null) (its package and op library)"
fi
W=/tmp/tfgpu/proj/tests/gpu/workers
old_check() {  # old_check SECONDS NP SCRIPT ARGS...: a worker on the baseline library, into old.log
  local t=$1 np=$2; shift 2
  echo "== baseline: np=$np $*" >> "$OUT/old.log"
  PYTHONPATH=$OLD timeout "$(left "$t")" mpirun -np "$np" $MPIRUN_X python3 "$W/$@" >> "$OUT/old.log" 2>&1
  echo "rc=$? (baseline np=$np $*)" >> "$OUT/old.log"
}

for stage in $STAGES; do
  case $stage in
    suite)
      # The baseline's allgather-race check beside the parallel suite (correctness only, no timing).
      if [ -n "$OLD" ]; then old_check 150 2 tf_gpu_collectives.py race & OLD_PID=$!; fi
      timeout "$(left 240)" python3 -m pytest -q -rs -n 8 -p no:cacheprovider tests/gpu/test_tf_gpu.py -k "not memory" \
        > "$OUT/suite.log" 2>&1; rc=$?
      note "suite (parallel): rc=$rc $(tail -1 "$OUT/suite.log")"; [ $rc = 0 ] || status=1
      [ -n "$OLD" ] && wait "$OLD_PID"
      # They take the GPU's memory: alone.
      timeout "$(left 120)" python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_tf_gpu.py -k memory \
        > "$OUT/suite_memory.log" 2>&1; rc=$?
      note "suite (memory, alone): rc=$rc $(tail -1 "$OUT/suite_memory.log")"; [ $rc = 0 ] || status=1
      if [ -n "$OLD" ]; then
        old_check 60 1 tf_gpu_memory.py after_init
        old_check 60 2 tf_gpu_memory.py before_init
      fi ;;
    full)
      NVGROUP_TEST_TF_GPU_DENSE=1 timeout "$(left 300)" python3 -m pytest -q -rs -n 3 -p no:cacheprovider \
        tests/gpu/test_tf_gpu.py -k "keras or xla" > "$OUT/suite_full.log" 2>&1; rc=$?
      note "suite (full: Dense/Conv fit with and without XLA, the XLA worker): rc=$rc $(tail -1 "$OUT/suite_full.log")"; [ $rc = 0 ] || status=1
      # One at a time (they time the GPU) and with -s: the img/s lines are printed.
      NVGROUP_TEST_TF_GPU_DENSE=1 timeout "$(left 300)" python3 -m pytest -q -rs -s -p no:cacheprovider \
        tests/gpu/test_tf_gpu.py -k "resnet50" >> "$OUT/suite_full.log" 2>&1; rc=$?
      note "suite (full: ResNet-50 example): rc=$rc $(tail -1 "$OUT/suite_full.log")"; [ $rc = 0 ] || status=1
      grep -h '^RESNET50_GPU' "$OUT/suite_full.log" | cut -c1-400 | tee -a "$SUMMARY" ;;
    mps)
      MPS_TESTS=${TFGPU_MPS_TESTS:-not memory}  # a pytest -k expression over tests/gpu/test_tf_gpu.py
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvgroup_mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/nvgroup_mps/log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      if nvidia-cuda-mps-control -d; then
        for g in 1 0; do
          NVGROUP_ONE_GPU_GROUP=$g timeout "$(left 240)" python3 -m pytest -q -rs -n 4 -p no:cacheprovider \
            tests/gpu/test_tf_gpu.py -k "$MPS_TESTS" > "$OUT/suite_mps_group$g.log" 2>&1; rc=$?
          note "suite under MPS, NVGROUP_ONE_GPU_GROUP=$g: rc=$rc $(tail -1 "$OUT/suite_mps_group$g.log")"
          [ $rc = 0 ] || status=1
        done
        echo quit | nvidia-cuda-mps-control > /dev/null 2>&1
      else
        note "mps: the MPS daemon did not start"; status=1
      fi
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY ;;
    race)
      timeout "$(left 150)" mpirun -np 2 $MPIRUN_X python3 "$W/tf_gpu_collectives.py" race > "$OUT/race.log" 2>&1; rc=$?
      note "race (2 ranks, this code): rc=$rc $(grep -h 'checks, ' "$OUT/race.log" | tr '\n' ' ')"; [ $rc = 0 ] || status=1
      [ -n "$OLD" ] && old_check 150 2 tf_gpu_collectives.py race ;;
    bench)
      for np in 1 2; do
        timeout "$(left 60)" mpirun -np $np $MPIRUN_X -x NVG_COMMIT python3 "$HERE/tf_gpu_step_bench.py" --label fixed \
          --json "$OUT/step.jsonl" >> "$OUT/bench.log" 2>&1 || { status=1; note "bench np=$np failed or out of time"; }
      done
      grep '^STEP' "$OUT/bench.log" | tee -a "$SUMMARY" ;;
    old)
      [ -n "$OLD" ] || { note "old: no baseline library carried"; continue; }
      for np in 1 2; do
        PYTHONPATH=$OLD timeout "$(left 60)" mpirun -np $np $MPIRUN_X -x NVG_COMMIT python3 "$HERE/tf_gpu_step_bench.py" \
          --label baseline --json "$OUT/step.jsonl" >> "$OUT/bench.log" 2>&1 || note "baseline bench np=$np failed or out of time"
      done
      grep '^STEP baseline' "$OUT/bench.log" | tee -a "$SUMMARY" ;;
    *) note "unknown stage $stage"; status=1 ;;
  esac
done
[ -f "$OUT/old.log" ] && grep -E "^== |^rc=|FAIL|PASSED|checks,|raised" "$OUT/old.log" | cut -c1-300 | tee -a "$SUMMARY" >/dev/null
grep -E "passed|failed|error" "$OUT/suite.log" "$OUT/suite_memory.log" 2>/dev/null | tail -4
echo "=== summary"; cat "$SUMMARY"
exit $status
