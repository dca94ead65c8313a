#!/usr/bin/env bash
# Which commit changed the engine's cost on a GPU: builds engine_perf (this
# tree's cc/tools/engine_perf.cc, the same harness for every tree) in each
# tree given, then runs it on ResNet-50's gradient set, the trees alternated
# within each rep (oldest first): 1 rank one call per tensor, 1 rank grouped
# (the control), and NP ranks sharing the GPU as one NV-group under MPS, per
# tensor. Every run checks its outputs against float64 (engine_perf's `wrong`)
# and its whole output (the phase breakdown: cycles, buckets, the loop's
# seconds per phase) goes to the log.
# Each tree is the root of a checkout (`git archive REV cc | tar -x -C DIR`);
# its CUDA objects are compiled once per distinct source (a .cu file and the
# headers it can include: cc/kernels, cc/include, cc/common), so trees that
# share their kernels share their objects.
# BISECT_CONFIGS="1 per_tensor,1 grouped" picks the runs (default: the three above).
# BISECT_BUILD_ONLY=1 stops after the builds; BISECT_SKIP_BUILD=1 runs what
# an earlier call built.
# Writes $OUT/engine_perf_bisect.tsv (tree, rep, ranks, style, us per step,
# wrong) and $OUT/engine_perf_bisect.log; the build logs go to $BUILD_LOGS
# (default /tmp/engine_perf_bisect_logs: the device tool returns at most 8
# files), their tails to stdout when a build fails.
# A tree inside a carried folder is replaced at every device call: give trees
# outside it (copy them to /tmp first) when building and running in two calls.
# Usage (GPU machine, repo root): scripts/device/engine_perf_bisect.sh REPS STEPS LABEL=TREE...
set -uo pipefail
cd "$(dirname "$0")/../.."
REPS=${1:?usage: engine_perf_bisect.sh REPS STEPS LABEL=TREE...}
STEPS=${2:?usage: engine_perf_bisect.sh REPS STEPS LABEL=TREE...}
shift 2
NP=${NP_ONE_GPU:-2}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
TSV="$OUT/engine_perf_bisect.tsv"
LOG="$OUT/engine_perf_bisect.log"
. scripts/device/device_env.sh
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
GENCODE=$(python3 scripts/cuda_arch.py "${NVGROUP_CUDA_ARCH:-90}" | tr '\n' ' ') && [ -n "$GENCODE" ] || exit 2
MPI_COMPILE=$(mpicxx --showme:compile)
MPI_LINK=$(mpicxx --showme:link)
CACHE=${CU_CACHE:-/tmp/engine_perf_bisect_cu}
BUILD_LOGS=${BUILD_LOGS:-/tmp/engine_perf_bisect_logs}
mkdir -p "$CACHE" "$BUILD_LOGS"
HARNESS=$(pwd)/cc/tools/engine_perf.cc
STATUS=0
: >> "$LOG"

