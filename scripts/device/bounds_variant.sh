#!/usr/bin/env bash
# Launch-bounds comparison build: allreduce_check with the two-shot kernel at
# the old __launch_bounds__(512, 2) (NVGROUP_TWOSHOT_MIN_BLOCKS_PER_SM=2),
# linked from the objects of scripts/device/build_tools.sh, into
# build/variant/. The -Xptxas -v report goes to stdout. Then time both builds
# with `allreduce_check --time BYTES` (docs/PERFORMANCE.md "Launch bounds").
set -euo pipefail
cd "$(dirname "$0")/../.."
B=build/tools V=build/variant
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$V"
nvcc -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -DNVGROUP_WITH_CUDA=1 -Icc/include -Icc \
  -DNVGROUP_TWOSHOT_MIN_BLOCKS_PER_SM=2 -Xptxas -v -c cc/kernels/p2p_allreduce.cu -o "$V/p2p.o" 2>&1
OBJS=""
for s in cc/kernels/batched_copy.cu cc/common/env.cc cc/common/status.cc cc/common/types.cc \
         cc/topology/topology.cc cc/cpu/host_reduce.cc cc/algorithms/cross_exchange.cc cc/device/peer_access_advice.cc \
         $(ls cc/device/*_cuda.cc); do
  OBJS+=" $B/$(echo "$s" | tr / _).o"
done
g++ -o "$V/allreduce_check" "$B/cc_tools_allreduce_check.cc.o" "$B/cc_tools_round_kernels.cu.o" \
  "$V/p2p.o" $OBJS $(mpicxx --showme:link) -L"$CUDA_HOME/lib64" -lcudart -ldl -lpthread -lrt
echo "built $V/allreduce_check"
