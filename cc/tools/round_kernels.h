// Device helpers of allreduce_check's CUDA-graph test: a round counter in
// device memory picks each round's input and where its result is kept, so a
// captured graph replayed many times still sees new data every round (host
// values would be frozen into the graph at capture).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace nvgroup {
namespace tools {

// dst = bank[*round] (rounds of `bytes` each, bytes a multiple of 4).
cudaError_t LaunchSelectRound(const void* bank, void* dst, size_t bytes, const uint32_t* round,
                              cudaStream_t stream);
// history[*round] = src.
cudaError_t LaunchStoreRound(const void* src, void* history, size_t bytes, const uint32_t* round,
                             cudaStream_t stream);
// ++*round.
cudaError_t LaunchNextRound(uint32_t* round, cudaStream_t stream);

}  // namespace tools
}  // namespace nvgroup
