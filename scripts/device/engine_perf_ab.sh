#!/usr/bin/env bash
# Same-run before/after of the engine's full path on a GPU: builds the tools
# (build_tools.sh) in this tree and in BASELINE (the root of another checkout of
# the project, e.g. `git archive <commit> | tar -x -C .baseline`), then runs
# engine_perf on ResNet-50's gradient set alternately, baseline first, REPS
# times: 1 rank per tensor, 1 rank grouped out of place and in place (the
# outputs forwarded, as the TF adapter submits them when TF lets it), and NP
# ranks sharing the one GPU as one NV-group under MPS (grouped, grouped in
# place, per tensor), then the same launched as a registered group
# (`registered`, `registered_inplace`: RegisterGroup, the engine's persistent
# groups) on 1 and NP ranks: for both trees when BASELINE has registered
# groups, else for this tree only. ENGINE_PERF_RANKS (default "1 NP") picks the
# rank counts: ENGINE_PERF_RANKS=1 runs the 1-rank rows alone. Every run checks its outputs against float64
# (engine_perf's `wrong`). Both trees are built with this tree's
# cc/tools/engine_perf.cc (the harness: the same requests and timers on
# both sides; the engine is what is compared).
# Writes $OUT/engine_perf_ab.tsv (tree, rep, ranks, style, us per step, wrong)
# and $OUT/engine_perf_ab.log; scripts/device/engine_perf_ab_table.py turns the
# TSV into the JSON + PNG table.
# Usage (GPU machine, repo root): scripts/device/engine_perf_ab.sh BASELINE [REPS] [STEPS]
set -uo pipefail
cd "$(dirname "$0")/../.."
BASE=${1:?usage: engine_perf_ab.sh BASELINE [REPS] [STEPS]}
REPS=${2:-3}
STEPS=${3:-50}
NP=${NP_ONE_GPU:-2}
for pair in "REPS=$REPS" "STEPS=$STEPS" "NP_ONE_GPU=$NP"; do
  [[ ${pair#*=} =~ ^[1-9][0-9]*$ ]] || { echo "${pair%%=*}: '${pair#*=}' is not a whole number from 1"; exit 2; }
done
# The rank counts to run (ENGINE_PERF_RANKS=1: the 1-rank rows only, a short device call with no MPS).
RANKS=${ENGINE_PERF_RANKS:-"1 $NP"}
for np in $RANKS; do
  [[ $np =~ ^[1-9][0-9]*$ ]] || { echo "ENGINE_PERF_RANKS: '$np' is not a rank count (whole numbers from 1, e.g. \"1 2\")"; exit 2; }
done
[ -n "${RANKS// }" ] || { echo "ENGINE_PERF_RANKS is empty: give rank counts, e.g. \"1 2\""; exit 2; }
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
TSV="$OUT/engine_perf_ab.tsv"
LOG="$OUT/engine_perf_ab.log"
. scripts/device/device_env.sh
STATUS=0

echo "=== build: this tree and $BASE ($(date -u +%H:%M:%S))"
bash scripts/device/build_tools.sh build/tools "$(nproc)" > "$LOG" 2>&1 || { echo "!!! build failed (this tree)"; tail -20 "$LOG"; exit 1; }
cp cc/tools/engine_perf.cc "$BASE/cc/tools/engine_perf.cc"
(cd "$BASE" && bash scripts/device/build_tools.sh build/tools "$(nproc)") >> "$LOG" 2>&1 || { echo "!!! build failed ($BASE)"; tail -20 "$LOG"; exit 1; }

[[ " $RANKS " == " 1 " ]] || start_mps || STATUS=1

printf 'tree\trep\tranks\tstyle\tus_per_step\twrong\n' > "$TSV"
# An older baseline has no registered groups (engine_perf's `registered`
# needs NVG_HAS_REGISTERED_GROUPS, nvgroup/engine.h).
BASE_REGISTERED=0
grep -q NVG_HAS_REGISTERED_GROUPS "$BASE/cc/include/nvgroup/engine.h" && BASE_REGISTERED=1
one() {  # tree-label tools-dir ranks style(grouped|registered|per_tensor, optionally _inplace)
  local label=$1 tools=$2 np=$3 style=$4 extra=() line us wrong
  [[ $style == grouped* ]] && extra+=(grouped)
  [[ $style == registered* ]] && extra+=(registered)
  [[ $style == *_inplace ]] && extra+=(inplace)
  local group=0; (( np > 1 )) && group=1
  line=$(timeout 200 env NVGROUP_ONE_GPU_GROUP=$group mpirun -np "$np" --bind-to none -x NVGROUP_ONE_GPU_GROUP \
         "$tools/engine_perf" benchmarks/resnet50_gradients.txt "$STEPS" "${extra[@]}" 2>&1 | tee -a "$LOG" |
         grep '^# engine_perf: ')
  us=$(sed -n 's/.*: \([0-9.]*\) us per step.*/\1/p' <<< "$line")
  wrong=$(sed -n 's/.*wrong \([0-9]*\).*/\1/p' <<< "$line")
  if [[ -z $us || $wrong != 0 ]]; then echo "!!! FAILED: $label $np ranks $style: '$line'"; STATUS=1; fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$label" "$rep" "$np" "$style" "${us:-nan}" "${wrong:-nan}" >> "$TSV"
}
plain=() registered=()
for np in $RANKS; do
  if (( np == 1 )); then plain+=("1 per_tensor" "1 grouped" "1 grouped_inplace")
  else plain+=("$np grouped" "$np grouped_inplace" "$np per_tensor"); fi
  registered+=("$np registered" "$np registered_inplace")
done
for rep in $(seq 1 "$REPS"); do
  echo "=== rep $rep ($(date -u +%H:%M:%S))"
  for cfg in "${plain[@]}"; do
    read -r np style <<< "$cfg"
    one baseline "$BASE/build/tools" "$np" "$style"
    one this build/tools "$np" "$style"
  done
  for cfg in "${registered[@]}"; do
    read -r np style <<< "$cfg"
    (( BASE_REGISTERED )) && one baseline "$BASE/build/tools" "$np" "$style"
    one this build/tools "$np" "$style"
  done
done
cat "$TSV"
echo "=== done, status $STATUS"
exit $STATUS
