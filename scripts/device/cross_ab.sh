#!/usr/bin/env bash
# Same-run before/after of the cross-group step on a GPU: builds the tools
# (build_tools.sh) in this tree and in BASELINE (the root of another checkout of
# the project, e.g. `git archive <commit> cc scripts benchmarks | tar -x -C .baseline`),
# the two builds side by side on half the cores each, then runs each tree's own
# cross_step_bench (2, 3 and 4 ranks on the one GPU as groups of 1, every
# bucket through the host-staged cross step over MPI, 64 KiB..MAX_BYTES),
# baseline first, then this tree, per rank count, so load drifts hit both.
# Each bench checks every element against the float64 reference and times the
# naive staged MPI (D2H, MPI_Allreduce, H2D) in the same run.
# Writes $OUT/cross_step_{base,this}_np{2,3,4}.json and $OUT/cross_ab.log.
# Usage (GPU machine, repo root): scripts/device/cross_ab.sh BASELINE BASE_COMMIT [MAX_BYTES]
set -uo pipefail
cd "$(dirname "$0")/../.."
BASE=${1:?usage: cross_ab.sh BASELINE BASE_COMMIT [MAX_BYTES]}
BASE_COMMIT=${2:?usage: cross_ab.sh BASELINE BASE_COMMIT [MAX_BYTES]}
MAX_BYTES=${3:-268435456}
THIS_COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/cross_ab.log"
. scripts/device/device_env.sh
STATUS=0
JOBS=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
echo "=== build: this tree ($THIS_COMMIT) and $BASE ($BASE_COMMIT), $JOBS jobs each ($(date -u +%H:%M:%S))" | tee "$LOG"
bash scripts/device/build_tools.sh build/tools "$JOBS" > "$OUT/build_this.log" 2>&1 &
P1=$!
(cd "$BASE" && bash scripts/device/build_tools.sh build/tools "$JOBS") > "$OUT/build_base.log" 2>&1 &
P2=$!
wait $P1 || { echo "!!! build failed (this tree)"; tail -20 "$OUT/build_this.log"; exit 1; }
wait $P2 || { echo "!!! build failed ($BASE)"; tail -20 "$OUT/build_base.log"; exit 1; }
echo "=== built ($(date -u +%H:%M:%S))" | tee -a "$LOG"
start_mps >> "$LOG" 2>&1 || { echo "!!! MPS did not start" | tee -a "$LOG"; STATUS=1; }
bench() {  # label tree-root commit ranks
  local label=$1 root=$2 commit=$3 np=$4 flags=()
  # an older bench has no --commit flag: its JSON then says "unknown"
  if grep -q -- '"--commit"' "$root/cc/tools/cross_step_bench.cc"; then flags=(--commit "$commit"); fi
  echo "=== $label ($commit), $np ranks ($(date -u +%H:%M:%S))" | tee -a "$LOG"
  timeout 280 env NVGROUP_ONE_GPU_GROUP=0 NVGROUP_GROUP_SIZE=1 mpirun -np "$np" --bind-to none \
    -x NVGROUP_ONE_GPU_GROUP -x NVGROUP_GROUP_SIZE "$root/build/tools/cross_step_bench" --max_bytes "$MAX_BYTES" \
    "${flags[@]}" --json "$OUT/cross_step_${label}_np$np.json" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  if [[ $rc -ne 0 ]]; then echo "!!! FAILED rc=$rc: $label $np ranks" | tee -a "$LOG"; STATUS=1; fi
}
for np in ${CROSS_NP:-2 3 4}; do
  bench base "$BASE" "$BASE_COMMIT" "$np"
  bench this . "$THIS_COMMIT" "$np"
done
exit $STATUS
