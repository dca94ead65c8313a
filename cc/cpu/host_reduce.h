// Host reductions and scaled copies: the CPU loops behind every CPU collective.
//
// How it works. A reduction is a *fold*: dst[i] = s_0[i] (op) s_1[i] (op) ...
// (op) s_{n-1}[i], left to right in source order, so the caller fixes the order
// (group members by group_rank, groups by group_index, flat ranks by rank) and
// every rank computing element i gets the same bits.
//
// Accumulation and rounding (the exact contract):
//  * float32, float64: accumulate in the element type; each (op) rounds as IEEE.
//  * float16, bfloat16: each source is widened to float32 (exact), the whole fold
//    runs in float32, and the result is rounded to the element type ONCE, when
//    the fold writes dst (round to nearest even, cc/cpu/half.h). A hierarchical
//    allreduce therefore rounds once per level: after the group fold and after
//    the fold over groups.
//  * uint8, int8, uint16, int16, int32, int64: two's-complement arithmetic that
//    wraps on overflow in the element type (like TF/numpy/MPI), never undefined
//    behaviour.
//  * Average folds as Sum. The fold that produces the final value (the last
//    level of the algorithm) passes `average_divisor` = number of ranks and
//    divides the accumulator before the rounding/store: floats divide in the
//    accumulation type, integers truncate toward zero. Other folds pass 1.
//  * Min/Max are `b < a ? b : a` / `a < b ? b : a` in the accumulation type
//    (a NaN in a later source is dropped, in the first source it is kept: the
//    order is fixed, so the result is still identical on all ranks).
//
// Sources may alias dst element for element (in-place): a block of every source
// is read before the block of dst is written.
#pragma once

#include <cstddef>
#include <functional>

#include "nvgroup/status.h"
#include "nvgroup/types.h"

namespace nvgroup {

// kInvalidArgument naming the dtype/op unless allreduce supports the pair.
Status ValidateReduction(DataType dtype, ReduceOp op);

// Folds `num_sources` (>= 1) arrays of `count` elements into dst (see above).
// `average_divisor` >= 1; values other than 1 are only allowed with kAverage.
Status ReduceFold(DataType dtype, ReduceOp op, const void* const* sources, int num_sources, void* dst,
                  size_t count, int average_divisor);

// The cross step's fold on the host (CrossExchange::Fold): `num_sources`
// copies of `count` elements (sources[k]: peer k's) folded into `dst` in peer
// order by ReduceFold.
std::function<Status(const void* const* sources, int num_sources, void* dst, size_t count)> HostFold(
    DataType dtype, ReduceOp op, int average_divisor);

// dst[j] = src[j] * scale for `count` elements. scale == 1.0 copies bit for bit
// (any dtype). Otherwise the dtype must support reduction: float16/bfloat16 are
// scaled in float32 and rounded once, float32 in float32 (scale rounded to
// float), float64 in float64, integers in float64 then truncated toward zero
// (Horovod's ScaleBuffer; a product outside the type's range saturates to
// int64 and then wraps to the element type, NaN becomes 0).
// src == dst is allowed; partial overlap is not.
Status ScaledCopy(DataType dtype, const void* src, void* dst, size_t count, double scale);

}  // namespace nvgroup
