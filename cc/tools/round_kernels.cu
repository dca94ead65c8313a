#include "tools/round_kernels.h"

namespace nvgroup {
namespace tools {
namespace {

__global__ void CopyWordsKernel(const uint32_t* src, size_t src_stride, uint32_t* dst, size_t dst_stride,
                                size_t words, const uint32_t* round) {
  const size_t k = *round;
  const uint32_t* s = src + k * src_stride;
  uint32_t* d = dst + k * dst_stride;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    d[i] = s[i];
}

__global__ void NextRoundKernel(uint32_t* round) { *round += 1; }

cudaError_t CopyWords(const void* src, size_t src_stride, void* dst, size_t dst_stride, size_t bytes,
                      const uint32_t* round, cudaStream_t stream) {
  if (bytes % 4 != 0) return cudaErrorInvalidValue;
  const size_t words = bytes / 4;
  const unsigned blocks = static_cast<unsigned>(words / 256 + 1 < 1024 ? words / 256 + 1 : 1024);
  CopyWordsKernel<<<blocks, 256, 0, stream>>>(static_cast<const uint32_t*>(src), src_stride / 4,
                                              static_cast<uint32_t*>(dst), dst_stride / 4, words, round);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchSelectRound(const void* bank, void* dst, size_t bytes, const uint32_t* round,
                              cudaStream_t stream) {
  return CopyWords(bank, bytes, dst, 0, bytes, round, stream);
}

cudaError_t LaunchStoreRound(const void* src, void* history, size_t bytes, const uint32_t* round,
                             cudaStream_t stream) {
  return CopyWords(src, 0, history, bytes, bytes, round, stream);
}

cudaError_t LaunchNextRound(uint32_t* round, cudaStream_t stream) {
  NextRoundKernel<<<1, 1, 0, stream>>>(round);
  return cudaGetLastError();
}

}  // namespace tools
}  // namespace nvgroup
