// Batched (scaled) copy: many tensors into or out of the registered buffer in
// one launch (the engine's fusion copies, with the pre- or postscale folded in).
//
// How it works. The host gives every copy descriptor ceil(count /
// kCopyElemsPerBlock) blocks and writes the prefix sum into first_block. Block
// b finds its descriptor by binary search over first_block (thread 0, shared
// with the block), then copies its range of kCopyElemsPerBlock elements: whole
// 16-byte units with vector loads when source and destination are aligned
// (each block's range starts on a multiple of kCopyElemsPerBlock elements,
// a multiple of 16 bytes), element by element otherwise. scale == 1 moves bits
// (any dtype, NaN payloads and -0 kept); otherwise fp16/bf16 scale in fp32 and
// round once, fp32 in fp32, fp64 in fp64, integers in fp64 truncated toward
// zero, saturated to int64 and wrapped (ScaleInteger) -- the contract of cc/cpu/host_reduce.h ScaledCopy.
//
// Fused buckets (Communicator::FusedAllreduce, CudaCommunicator's override).
//  * One rank (topology size 1): the descriptors go straight from each
//    member's input to its output (src = input, dst = output), one launch on
//    the communicator's stream after the bucket's ready-event waits; no
//    registered buffer, no barrier, nothing any other process reads. An
//    in-place member with unit scales gets no descriptor (no launch at all when
//    every member is one); when both prescale and postscale differ from 1 a
//    second launch scales the outputs in place (src == dst, each element read
//    and written by the same thread), so the bits are the reference's two
//    roundings. The bucket's completion event is recorded after the last launch.
//  * Several ranks: unchanged. The copy in (inputs -> own registered buffer)
//    stays, because the group's P2P kernels read that buffer over CUDA IPC
//    after their entry barrier (p2p_allreduce.cuh); the copy out (own buffer ->
//    outputs) is one launch for the whole bucket, ordered after the allreduce
//    kernels by the stream, and reads only our own buffer, which no peer
//    writes after the kernels' exit barrier. Writing the allgather phase
//    straight into the members' outputs (no copy out) would need the two-shot
//    kernel to take this descriptor list as its destination; not built.
// Speed (tools/copy_bench, ResNet-50's 214 fp32 gradients, 102 MB, one H100,
// 2026-12-07, 3 alternated runs): 80-81 us against 73-76 us for one
// cudaMemcpyAsync of the same arena (93% of the copy engine's rate). A grid
// capped at the resident blocks looping over the ranges, with four 16-byte
// units in flight per thread, took 86-89 us: one block per range stays
// (benchmarks/results/copy_kernel_h100x1_d715aab/, device_checks_h100x1_5875006/).
// Descriptor slots: a ring of kCopySlots pinned + device descriptor arrays;
// the host reuses a slot only after the event recorded behind the launch that
// read it (cudaEventSynchronize), so a slot is never rewritten under a kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "common/cuda_checks.h"
#include "kernels/kernels.h"

