// The NV-group kernels of p2p_allreduce.cuh instantiated for the 8- and 16-bit
// integer dtypes, in a translation unit of their own so that nvcc builds them
// in parallel with p2p_allreduce.cu (whose launchers pick them through
// SmallIntP2pKernel). Arithmetic: wrap-around in the dtype (Apply, through an
// unsigned type at least as wide as `unsigned`), Average truncating in int64,
// as cc/cpu/host_reduce.cc.
#include "kernels/p2p_allreduce.cuh"

namespace nvgroup {
namespace {

using P2pKernel = void (*)(P2pLaunch);

template <typename T, int G>
P2pKernel Pick(bool two_shot) {
  return two_shot ? kernels::TwoShotKernel<T, G> : kernels::OneShotKernel<T, G>;
}

template <typename T>
P2pKernel ForGroupSize(int g, bool two_shot) {
  switch (g) {
    case 2: return Pick<T, 2>(two_shot);
    case 3: return Pick<T, 3>(two_shot);
    case 4: return Pick<T, 4>(two_shot);
    case 5: return Pick<T, 5>(two_shot);
    case 6: return Pick<T, 6>(two_shot);
    case 7: return Pick<T, 7>(two_shot);
    case 8: return Pick<T, 8>(two_shot);
    default: return nullptr;
  }
}

}  // namespace

// The one-shot (two_shot false) or two-shot kernel for `dtype` and group size
// `g`; nullptr for other dtypes or sizes.
P2pKernel SmallIntP2pKernel(DataType dtype, int g, bool two_shot) {
  switch (dtype) {
    case DataType::kUint8: return ForGroupSize<uint8_t>(g, two_shot);
    case DataType::kInt8: return ForGroupSize<int8_t>(g, two_shot);
    case DataType::kUint16: return ForGroupSize<uint16_t>(g, two_shot);
    case DataType::kInt16: return ForGroupSize<int16_t>(g, two_shot);
    default: return nullptr;
  }
}

}  // namespace nvgroup
