// Validation of a CollectiveRequest (request_validation.h).
#include "engine/request_validation.h"

#include <cmath>
#include <string>

#include "common/checks.h"

namespace nvgroup {
namespace {

// "collective '<name>'", built only when an error message uses it (`who +
// "..."`): validation runs for every enqueue and must not allocate when the
// request is good.
struct CollectiveWho {
  const std::string& name;
};
std::string operator+(const CollectiveWho& who, const char* text) {
  return "collective '" + who.name + "'" + text;
}

Status ValidateScales(const CollectiveRequest& q, const CollectiveWho& who) {
  if (!std::isfinite(q.prescale_factor) || !std::isfinite(q.postscale_factor))
    return Status::InvalidArgument(who + ": scale factors must be finite");
  return Status::Ok();
}

// `with_pointers`: check the pointers and `done` (false for a registered
// group's member, whose launches bring them).
Status Validate(const CollectiveRequest& q, int size, bool with_pointers) {
  const CollectiveWho who{q.name};
  if (q.name.empty()) return Status::InvalidArgument("a collective needs a non-empty name");
  if (static_cast<int>(q.dtype) >= kNumDataTypes)
    return Status::InvalidArgument(who + ": unknown dtype " + std::to_string(static_cast<int>(q.dtype)));
  if (static_cast<int>(q.type) >= kNumCollectiveTypes)
    return Status::InvalidArgument(who + ": unknown collective type " +
                                   std::to_string(static_cast<int>(q.type)));
  if (with_pointers && !q.done) return Status::InvalidArgument(who + ": no done callback");
  // Element and byte counts must fit in int64 (they travel as such and size
  // every buffer computation).
  int64_t bytes = static_cast<int64_t>(DataTypeSize(q.dtype));
  for (int64_t d : q.shape) {
    if (d < 0)
      return Status::InvalidArgument(who + ": negative dimension in shape " + ShapeToString(q.shape));
    if (__builtin_mul_overflow(bytes, d, &bytes))
      return Status::InvalidArgument(who + ": shape " + ShapeToString(q.shape) + " is too large");
  }
  if (q.device.kind == DeviceKind::kCuda) {
    if (q.device.ordinal < 0) return Status::InvalidArgument(who + ": CUDA device ordinal must be >= 0");
#ifndef NVGROUP_WITH_CUDA
    return Status::Unimplemented(who + ": device " + q.device.ToString() +
                                 " needs a CUDA build of nvgroup_tf (NVGROUP_WITH_CUDA=1)");
#endif
  } else if (q.device.kind != DeviceKind::kCpu) {
    return Status::InvalidArgument(who + ": unknown device kind");
  }
  const bool has_data = with_pointers && NumElements(q.shape) > 0;
  if (has_data && q.input == nullptr && q.type != CollectiveType::kJoin)
    return Status::InvalidArgument(who + ": input pointer is null");
  if (q.type != CollectiveType::kAlltoall && !q.splits.empty())
    return Status::InvalidArgument(who + ": splits are only meaningful for alltoall");
  switch (q.type) {
    case CollectiveType::kAllreduce:
      if (!SupportsReduction(q.dtype))
        return Status::Unimplemented(who + ": allreduce does not support dtype " + DataTypeName(q.dtype) +
                                     " (every numeric type, not bool)");
      if (static_cast<int>(q.op) > static_cast<int>(ReduceOp::kProduct))
        return Status::InvalidArgument(who + ": unknown reduce op " + std::to_string(static_cast<int>(q.op)));
      NVG_RETURN_IF_ERROR(ValidateScales(q, who));
      if (has_data && q.output == nullptr) return Status::InvalidArgument(who + ": output pointer is null");
      break;
    case CollectiveType::kReducescatter:
      if (!SupportsReduction(q.dtype))
        return Status::Unimplemented(who + ": reducescatter does not support dtype " + DataTypeName(q.dtype) +
                                     " (every numeric type, not bool)");
      if (q.op != ReduceOp::kSum && q.op != ReduceOp::kAverage)
        return Status::InvalidArgument(who + ": reducescatter supports op Sum or Average, not " +
                                       (static_cast<int>(q.op) <= static_cast<int>(ReduceOp::kProduct)
                                            ? std::string(ReduceOpName(q.op))
                                            : std::to_string(static_cast<int>(q.op))));
      NVG_RETURN_IF_ERROR(ValidateScales(q, who));
      if (q.shape.empty())
        return Status::InvalidArgument(who + ": reducescatter needs a tensor of rank >= 1 (got a scalar)");
      if (!q.allocate_output) return Status::InvalidArgument(who + ": reducescatter needs allocate_output");
      break;
    case CollectiveType::kAllgather:
      if (q.shape.empty())
        return Status::InvalidArgument(who + ": allgather needs a tensor of rank >= 1 (got a scalar)");
      if (!q.allocate_output) return Status::InvalidArgument(who + ": allgather needs allocate_output");
      break;
    case CollectiveType::kAlltoall: {
      if (q.shape.empty())
        return Status::InvalidArgument(who + ": alltoall needs a tensor of rank >= 1 (got a scalar)");
      if (!q.allocate_output) return Status::InvalidArgument(who + ": alltoall needs allocate_output");
      if (q.splits.empty()) {
        if (q.shape[0] % size != 0)
          return Status::InvalidArgument(who + ": alltoall without splits needs the first dimension (" +
                                         std::to_string(q.shape[0]) +
                                         ") to be divisible by the number of ranks (" + std::to_string(size) +
                                         ")");
        break;
      }
      if (static_cast<int>(q.splits.size()) != size)
        return Status::InvalidArgument(who + ": alltoall splits has " + std::to_string(q.splits.size()) +
                                       " entries; it needs one per rank (" + std::to_string(size) + ")");
      int64_t total = 0;
      for (int64_t v : q.splits) {
        if (v < 0)
          return Status::InvalidArgument(who + ": alltoall splits must be >= 0, got " +
                                         ShapeToString(q.splits));
        total += v;
      }
      if (total != q.shape[0])
        return Status::InvalidArgument(who + ": alltoall splits " + ShapeToString(q.splits) + " sum to " +
                                       std::to_string(total) + ", not the first dimension " +
                                       std::to_string(q.shape[0]));
      break;
    }
    case CollectiveType::kBroadcast:
      if (q.root_rank < 0 || q.root_rank >= size)
        return Status::InvalidArgument(who + ": root rank " + std::to_string(q.root_rank) +
                                       " is out of range [0, " + std::to_string(size) + ")");
      if (has_data && q.output == nullptr) return Status::InvalidArgument(who + ": output pointer is null");
      break;
    case CollectiveType::kJoin:
      if (q.output == nullptr) return Status::InvalidArgument(who + ": join needs an int32 output");
      if (q.device.kind != DeviceKind::kCpu)
        return Status::InvalidArgument(who + ": join's output lives in host memory (device CPU)");
      break;
  }
  return Status::Ok();
}

}  // namespace

Status ValidateRequest(const CollectiveRequest& q, int size) { return Validate(q, size, true); }

Status ValidateRegisteredMember(const CollectiveRequest& q, int size) { return Validate(q, size, false); }

}  // namespace nvgroup
