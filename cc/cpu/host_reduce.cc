#include "cpu/host_reduce.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "common/checks.h"
#include "cpu/half.h"

namespace nvgroup {
namespace {

// Element traits: storage type, accumulation type, widening and narrowing.
template <typename T>
struct Plain {
  using Storage = T;
  using Acc = T;
  static Acc Load(T v) { return v; }
  static T Store(Acc a) { return a; }
};

struct Half {
  using Storage = uint16_t;
  using Acc = float;
  static Acc Load(uint16_t v) { return HalfToFloat(v); }
  static uint16_t Store(Acc a) { return FloatToHalf(a); }
};

struct BFloat {
  using Storage = uint16_t;
  using Acc = float;
  static Acc Load(uint16_t v) { return BFloat16ToFloat(v); }
  static uint16_t Store(Acc a) { return FloatToBFloat16(a); }
};

// Integer + and * wrap: done in an unsigned type at least as wide as
// `unsigned` (uint8/uint16 would otherwise promote to a signed int, whose
// product can overflow), where wrapping is defined, then narrowed.
template <typename A>
using WrapType = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, std::make_unsigned_t<A>>;

template <typename A>
A Add(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = WrapType<A>;
    return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}

template <typename A>
A Mul(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = WrapType<A>;
    return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
  } else {
    return a * b;
  }
}

// Integer scaling as Horovod's ScaleBuffer: the element times the factor in
// double, truncated toward zero. Out-of-range and non-finite products would be
// undefined as a plain cast: they saturate to int64 first (NaN -> 0), then the
// value wraps to the element type (two's complement).
template <typename S>
S ScaleInteger(S v, double scale) {
  const double x = static_cast<double>(v) * scale;
  int64_t wide;
  if (!(x == x)) wide = 0;
  else if (x >= 9223372036854775807.0) wide = INT64_MAX;
  else if (x <= -9223372036854775808.0) wide = INT64_MIN;
  else wide = static_cast<int64_t>(x);
  if constexpr (std::is_unsigned_v<S> && sizeof(S) == 8) {
    // uint64 is not an engine dtype; kept exact for completeness.
    return static_cast<S>(wide);
  } else {
    return static_cast<S>(static_cast<std::make_unsigned_t<S>>(static_cast<uint64_t>(wide)));
  }
}

struct SumOp {
  template <typename A> static A Apply(A a, A b) { return Add(a, b); }
};
struct ProductOp {
  template <typename A> static A Apply(A a, A b) { return Mul(a, b); }
};
struct MinOp {
  template <typename A> static A Apply(A a, A b) { return b < a ? b : a; }
};
struct MaxOp {
  template <typename A> static A Apply(A a, A b) { return a < b ? b : a; }
};

// Elements per block: the float32 accumulator block (2 KiB) stays in L1 while
// every source streams through it once.
constexpr size_t kFoldBlock = 512;

// The element loops below may read a source at the very place they write dst
// (in place, element for element: the contract in host_reduce.h): each
// iteration reads its element of every operand before it writes that element
// of dst, and no iteration touches another's element, so the loop carries no
// dependency and may be vectorized although the pointers alias. The pragma
// tells the compiler so (without it, an aliasing dst makes it fall back to a
// scalar loop).
#if defined(__clang__)
#define NVG_NO_LOOP_CARRIED_DEPENDENCY _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define NVG_NO_LOOP_CARRIED_DEPENDENCY _Pragma("GCC ivdep")
#else
#define NVG_NO_LOOP_CARRIED_DEPENDENCY
#endif

// The value Fold stores: the Average division (integers in int64: a narrow
// type cannot hold the divisor), then the narrowing.
template <class Traits>
typename Traits::Storage Finish(typename Traits::Acc a, int divisor) {
  using A = typename Traits::Acc;
  if (divisor > 1) {
    if constexpr (std::is_integral_v<A>)
      return Traits::Store(static_cast<A>(static_cast<int64_t>(a) / divisor));
    else return Traits::Store(a / static_cast<A>(divisor));
  }
  return Traits::Store(a);
}

// dst = s_0 (op) s_1 (op) ... (op) s_{n-1}, left to right. Each source is read
// once and dst written once: the first two sources fold into the block's
// accumulator (L1), the middle ones into it, and the last one folds on the way
// to dst; two sources fold straight into dst. The operations and their order
// are the same for every n and every path, so the bits are too.
template <class Traits, class Op>
void FoldBlock(const void* const* sources, int num_sources, typename Traits::Storage* out, size_t base,
               size_t len, int divisor, typename Traits::Acc* acc) {
  using S = typename Traits::Storage;
  const S* first = static_cast<const S*>(sources[0]) + base;
  if (num_sources == 1) {
    NVG_NO_LOOP_CARRIED_DEPENDENCY
    for (size_t j = 0; j < len; ++j) out[j] = Finish<Traits>(Traits::Load(first[j]), divisor);
    return;
  }
  const S* second = static_cast<const S*>(sources[1]) + base;
  if (num_sources == 2) {
    NVG_NO_LOOP_CARRIED_DEPENDENCY
    for (size_t j = 0; j < len; ++j)
      out[j] = Finish<Traits>(Op::Apply(Traits::Load(first[j]), Traits::Load(second[j])), divisor);
    return;
  }
  for (size_t j = 0; j < len; ++j) acc[j] = Op::Apply(Traits::Load(first[j]), Traits::Load(second[j]));
  for (int k = 2; k < num_sources - 1; ++k) {
    const S* src = static_cast<const S*>(sources[k]) + base;
    for (size_t j = 0; j < len; ++j) acc[j] = Op::Apply(acc[j], Traits::Load(src[j]));
  }
  const S* last = static_cast<const S*>(sources[num_sources - 1]) + base;
  NVG_NO_LOOP_CARRIED_DEPENDENCY
  for (size_t j = 0; j < len; ++j) out[j] = Finish<Traits>(Op::Apply(acc[j], Traits::Load(last[j])), divisor);
}

template <class Traits, class Op>
void Fold(const void* const* sources, int num_sources, void* dst, size_t count, int divisor) {
  using S = typename Traits::Storage;
  using A = typename Traits::Acc;
  A acc[kFoldBlock];
  S* out = static_cast<S*>(dst);
  for (size_t base = 0; base < count; base += kFoldBlock)
    FoldBlock<Traits, Op>(sources, num_sources, out + base, base, std::min(kFoldBlock, count - base), divisor,
                          acc);
}

template <class Traits>
void FoldByOp(ReduceOp op, const void* const* sources, int n, void* dst, size_t count, int divisor) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAverage: return Fold<Traits, SumOp>(sources, n, dst, count, divisor);
    case ReduceOp::kMin: return Fold<Traits, MinOp>(sources, n, dst, count, divisor);
    case ReduceOp::kMax: return Fold<Traits, MaxOp>(sources, n, dst, count, divisor);
    case ReduceOp::kProduct: return Fold<Traits, ProductOp>(sources, n, dst, count, divisor);
  }
}

