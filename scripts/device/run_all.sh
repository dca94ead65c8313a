#!/usr/bin/env bash
# One device call: build (or reuse carried) GPU tools, check, sweep, benchmark.
# Usage (on the GPU machine, repo root): scripts/device/run_all.sh STAGES...
#   smoke   quick correctness on 2 ranks (auto mode)
#   check   full correctness: every dtype x op x size, large sizes to 1 GiB
#   modes   the same with one-shot / two-shot forced at every size
#   hier    hierarchy: forced on one group, G=1 (MPI between GPUs), 2 ranks
#           per GPU as 2 NV-groups (NVLink + MPI + pipelined chunks)
#   pipecheck the pipelined two-shot kernel forced at every size: default
#           chunk, smallest chunk (many chunks), odd grid; and un-pipelined
#   sanitize  compute-sanitizer memcheck + racecheck on a quick case, and on
#           the pipelined two-shot kernel with 1 block (many chunks)
#   sweep   kernel tuning sweep (one-/two-shot x grid caps)
#   pipeline  two-shot un-pipelined vs pipelined chunks x grid caps, 16 MiB..1 GiB
#   bench   nccl-tests tables vs NCCL and MPI + ResNet-50 gradient set
#   engine  the engine's full path (Enqueue) on the ResNet-50 gradient set
#   pytest  build the pybind11 module with CUDA, run tests/gpu
#   streams CUDA graphs (odd number of calls per graph, replays back to back and
#           mixed with eager calls) and two caller streams (REPEAT times)
#   peerexit  a rank exits with its memory mapped by the others: kUnavailable
#           naming it on every survivor
#   engine1 the engine's full path on 1 rank (per tensor, grouped, grouped in place)
#   cross   the cross-group step (cross_step_bench) on 2-4 ranks as groups of 1,
#           64 KiB..256 MiB; COMMIT=rev names the code in the JSON (default: git HEAD)
#   groups  (one GPU) quick check as groups of 3, 4 and 8 ranks on the one GPU
#   newcoll the collectives added for Horovod parity through the pybind module
#           (scripts/device/new_collectives_check.py: reducescatter, grouped
#           reducescatter, alltoall, grouped allgather, 8/16-bit integers; GPU vs
#           float64/exact reference and vs the CPU path) on 2 (full), 3 and 4
#           (quick) ranks (NEWCOLL_NP="4": only those); builds the module with
#           CUDA first (as pytest)
#   bounds  two-shot launch bounds (512, 1) vs the old (512, 2): times both
#           builds (scripts/device/bounds_variant.sh builds the second one; may
#           already run in the background)
# On a one-GPU machine every stage runs in the one-GPU group mode: NP ranks
# (default 2) share the GPU as one NV-group (NVGROUP_ONE_GPU_GROUP=1) under MPS
# (pipe/log folders under /tmp/nvgroup_mps; stopped on exit). The sanitizer
# stage runs without MPS (the contexts time-slice: slow but schedulable).
# Logs and JSON go to $OUT (at most 8 files); a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. scripts/device/device_env.sh
LOG="$OUT/run_all.log"
exec > >(tee -a "$LOG") 2>&1
STATUS=0
step() { echo "=== $* ($(date -u +%H:%M:%S))"; }
run() {  # run a command, record failure, keep going
  "$@"
  local rc=$?
  if [[ $rc -ne 0 ]]; then echo "!!! FAILED rc=$rc: $*"; STATUS=1; fi
  return 0
}

step "machine"
nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version,clocks.sm,clocks.mem --format=csv
nvidia-smi topo -m
NGPU=$(nvidia-smi -L | wc -l)
NCCL_DIR=$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0])" 2>/dev/null)
NCCL_LIB="$NCCL_DIR/lib/libnccl.so.2"
echo "NCCL: $NCCL_LIB"; ls -la "$NCCL_LIB"

