// The Python engine bindings' arguments and errors: the names Python passes
// (dtype, reduce op, device) as engine values, the one request built from
// allreduce's arguments, and the one conversion of a Status into Python's
// EngineError (a RuntimeError whose text is Status::ToString(), e.g.
// "FAILED_PRECONDITION: Mismatched allreduce ..."), registered on the module
// by RegisterEngineBindings (cc/python/engine_bindings.cc).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "nvgroup/engine.h"
#include "nvgroup/status.h"
#include "nvgroup/types.h"

namespace nvgroup {

class EngineError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline void ThrowIfError(const Status& status) {
  if (!status.ok()) throw EngineError(status.ToString());
}

template <typename T>
T ValueOrThrow(StatusOr<T> v) {
  ThrowIfError(v.status());
  return v.consume();
}

// Names -> engine values; an unknown name raises EngineError (kInvalidArgument).
// They run for every enqueue: no allocation unless the name is bad.
DataType ParseDataType(const std::string& name);
ReduceOp ParseReduceOp(const std::string& name);
Device ParseDevice(const std::string& name);

// An allreduce request from parsed arguments (the one place its fields are set).
CollectiveRequest AllreduceRequest(std::string name, uintptr_t in, uintptr_t out, std::vector<int64_t> shape,
                                   DataType dtype, ReduceOp op, double prescale, double postscale,
                                   Device device, uintptr_t ready_event);

// An allreduce request from allreduce_async's arguments (addresses as integers).
CollectiveRequest MakeAllreduce(const std::string& name, uintptr_t in, uintptr_t out,
                                std::vector<int64_t> shape, const std::string& dtype, const std::string& op,
                                double prescale, double postscale, const std::string& device,
                                uintptr_t ready_event);

}  // namespace nvgroup