template <class Traits>
void Scale(const void* src, void* dst, size_t count, double scale) {
  using S = typename Traits::Storage;
  using A = typename Traits::Acc;
  const S* in = static_cast<const S*>(src);
  S* out = static_cast<S*>(dst);
  if constexpr (std::is_integral_v<A>) {
    for (size_t j = 0; j < count; ++j) out[j] = ScaleInteger<S>(in[j], scale);
  } else {
    const A s = static_cast<A>(scale);
    for (size_t j = 0; j < count; ++j) out[j] = Traits::Store(Traits::Load(in[j]) * s);
  }
}

}  // namespace

Status ValidateReduction(DataType dtype, ReduceOp op) {
  if (!SupportsReduction(dtype))
    return Status::InvalidArgument(std::string("allreduce does not support dtype ") + DataTypeName(dtype) +
                                   " (supported: every numeric type, not bool)");
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAverage:
    case ReduceOp::kMin:
    case ReduceOp::kMax:
    case ReduceOp::kProduct: return Status::Ok();
  }
  return Status::InvalidArgument("unknown reduce op " + std::to_string(static_cast<int>(op)));
}

Status ReduceFold(DataType dtype, ReduceOp op, const void* const* sources, int num_sources, void* dst,
                  size_t count, int average_divisor) {
  NVG_RETURN_IF_ERROR(ValidateReduction(dtype, op));
  if (num_sources < 1 || average_divisor < 1 || (average_divisor > 1 && op != ReduceOp::kAverage))
    return Status::Internal("ReduceFold: bad arguments (num_sources=" + std::to_string(num_sources) +
                            ", average_divisor=" + std::to_string(average_divisor) +
                            ", op=" + ReduceOpName(op) + ")");
  switch (dtype) {
    case DataType::kFloat16: FoldByOp<Half>(op, sources, num_sources, dst, count, average_divisor); break;
    case DataType::kBFloat16: FoldByOp<BFloat>(op, sources, num_sources, dst, count, average_divisor); break;
    case DataType::kFloat32:
      FoldByOp<Plain<float>>(op, sources, num_sources, dst, count, average_divisor);
      break;
    case DataType::kFloat64:
      FoldByOp<Plain<double>>(op, sources, num_sources, dst, count, average_divisor);
      break;
    case DataType::kInt32:
      FoldByOp<Plain<int32_t>>(op, sources, num_sources, dst, count, average_divisor);
      break;
    case DataType::kInt64:
      FoldByOp<Plain<int64_t>>(op, sources, num_sources, dst, count, average_divisor);
      break;
    case DataType::kUint8:
      FoldByOp<Plain<uint8_t>>(op, sources, num_sources, dst, count, average_divisor);
      break;
    case DataType::kInt8:
      FoldByOp<Plain<int8_t>>(op, sources, num_sources, dst, count, average_divisor);
      break;
    case DataType::kUint16:
      FoldByOp<Plain<uint16_t>>(op, sources, num_sources, dst, count, average_divisor);
      break;
    case DataType::kInt16:
      FoldByOp<Plain<int16_t>>(op, sources, num_sources, dst, count, average_divisor);
      break;
    default: break;  // rejected by ValidateReduction
  }
  return Status::Ok();
}

