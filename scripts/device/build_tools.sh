#!/usr/bin/env bash
# Builds the GPU tools (allreduce_check, allreduce_perf, engine_perf,
# p2p_bandwidth, cross_step_bench, copy_bench) from the
# engine's sources: nvcc for cc/kernels/*.cu, g++ for the rest, linked with
# Open MPI and cudart. setup.py builds libraries, not binaries, hence this.
# Usage: scripts/device/build_tools.sh [build_dir] [jobs]
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build/tools}
JOBS=${2:-$(nproc)}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
ARCH=${NVGROUP_CUDA_ARCH:-90}  # a list: "70;80;90"
GENCODE=$(python3 scripts/cuda_arch.py "$ARCH" | tr '\n' ' ') && [ -n "$GENCODE" ] || exit 2
mkdir -p "$BUILD"
MPI_COMPILE=$(mpicxx --showme:compile)
MPI_LINK=$(mpicxx --showme:link)
CXXFLAGS="-O3 -std=c++17 -Wall -Wno-unused-function -DOMPI_SKIP_MPICXX=1 -DNVGROUP_WITH_CUDA=1 -Icc/include -Icc -I$CUDA_HOME/include $MPI_COMPILE"
NVFLAGS="-O3 -std=c++17 $GENCODE -DNVGROUP_WITH_CUDA=1 -Icc/include -Icc"

# The communicator's closure: common, topology, host folds (tools' reference), device, tools;
# the factory defines Communicator's out-of-line virtual (DelayStream), so its typeinfo,
# and brings the CPU communicator with it.
HOST_SRCS="cc/common/collective_args.cc cc/common/env.cc cc/common/logging.cc cc/common/status.cc cc/common/types.cc cc/topology/topology.cc cc/cpu/host_reduce.cc cc/algorithms/cross_exchange.cc cc/device/peer_access_advice.cc cc/communicator/communicator_factory.cc cc/cpu/cpu_communicator.cc cc/cpu/host_primitives.cc cc/transport/shm_group.cc"
CUDA_CC_SRCS=$(ls cc/device/*_cuda.cc)
CU_SRCS=$(ls cc/kernels/*.cu)
# engine_perf links the whole engine (as setup.py's engine_sources()).
ENGINE_SRCS=$(find cc -name '*.cc' ! -path 'cc/python/*' ! -path 'cc/tools/*' ! -path 'cc/tests/*' ! -name '*_cuda.cc' | sort)

compile() {  # src -> $BUILD/<flattened>.o, only when stale
  local src=$1 obj="$BUILD/$(echo "$1" | tr / _).o"
  if [[ -f "$obj" && "$obj" -nt "$src" && -z "$(find cc -name '*.h' -newer "$obj" -o -name '*.cuh' -newer "$obj" | head -1)" ]]; then return 0; fi
  if [[ $src == *.cu ]]; then nvcc $NVFLAGS -c "$src" -o "$obj"; else g++ $CXXFLAGS -c "$src" -o "$obj"; fi
}
export -f compile
export BUILD CXXFLAGS NVFLAGS
printf '%s\n' $CU_SRCS $ENGINE_SRCS $CUDA_CC_SRCS cc/tools/round_kernels.cu cc/tools/allreduce_check.cc cc/tools/allreduce_perf.cc cc/tools/engine_perf.cc cc/tools/cross_step_bench.cc cc/tools/copy_bench.cc | sort -u |
  xargs -P "$JOBS" -I{} bash -c 'compile {}'
LIB_OBJS=""
for s in $CU_SRCS $HOST_SRCS $CUDA_CC_SRCS; do LIB_OBJS+=" $BUILD/$(echo "$s" | tr / _).o"; done
g++ -o "$BUILD/allreduce_check" "$BUILD/cc_tools_allreduce_check.cc.o" "$BUILD/cc_tools_round_kernels.cu.o" $LIB_OBJS $MPI_LINK -L"$CUDA_HOME/lib64" -lcudart -ldl -lpthread -lrt
for tool in allreduce_perf cross_step_bench copy_bench; do
  g++ -o "$BUILD/$tool" "$BUILD/cc_tools_$tool.cc.o" $LIB_OBJS $MPI_LINK -L"$CUDA_HOME/lib64" -lcudart -ldl -lpthread -lrt
done
ENGINE_OBJS=""
for s in $CU_SRCS $ENGINE_SRCS $CUDA_CC_SRCS; do ENGINE_OBJS+=" $BUILD/$(echo "$s" | tr / _).o"; done
g++ -o "$BUILD/engine_perf" "$BUILD/cc_tools_engine_perf.cc.o" $ENGINE_OBJS $MPI_LINK -L"$CUDA_HOME/lib64" -lcudart -ldl -lpthread -lrt
nvcc $NVFLAGS -o "$BUILD/p2p_bandwidth" cc/tools/p2p_bandwidth.cu
echo "built $BUILD/allreduce_check $BUILD/allreduce_perf $BUILD/cross_step_bench $BUILD/copy_bench $BUILD/engine_perf $BUILD/p2p_bandwidth"
