#!/usr/bin/env bash
# One tree's engine_perf in every submission style, alternated REPS times: on
# 1 rank and NP ranks sharing the one GPU as one NV-group under MPS, ResNet-50's
# gradient set grouped (EnqueueGroup), through a registered group (RegisterGroup
# / EnqueueRegisteredGroup), each also in place, and one Enqueue per tensor.
# Every run checks its outputs against float64 (engine_perf's `wrong`).
# Writes $OUT/engine_perf_styles.tsv (rep, ranks, style, us per step, wrong)
# and $OUT/engine_perf_styles.log.
# Usage (GPU machine, repo root): scripts/device/engine_perf_styles.sh [REPS] [STEPS]
set -uo pipefail
cd "$(dirname "$0")/../.."
REPS=${1:-3}
STEPS=${2:-50}
NP=${NP_ONE_GPU:-2}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
TSV="$OUT/engine_perf_styles.tsv"
LOG="$OUT/engine_perf_styles.log"
. scripts/device/device_env.sh
STATUS=0
echo "=== build ($(date -u +%H:%M:%S))"
bash scripts/device/build_tools.sh build/tools "$(nproc)" > "$LOG" 2>&1 || { echo "!!! build failed"; tail -20 "$LOG"; exit 1; }
start_mps || STATUS=1
printf 'rep\tranks\tstyle\tus_per_step\twrong\n' > "$TSV"
for rep in $(seq 1 "$REPS"); do
  echo "=== rep $rep ($(date -u +%H:%M:%S))"
  for np in 1 "$NP"; do
    for style in grouped registered grouped_inplace registered_inplace per_tensor; do
      extra=()
      [[ $style == grouped* ]] && extra+=(grouped)
      [[ $style == registered* ]] && extra+=(registered)
      [[ $style == *_inplace ]] && extra+=(inplace)
      group=0; (( np > 1 )) && group=1
      line=$(timeout 120 env NVGROUP_ONE_GPU_GROUP=$group mpirun -np "$np" --bind-to none -x NVGROUP_ONE_GPU_GROUP \
             build/tools/engine_perf benchmarks/resnet50_gradients.txt "$STEPS" "${extra[@]}" 2>&1 | tee -a "$LOG" |
             grep '^# engine_perf: ')
      us=$(sed -n 's/.*: \([0-9.]*\) us per step.*/\1/p' <<< "$line")
      wrong=$(sed -n 's/.*wrong \([0-9]*\).*/\1/p' <<< "$line")
      if [[ -z $us || $wrong != 0 ]]; then echo "!!! FAILED: $np ranks $style: '$line'"; STATUS=1; fi
      printf '%s\t%s\t%s\t%s\t%s\n' "$rep" "$np" "$style" "${us:-nan}" "${wrong:-nan}" >> "$TSV"
    done
  done
done
cat "$TSV"
echo "=== done, status $STATUS"
exit $STATUS