Status ScaledCopy(DataType dtype, const void* src, void* dst, size_t count, double scale) {
  if (scale == 1.0) {
    if (src != dst && count > 0) std::memcpy(dst, src, count * DataTypeSize(dtype));
    return Status::Ok();
  }
  switch (dtype) {
    case DataType::kFloat16: Scale<Half>(src, dst, count, scale); break;
    case DataType::kBFloat16: Scale<BFloat>(src, dst, count, scale); break;
    case DataType::kFloat32: Scale<Plain<float>>(src, dst, count, scale); break;
    case DataType::kFloat64: Scale<Plain<double>>(src, dst, count, scale); break;
    case DataType::kInt32: Scale<Plain<int32_t>>(src, dst, count, scale); break;
    case DataType::kInt64: Scale<Plain<int64_t>>(src, dst, count, scale); break;
    case DataType::kUint8: Scale<Plain<uint8_t>>(src, dst, count, scale); break;
    case DataType::kInt8: Scale<Plain<int8_t>>(src, dst, count, scale); break;
    case DataType::kUint16: Scale<Plain<uint16_t>>(src, dst, count, scale); break;
    case DataType::kInt16: Scale<Plain<int16_t>>(src, dst, count, scale); break;
    default:
      return Status::InvalidArgument(std::string("cannot scale dtype ") + DataTypeName(dtype) + " by " +
                                     std::to_string(scale) + " (only 1.0 is allowed)");
  }
  return Status::Ok();
}

std::function<Status(const void* const*, int, void*, size_t)> HostFold(DataType dtype, ReduceOp op,
                                                                       int average_divisor) {
  return [dtype, op, average_divisor](const void* const* sources, int num, void* dst, size_t count) {
    return ReduceFold(dtype, op, sources, num, dst, count, average_divisor);
  };
}

}  // namespace nvgroup