namespace nvgroup {
namespace {

constexpr int kCopyThreads = 256;

__device__ size_t FindCopy(const DeviceCopySpec* copies, size_t num_copies, size_t block) {
  size_t lo = 0, hi = num_copies;  // invariant: copies[lo].first_block <= block
  while (hi - lo > 1) {
    const size_t mid = (lo + hi) / 2;
    if (copies[mid].first_block <= block) lo = mid;
    else hi = mid;
  }
  return lo;
}

// Integers as cc/cpu/host_reduce.cc ScaleInteger (Horovod's ScaleBuffer): the
// product in double truncated toward zero, saturated to int64 (NaN -> 0) so the
// conversion is defined, then wrapped to the element type (two's complement).
template <typename T>
__device__ __forceinline__ T ScaleInteger(T v, double scale) {
  const double x = static_cast<double>(v) * scale;
  long long wide;
  if (!(x == x)) wide = 0;
  else if (x >= 9223372036854775807.0) wide = INT64_MAX;
  else if (x <= -9223372036854775808.0) wide = INT64_MIN;
  else wide = static_cast<long long>(x);
  return static_cast<T>(static_cast<std::make_unsigned_t<T>>(static_cast<unsigned long long>(wide)));
}

template <typename T>
__device__ __forceinline__ T Scale(T x, double s) {
  if constexpr (std::is_same_v<T, __half>) return __float2half_rn(__half2float(x) * static_cast<float>(s));
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(__bfloat162float(x) * static_cast<float>(s));
  else if constexpr (std::is_same_v<T, float>) return x * static_cast<float>(s);
  else if constexpr (std::is_integral_v<T>) return ScaleInteger<T>(x, s);
  else return static_cast<T>(static_cast<double>(x) * s);  // double
}

// kScale false: T is an unsigned word of the element size and bits are moved.
template <typename T, bool kScale>
__global__ void __launch_bounds__(kCopyThreads)
    BatchedScaledCopyKernel(const DeviceCopySpec* copies, size_t num_copies, double scale) {
  __shared__ size_t index;
  if (threadIdx.x == 0) index = FindCopy(copies, num_copies, blockIdx.x);
  __syncthreads();
  const DeviceCopySpec c = copies[index];
  const size_t begin = (blockIdx.x - c.first_block) * kCopyElemsPerBlock;
  const size_t end = min(c.count, begin + kCopyElemsPerBlock);
  const T* src = static_cast<const T*>(c.src);
  T* dst = static_cast<T*>(c.dst);
  constexpr int kE = 16 / sizeof(T);
  const bool vec = ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0;
  size_t i = begin + threadIdx.x * static_cast<size_t>(kE);
  if (vec) {
    for (; i + kE <= end; i += kCopyThreads * static_cast<size_t>(kE)) {
      uint4 raw = *reinterpret_cast<const uint4*>(src + i);
      if constexpr (kScale) {
        T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
        for (int k = 0; k < kE; ++k) e[k] = Scale<T>(e[k], scale);
      }
      *reinterpret_cast<uint4*>(dst + i) = raw;
    }
    // tail: fewer than kE elements remain for exactly one thread
    for (; i < end; ++i) dst[i] = kScale ? Scale<T>(src[i], scale) : src[i];
  } else {
    for (size_t j = begin + threadIdx.x; j < end; j += kCopyThreads)
      dst[j] = kScale ? Scale<T>(src[j], scale) : src[j];
  }
}

template <typename T, bool kScale>
Status LaunchTyped(const DeviceCopySpec* copies, size_t num_copies, size_t total_blocks, double scale,
                   cudaStream_t stream) {
  BatchedScaledCopyKernel<T, kScale>
      <<<static_cast<unsigned>(total_blocks), kCopyThreads, 0, stream>>>(copies, num_copies, scale);
  NVG_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace

size_t CopyBlocksFor(size_t count) { return (count + kCopyElemsPerBlock - 1) / kCopyElemsPerBlock; }

Status LaunchBatchedScaledCopy(const DeviceCopySpec* copies, size_t num_copies, size_t total_blocks,
                               DataType dtype, double scale, cudaStream_t stream) {
  if (total_blocks == 0) return Status::Ok();
  if (total_blocks > 0x7fffffffu)
    return Status::InvalidArgument("batched copy: " + std::to_string(total_blocks) +
                                   " blocks exceed the grid limit");
  if (scale == 1.0) {
    switch (DataTypeSize(dtype)) {
      case 1: return LaunchTyped<uint8_t, false>(copies, num_copies, total_blocks, 1.0, stream);
      case 2: return LaunchTyped<uint16_t, false>(copies, num_copies, total_blocks, 1.0, stream);
      case 4: return LaunchTyped<uint32_t, false>(copies, num_copies, total_blocks, 1.0, stream);
      case 8: return LaunchTyped<uint64_t, false>(copies, num_copies, total_blocks, 1.0, stream);
    }
  }
  switch (dtype) {
    case DataType::kFloat16:
      return LaunchTyped<__half, true>(copies, num_copies, total_blocks, scale, stream);
    case DataType::kBFloat16:
      return LaunchTyped<__nv_bfloat16, true>(copies, num_copies, total_blocks, scale, stream);
    case DataType::kFloat32: return LaunchTyped<float, true>(copies, num_copies, total_blocks, scale, stream);
    case DataType::kFloat64:
      return LaunchTyped<double, true>(copies, num_copies, total_blocks, scale, stream);
    case DataType::kInt32: return LaunchTyped<int32_t, true>(copies, num_copies, total_blocks, scale, stream);
    case DataType::kInt64: return LaunchTyped<int64_t, true>(copies, num_copies, total_blocks, scale, stream);
    case DataType::kUint8: return LaunchTyped<uint8_t, true>(copies, num_copies, total_blocks, scale, stream);
    case DataType::kInt8: return LaunchTyped<int8_t, true>(copies, num_copies, total_blocks, scale, stream);
    case DataType::kUint16:
      return LaunchTyped<uint16_t, true>(copies, num_copies, total_blocks, scale, stream);
    case DataType::kInt16: return LaunchTyped<int16_t, true>(copies, num_copies, total_blocks, scale, stream);
    default:
      return Status::InvalidArgument(std::string("batched copy: scale ") + std::to_string(scale) +
                                     " given for dtype " + DataTypeName(dtype) +
                                     ", which only copies unscaled");
  }
}

}  // namespace nvgroup
