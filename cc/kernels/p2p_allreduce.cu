// Launchers of the NV-group kernels: validate, pick the <T, G> instantiation,
// check that the grid can be resident, launch, check the launch. The protocol
// lives in p2p_allreduce.cuh.
#include "kernels/p2p_allreduce.cuh"

#include <algorithm>
#include <mutex>
#include <string>
#include <type_traits>

#include "common/cuda_checks.h"

namespace nvgroup {

// The 8/16-bit integer instantiations (p2p_allreduce_small_ints.cu).
void (*SmallIntP2pKernel(DataType dtype, int g, bool two_shot))(P2pLaunch);

namespace {

using P2pKernel = void (*)(P2pLaunch);

template <typename T, template <typename, int> class Select>
P2pKernel ForGroupSize(int g) {
  switch (g) {
    case 2: return Select<T, 2>::kernel;
    case 3: return Select<T, 3>::kernel;
    case 4: return Select<T, 4>::kernel;
    case 5: return Select<T, 5>::kernel;
    case 6: return Select<T, 6>::kernel;
    case 7: return Select<T, 7>::kernel;
    case 8: return Select<T, 8>::kernel;
    default: return nullptr;
  }
}

template <typename T, int G>
struct OneShotOf {
  static constexpr P2pKernel kernel = kernels::OneShotKernel<T, G>;
};
template <typename T, int G>
struct TwoShotOf {
  static constexpr P2pKernel kernel = kernels::TwoShotKernel<T, G>;
};
template <template <typename, int> class Select>
struct IsTwoShot : std::false_type {};
template <>
struct IsTwoShot<TwoShotOf> : std::true_type {};

template <template <typename, int> class Select>
P2pKernel KernelFor(DataType dtype, int g) {
  switch (dtype) {
    case DataType::kFloat16: return ForGroupSize<__half, Select>(g);
    case DataType::kBFloat16: return ForGroupSize<__nv_bfloat16, Select>(g);
    case DataType::kFloat32: return ForGroupSize<float, Select>(g);
    case DataType::kFloat64: return ForGroupSize<double, Select>(g);
    case DataType::kInt32: return ForGroupSize<int32_t, Select>(g);
    case DataType::kInt64: return ForGroupSize<int64_t, Select>(g);
    case DataType::kUint8:
    case DataType::kInt8:
    case DataType::kUint16:
    case DataType::kInt16: return SmallIntP2pKernel(dtype, g, IsTwoShot<Select>::value);
    default: return nullptr;
  }
}

constexpr DataType kReducible[] = {DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32,
                                   DataType::kFloat64, DataType::kInt32,    DataType::kInt64,
                                   DataType::kUint8,   DataType::kInt8,     DataType::kUint16,
                                   DataType::kInt16};

// Blocks of `kernel` one multiprocessor of the current device holds at once.
StatusOr<int> BlocksPerSm(P2pKernel kernel) {
  int n = 0;
  NVG_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreadsPerBlock, 0));
  return n;
}

// Resident grid of every P2P kernel for group size g on device `device`,
// cached (one process drives one device; the cache is keyed anyway).
StatusOr<int> ResidentCap(int device, int g) {
  static std::mutex mu;
  static int cached[64][kMaxGroupSize + 1] = {};
  if (device < 0 || device >= 64) return Status::InvalidArgument("device ordinal out of range");
  std::lock_guard<std::mutex> lock(mu);
  if (cached[device][g] > 0) return cached[device][g];
  int sms = 0;
  NVG_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  int per_sm = 1 << 20;
  for (DataType d : kReducible) {
    for (P2pKernel k : {KernelFor<OneShotOf>(d, g), KernelFor<TwoShotOf>(d, g)}) {
      auto n = BlocksPerSm(k);
      if (!n.ok()) return n.status();
      per_sm = std::min(per_sm, n.value());
    }
  }
  if (per_sm < 1)
    return Status::Internal("a P2P kernel for group size " + std::to_string(g) +
                            " cannot be resident on cuda:" + std::to_string(device));
  cached[device][g] = std::min(kMaxBlocks, per_sm * sms);
  return cached[device][g];
}

Status CheckLaunch(const P2pLaunch& a, const char* what) {
  if (a.group_size < 2 || a.group_size > kMaxGroupSize)
    return Status::InvalidArgument(std::string(what) + ": group size " + std::to_string(a.group_size) +
                                   " outside 2.." + std::to_string(kMaxGroupSize));
  int device = 0;
  NVG_CUDA_CHECK(cudaGetDevice(&device));
  auto cap = ResidentCap(device, a.group_size);
  if (!cap.ok()) return cap.status();
  // Every block must be resident at once: a block spinning on a barrier whose
  // partner block is not scheduled would wait forever.
  if (a.blocks < 1 || a.blocks > cap.value())
    return Status::InvalidArgument(std::string(what) + ": block count " + std::to_string(a.blocks) +
                                   " outside 1.." + std::to_string(cap.value()) +
                                   " (the blocks that can be resident on cuda:" + std::to_string(device) +
                                   ")");
  return Status::Ok();
}

