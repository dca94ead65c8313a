// The simulated link's device-side delay (Communicator::DelayStream,
// NVGROUP_TEST_BUCKET_DELAY_US; tests and benchmarks only).
//
// One thread reads the GPU's global nanosecond timer (%globaltimer, PTX ISA
// "Special Registers") until `ns` have passed, then exits: work enqueued later
// on the stream starts after it, other streams keep the rest of the GPU (a
// one-thread block holds one SM slot, no memory traffic). The timer ticks in
// steps of up to about a microsecond, so the delay is `ns` rounded up to that.
#include <cuda_runtime.h>

#include <string>

#include "kernels/kernels.h"

namespace nvgroup {
namespace {

__device__ __forceinline__ unsigned long long GlobalTimerNs() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void SpinForNanoseconds(unsigned long long ns) {
  const unsigned long long start = GlobalTimerNs();
  while (GlobalTimerNs() - start < ns) {
  }
}

}  // namespace

Status LaunchStreamDelay(double microseconds, cudaStream_t stream) {
  if (!(microseconds > 0)) return Status::Ok();
  SpinForNanoseconds<<<1, 1, 0, stream>>>(static_cast<unsigned long long>(microseconds * 1000.0));
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess)
    return Status::Internal(std::string("launching the stream delay kernel failed: ") +
                            cudaGetErrorString(error));
  return Status::Ok();
}

}  // namespace nvgroup