step "build"
if ldd build/tools/allreduce_perf 2>/dev/null | grep -q "not found" || [[ ! -x build/tools/allreduce_perf ]] || [[ ${REBUILD:-0} == 1 ]]; then
  ldd build/tools/allreduce_perf 2>/dev/null | grep "not found"
  run scripts/device/build_tools.sh build/tools "$(nproc)"
else
  echo "using carried build/tools binaries"; ldd build/tools/allreduce_perf | grep -E "mpi|cudart"
fi
CHECK=build/tools/allreduce_check
PERF=build/tools/allreduce_perf
NP=$NGPU
REPEAT=${REPEAT:-3}
mps_start() { :; }
mps_stop() { :; }
if [[ $NGPU == 1 ]]; then
  NP=${NP_ONE_GPU:-2}
  export NVGROUP_ONE_GPU_GROUP=1
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvgroup_mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/nvgroup_mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  mps_start() { nvidia-cuda-mps-control -d && echo "MPS started" || { echo "!!! MPS did not start"; STATUS=1; }; sleep 1; }
  mps_stop() { echo quit | nvidia-cuda-mps-control > /dev/null 2>&1; sleep 2; echo "MPS stopped"; }
  trap 'mps_stop' EXIT
  step "one-GPU group mode: $NP ranks share cuda:0 as one NV-group (MPS)"
  mps_start
fi

