#!/usr/bin/env bash
# Builds and runs cc/tools/cross_exchange_cost (CPU only): the cross-group
# exchange of this tree, call by call alternated with a baseline commit's
# (its cc/algorithms/cross_exchange.{h,cc}, CrossExchange renamed
# BaseCrossExchange) and with MPI_Allreduce, on host buffers. -O3, as setup.py
# and scripts/device/build_tools.sh build the library.
# Usage: scripts/cross_exchange_cost.sh [BASE_REV (default: merge-base with main)] [flags passed to the tool]
#   NP=2 (ranks), OUT=dir (JSON: $OUT/cross_exchange_cost_np$NP.json)
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:-$(git merge-base HEAD main)}
shift || true
NP=${NP:-2}
OUT=${OUT:-build/tools}
BUILD=build/tools
mkdir -p "$BUILD" "$OUT"
GEN=$(mktemp -d)
trap 'rm -rf "$GEN"' EXIT
rename='s/CrossExchange/BaseCrossExchange/g; s/CrossJobs/BaseCrossJobs/g'
git show "$BASE:cc/algorithms/cross_exchange.h" | sed "$rename" > "$GEN/base_cross_exchange.h"
git show "$BASE:cc/algorithms/cross_exchange.cc" | sed "$rename; s#\"algorithms/cross_exchange.h\"#\"base_cross_exchange.h\"#" \
  > "$GEN/base_cross_exchange.cc"
mpicxx -O3 -std=c++17 -Wall -DOMPI_SKIP_MPICXX=1 -DNVG_WITH_BASE_CROSS_EXCHANGE=1 -Icc/include -Icc -I"$GEN" \
  -o "$BUILD/cross_exchange_cost" cc/tools/cross_exchange_cost.cc "$GEN/base_cross_exchange.cc" \
  cc/algorithms/cross_exchange.cc cc/cpu/host_reduce.cc cc/common/env.cc cc/common/status.cc cc/common/types.cc \
  -lpthread
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
mpirun -np "$NP" --bind-to none "$BUILD/cross_exchange_cost" --commit "$(git rev-parse --short HEAD)" \
  --base_commit "$(git rev-parse --short "$BASE")" --json "$OUT/cross_exchange_cost_np$NP.json" "$@"