# A tree's CUDA kernels, each compiled once per distinct source into $CACHE:
# the key hashes the .cu file and every file of the tree it includes (nvcc -M),
# so trees whose kernels are the same share the objects.
kernel_objects() {  # tree dir -> "source object" lines on stdout
  local dir=$1 src key
  for src in $(cd "$dir" && ls cc/kernels/*.cu); do
    key=$(cd "$dir" && nvcc -M -std=c++17 -DNVGROUP_WITH_CUDA=1 -Icc/include -Icc "$src" | tr ' \\' '\n\n' |
          grep '^cc/' | sort -u | xargs cat | (cat; echo "$GENCODE") | sha1sum | cut -c1-16)
    echo "$src $CACHE/$(basename "$src" .cu)_$key.o"
  done
}
build_host() {  # tree dir -> dir/build/bisect/engine_perf
  local dir=$1 objs cc_srcs src
  (
    cd "$dir" || exit 1
    mkdir -p build/bisect
    local cxx="-O3 -std=c++17 -Wall -Wno-unused-function -DOMPI_SKIP_MPICXX=1 -DNVGROUP_WITH_CUDA=1 -Icc/include -Icc -I$CUDA_HOME/include $MPI_COMPILE"
    cp "$HARNESS" build/bisect/engine_perf.cc
    cc_srcs=$(find cc -name '*.cc' ! -path 'cc/python/*' ! -path 'cc/tools/*' ! -path 'cc/tests/*' | sort)
    printf '%s\n' $cc_srcs build/bisect/engine_perf.cc |
      xargs -P "$JOBS" -I{} sh -c "g++ $cxx -c {} -o build/bisect/\$(echo {} | tr / _).o" || exit 1
    objs=$(cut -d' ' -f2 build/bisect_kernels.txt | tr '\n' ' ')
    for src in $cc_srcs build/bisect/engine_perf.cc; do objs+=" build/bisect/$(echo "$src" | tr / _).o"; done
    g++ -o build/bisect/engine_perf $objs $MPI_LINK -L"$CUDA_HOME/lib64" -lcudart -ldl -lpthread -lrt || exit 1
  ) >> "$BUILD_LOGS/build_$(basename "$dir").log" 2>&1
}

LABELS=() DIRS=()
for spec in "$@"; do
  dir=$(cd "${spec#*=}" 2>/dev/null && pwd) || { echo "!!! no tree at ${spec#*=}"; exit 2; }
  LABELS+=("${spec%%=*}") DIRS+=("$dir")
done
if [[ ${BISECT_SKIP_BUILD:-0} != 1 ]]; then
  echo "=== build ${#DIRS[@]} trees ($(date -u +%H:%M:%S))" | tee -a "$LOG"
  # Every tree's missing kernel objects at once (each distinct source once),
  # then every tree's host sources in parallel.
  for i in "${!DIRS[@]}"; do
    mkdir -p "${DIRS[$i]}/build"
    kernel_objects "${DIRS[$i]}" > "${DIRS[$i]}/build/bisect_kernels.txt" || { echo "!!! nvcc -M failed: ${LABELS[$i]}"; exit 1; }
    while read -r src obj; do [[ -f $obj ]] || echo "${DIRS[$i]} $src $obj"; done < "${DIRS[$i]}/build/bisect_kernels.txt"
  done | sort -u -k3,3 |
    xargs -r -P "$(nproc)" -L1 sh -c 'cd "$0" && nvcc '"-O3 -std=c++17 $GENCODE -DNVGROUP_WITH_CUDA=1 -Icc/include -Icc"' -c "$1" -o "$2.tmp" && mv "$2.tmp" "$2"' \
    >> "$BUILD_LOGS/build_kernels.log" 2>&1 || { echo "!!! kernels failed"; tail -20 "$BUILD_LOGS/build_kernels.log"; exit 1; }
  echo "=== kernels built ($(date -u +%H:%M:%S)), $(ls "$CACHE" | wc -l) distinct objects" | tee -a "$LOG"
  JOBS=$(( $(nproc) / ${#DIRS[@]} > 0 ? $(nproc) / ${#DIRS[@]} : 1 ))
  PIDS=()
  for i in "${!DIRS[@]}"; do build_host "${DIRS[$i]}" & PIDS+=($!); done
  for i in "${!PIDS[@]}"; do
    wait "${PIDS[$i]}" || { echo "!!! build failed: ${LABELS[$i]}"; tail -20 "$BUILD_LOGS/build_$(basename "${DIRS[$i]}").log"; exit 1; }
  done
  echo "=== built ($(date -u +%H:%M:%S))" | tee -a "$LOG"
fi
[[ ${BISECT_BUILD_ONLY:-0} == 1 ]] && exit 0

start_mps || STATUS=1

printf 'tree\trep\tranks\tstyle\tus_per_step\twrong\n' > "$TSV"
one() {  # label binary ranks style(per_tensor|grouped)
  local label=$1 bin=$2 np=$3 style=$4 extra=() line us wrong group=0
  [[ $style == grouped ]] && extra+=(grouped)
  (( np > 1 )) && group=1
  echo "--- $label $np $style rep $rep" >> "$LOG"
  line=$(timeout 120 env NVGROUP_ONE_GPU_GROUP=$group mpirun -np "$np" --bind-to none -x NVGROUP_ONE_GPU_GROUP \
         "$bin" benchmarks/resnet50_gradients.txt "$STEPS" "${extra[@]}" 2>&1 | tee -a "$LOG" | grep '^# engine_perf: ')
  us=$(sed -n 's/.*: \([0-9.]*\) us per step.*/\1/p' <<< "$line")
  wrong=$(sed -n 's/.*wrong \([0-9]*\).*/\1/p' <<< "$line")
  if [[ -z $us || $wrong != 0 ]]; then echo "!!! FAILED: $label $np ranks $style: '$line'"; STATUS=1; fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$label" "$rep" "$np" "$style" "${us:-nan}" "${wrong:-nan}" >> "$TSV"
}
for rep in $(seq 1 "$REPS"); do
  echo "=== rep $rep ($(date -u +%H:%M:%S))" | tee -a "$LOG"
  IFS=, read -r -a CONFIGS <<< "${BISECT_CONFIGS:-1 per_tensor,1 grouped,$NP per_tensor}"
  for cfg in "${CONFIGS[@]}"; do
    read -r np style <<< "$cfg"
    for i in "${!DIRS[@]}"; do one "${LABELS[$i]}" "${DIRS[$i]}/build/bisect/engine_perf" "$np" "$style"; done
  done
done
cat "$TSV"
echo "=== done, status $STATUS ($(date -u +%H:%M:%S))"
exit $STATUS