for stage in "$@"; do
  case $stage in
    smoke)
      step "smoke: $NP ranks, quick"
      run timeout 120 mpirun -np $NP --bind-to none $CHECK --quick ;;
    check)
      step "check: $NP ranks, auto, all dtypes/ops/sizes + large"
      run timeout 300 mpirun -np $NP --bind-to none $CHECK --large ;;
    modes)
      step "check: forced two-shot"
      run timeout 300 mpirun -np $NP --bind-to none $CHECK --mode twoshot --no_timeout_test
      step "check: forced one-shot"
      run timeout 300 mpirun -np $NP --bind-to none $CHECK --mode oneshot --no_timeout_test ;;
    pipecheck)
      step "check: forced two-shot, smallest pipeline chunk (many chunks)"
      run timeout 300 mpirun -np $NP --bind-to none $CHECK --mode twoshot --twoshot_chunk 1 --no_timeout_test
      step "check: forced two-shot, 3 blocks, smallest chunk"
      run timeout 300 mpirun -np $NP --bind-to none $CHECK --mode twoshot --twoshot_blocks 3 --twoshot_chunk 1 --no_timeout_test --max_elems 1048583
      step "check: forced two-shot, un-pipelined"
      run timeout 300 mpirun -np $NP --bind-to none $CHECK --mode twoshot --twoshot_chunk 0 --no_timeout_test ;;
    hier)
      step "check: forced hierarchical on one group"
      run timeout 300 mpirun -np $NP --bind-to none -x NVGROUP_ALLREDUCE_ALGORITHM=hierarchical -x NVGROUP_PIPELINE_CHUNK=65536 $CHECK --no_timeout_test --max_elems 1048583
      step "check: groups of 1 (host-staged MPI between GPUs)"
      run timeout 300 mpirun -np $NP --bind-to none -x NVGROUP_GROUP_SIZE=1 -x NVGROUP_PIPELINE_CHUNK=65536 $CHECK --no_timeout_test --max_elems 1048583
      step "check: $((2*NP)) ranks on $NP GPUs as $NP-GPU groups x 2 (NVLink + MPI + pipeline)"
      run timeout 600 mpirun -np $((2*NP)) --bind-to none -x NVGROUP_GROUP_SIZE=$NP -x NVGROUP_PIPELINE_CHUNK=65536 $CHECK --no_timeout_test --max_elems 1048583 ;;
    streams)
      for i in $(seq 1 "$REPEAT"); do
        step "graphs + two caller streams, try $i"
        run timeout 200 mpirun -np $NP --bind-to none $CHECK --only_streams --no_timeout_test
      done ;;
    peerexit)
      step "peer exit with mapped memory ($NP ranks)"
      # the exiting rank must not make mpirun end the job before the others report
      OMPI_MCA_orte_allowed_exit_without_sync=1 timeout 120 mpirun -np $NP --bind-to none $CHECK --peer_exit_test > "$OUT/peerexit.txt" 2>&1
      grep "peer exit" "$OUT/peerexit.txt"
      if [[ $(grep -c "peer exit: rank .* -> PASSED" "$OUT/peerexit.txt") != $((NP - 1)) ]]; then
        echo "!!! FAILED: peer exit"; tail -20 "$OUT/peerexit.txt"; STATUS=1
      fi ;;
    groups)
      if [[ $NGPU == 1 ]]; then
        for g in 3 4 8; do
          step "check: $g ranks as one group on the one GPU, quick"
          run timeout 300 mpirun -np $g --bind-to none $CHECK --quick --no_timeout_test --max_elems 65539
        done
      fi ;;
    bounds)
      step "launch bounds: default build vs build/variant (two-shot at (512, 2))"
      for i in $(seq 1 300); do [[ -x build/variant/allreduce_check ]] && break; sleep 1; done
      [[ -x build/variant/allreduce_check ]] || scripts/device/bounds_variant.sh > "$OUT/ptxas_variant.txt" 2>&1
      for bytes in ${BOUNDS_BYTES:-268435456}; do
        for bin in $CHECK build/variant/allreduce_check $CHECK build/variant/allreduce_check; do
          echo "$bin"; run timeout 60 mpirun -np $NP --bind-to none $bin --time $bytes
        done
      done ;;
    sanitize)
      mps_stop
      step "compute-sanitizer memcheck (one-shot and two-shot, auto)"
      run timeout 300 mpirun -np $NP --bind-to none compute-sanitizer --tool memcheck --error-exitcode 9 $CHECK --quick --no_timeout_test --max_elems 1000
      step "compute-sanitizer racecheck"
      run timeout 300 mpirun -np $NP --bind-to none compute-sanitizer --tool racecheck --error-exitcode 9 $CHECK --quick --no_timeout_test --max_elems 1000
      step "compute-sanitizer synccheck"
      run timeout 300 mpirun -np $NP --bind-to none compute-sanitizer --tool synccheck --error-exitcode 9 $CHECK --quick --no_timeout_test --max_elems 1000
      step "compute-sanitizer memcheck + racecheck: pipelined two-shot, 1 block, smallest chunk"
      run timeout 300 mpirun -np $NP --bind-to none compute-sanitizer --tool memcheck --error-exitcode 9 $CHECK --quick --no_timeout_test --mode twoshot --twoshot_blocks 1 --twoshot_chunk 1 --max_elems 65539
      run timeout 300 mpirun -np $NP --bind-to none compute-sanitizer --tool racecheck --error-exitcode 9 $CHECK --quick --no_timeout_test --mode twoshot --twoshot_blocks 1 --twoshot_chunk 1 --max_elems 65539
      step "compute-sanitizer memcheck: graphs + two streams"
      run timeout 300 mpirun -np $NP --bind-to none compute-sanitizer --tool memcheck --error-exitcode 9 $CHECK --only_streams --no_timeout_test
      mps_start ;;
    sweep)
      step "sweep"
      run timeout 150 mpirun -np $NP --bind-to none $PERF --sweep --max_bytes 256M --nccl_lib "$NCCL_LIB" --json "$OUT/sweep.json" ;;
    pipeline)
      step "pipeline sweep"
      run timeout 300 mpirun -np $NP --bind-to none $PERF --pipeline_sweep --max_bytes 1G --nccl_lib "$NCCL_LIB" --json "$OUT/pipeline_sweep.json" ;;
    bench)
      step "bench"
      run timeout 250 mpirun -np $NP --bind-to none $PERF --max_bytes ${BENCH_MAX:-1G} --nccl_lib "$NCCL_LIB" --resnet benchmarks/resnet50_gradients.txt --json "$OUT/perf.json" > "$OUT/perf.txt" 2>&1
      sed -n '/^# summary/,$p' "$OUT/perf.txt" ;;
    engine)
      step "engine path: ResNet-50 gradient set through Enqueue (fusion -> kernel -> callback)"
      run timeout 200 mpirun -np $NP --bind-to none build/tools/engine_perf benchmarks/resnet50_gradients.txt 30 ;;
    engine1)
      step "engine path, 1 rank (nothing to communicate): per tensor, grouped, grouped in place, per-phase breakdown"
      run timeout 120 env NVGROUP_ONE_GPU_GROUP=0 mpirun -np 1 --bind-to none build/tools/engine_perf benchmarks/resnet50_gradients.txt 50
      run timeout 120 env NVGROUP_ONE_GPU_GROUP=0 mpirun -np 1 --bind-to none build/tools/engine_perf benchmarks/resnet50_gradients.txt 50 grouped
      run timeout 120 env NVGROUP_ONE_GPU_GROUP=0 mpirun -np 1 --bind-to none build/tools/engine_perf benchmarks/resnet50_gradients.txt 50 grouped inplace ;;
    cross)
      step "cross-group step: 2, 3, 4 ranks on the GPU as groups of 1 (host-staged), 64 KiB..256 MiB, vs D2H + MPI_Allreduce + H2D"
      COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
      for np in 2 3 4; do
        run timeout 300 env NVGROUP_ONE_GPU_GROUP=0 NVGROUP_GROUP_SIZE=1 mpirun -np $np --bind-to none \
          -x NVGROUP_ONE_GPU_GROUP -x NVGROUP_GROUP_SIZE build/tools/cross_step_bench --max_bytes 268435456 \
          --commit "$COMMIT" --json "$OUT/cross_step_np$np.json"
      done ;;
    pytest)
      step "pybind module with CUDA + tests/gpu"
      if command -v mpicxx > /dev/null; then
        NVGROUP_WITH_CUDA=1 NVGROUP_WITHOUT_TF=1 NVGROUP_BUILD_JOBS=$(nproc) timeout 300 python3 setup.py build_ext --inplace > "$OUT/pybind_build.log" 2>&1 || { echo "!!! pybind build failed"; tail -20 "$OUT/pybind_build.log"; STATUS=1; }
        run timeout 400 python3 -m pytest -q -x tests/gpu
      else
        echo "!!! no mpicxx on this machine: pybind module not built, tests/gpu not run"; STATUS=1
      fi ;;
    newcoll)
      step "new collectives through the pybind module on CUDA (2, 3, 4 ranks)"
      if command -v mpicxx > /dev/null; then
        NVGROUP_WITH_CUDA=1 NVGROUP_WITHOUT_TF=1 NVGROUP_BUILD_JOBS=$(nproc) timeout 400 python3 setup.py build_ext --inplace > "$OUT/pybind_build.log" 2>&1 || { echo "!!! pybind build failed"; tail -20 "$OUT/pybind_build.log"; STATUS=1; }
        for np in ${NEWCOLL_NP:-2 3 4}; do
          # several GPUs: one rank per GPU (ranks sharing a GPU need MPS, started only on one GPU)
          if (( NGPU > 1 && np > NGPU )); then echo "newcoll: $np ranks skipped ($NGPU GPUs)"; continue; fi
          args=(); [[ $np != 2 ]] && args=(--quick)
          run timeout 400 mpirun -np $np --bind-to none -x PYTHONPATH="$PWD" python3 scripts/device/new_collectives_check.py "${args[@]}"
        done
      else
        echo "!!! no mpicxx on this machine: pybind module not built, new collectives not checked"; STATUS=1
      fi ;;
    *) echo "unknown stage $stage"; STATUS=1 ;;
  esac
done
step "done, status $STATUS"
exit $STATUS