Status Launch(P2pKernel kernel, const P2pLaunch& a, cudaStream_t stream, const char* what) {
  NVG_RETURN_IF_ERROR(CheckLaunch(a, what));
  if (kernel == nullptr)
    return Status::Unimplemented(std::string(what) + ": no kernel for dtype " + DataTypeName(a.dtype));
  kernel<<<a.blocks, kThreadsPerBlock, 0, stream>>>(a);
  NVG_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

template <typename T>
Status LaunchFoldTyped(const void* src, int n, void* dst, size_t count, ReduceOp op, int divisor,
                       cudaStream_t stream) {
  // Enough blocks to cover the slice, capped: a local elementwise pass.
  const size_t blocks = std::min<size_t>(1024, (count + kThreadsPerBlock - 1) / kThreadsPerBlock);
  kernels::FoldSourcesKernel<T>
      <<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(static_cast<const T*>(src), n,
                                                                       static_cast<T*>(dst), count, op,
                                                                       divisor);
  NVG_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace

StatusOr<int> ResidentP2pBlocks(int device, int group_size) {
  if (group_size < 2 || group_size > kMaxGroupSize)
    return Status::InvalidArgument("group size " + std::to_string(group_size) + " outside 2.." +
                                   std::to_string(kMaxGroupSize));
  return ResidentCap(device, group_size);
}

Status LaunchOneShotAllreduce(const P2pLaunch& a, cudaStream_t stream) {
  if (a.count == 0) return Status::Ok();
  if (a.staging_half_bytes < a.count * DataTypeSize(a.dtype))
    return Status::InvalidArgument("one-shot allreduce: " + std::to_string(a.count) +
                                   " elements exceed the staging half of " +
                                   std::to_string(a.staging_half_bytes) + " bytes");
  return Launch(KernelFor<OneShotOf>(a.dtype, a.group_size), a, stream, "one-shot allreduce");
}

Status LaunchTwoShotAllreduce(const P2pLaunch& a, cudaStream_t stream) {
  if (a.count == 0) return Status::Ok();
  const int p = a.phases;
  const bool valid = p == (kPhasePushScatter | kPhaseReduceScatter | kPhaseAllgather) ||
                     p == (kPhaseReduceScatter | kPhaseAllgather) ||
                     p == (kPhaseReduceScatter | kPhasePushResult) || p == kPhaseReduceScatter ||
                     p == kPhaseAllgather;
  if (!valid)
    return Status::InvalidArgument("two-shot allreduce: phase set " + std::to_string(p) +
                                   " is not one the kernel runs");
  return Launch(KernelFor<TwoShotOf>(a.dtype, a.group_size), a, stream, "two-shot allreduce");
}

Status LaunchFoldSources(const void* src, int n, void* dst, size_t count, DataType dtype, ReduceOp op,
                         int divisor, cudaStream_t stream) {
  if (count == 0) return Status::Ok();
  switch (dtype) {
    case DataType::kFloat16: return LaunchFoldTyped<__half>(src, n, dst, count, op, divisor, stream);
    case DataType::kBFloat16: return LaunchFoldTyped<__nv_bfloat16>(src, n, dst, count, op, divisor, stream);
    case DataType::kFloat32: return LaunchFoldTyped<float>(src, n, dst, count, op, divisor, stream);
    case DataType::kFloat64: return LaunchFoldTyped<double>(src, n, dst, count, op, divisor, stream);
    case DataType::kInt32: return LaunchFoldTyped<int32_t>(src, n, dst, count, op, divisor, stream);
    case DataType::kInt64: return LaunchFoldTyped<int64_t>(src, n, dst, count, op, divisor, stream);
    case DataType::kUint8: return LaunchFoldTyped<uint8_t>(src, n, dst, count, op, divisor, stream);
    case DataType::kInt8: return LaunchFoldTyped<int8_t>(src, n, dst, count, op, divisor, stream);
    case DataType::kUint16: return LaunchFoldTyped<uint16_t>(src, n, dst, count, op, divisor, stream);
    case DataType::kInt16: return LaunchFoldTyped<int16_t>(src, n, dst, count, op, divisor, stream);
    default:
      return Status::Unimplemented(std::string("fold over groups: dtype ") + DataTypeName(dtype) +
                                   " cannot be reduced");
  }
}

}  // namespace nvgroup
