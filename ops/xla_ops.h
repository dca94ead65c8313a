// XLA lowerings of the collectives: the part shared by the host (xla_ops.cc)
// and CUDA (xla_ops_gpu.cc) custom-call handlers.
//
// How it works. When TensorFlow compiles a function with XLA (jit_compile=True,
// Keras' jit_compile), each Nvgroup* op is lowered by a tf2xla kernel
// (xla_ops.cc) into one XLA custom call, API_VERSION_TYPED_FFI, target
// kXlaTarget, with side effects (never removed, merged or duplicated). Its
// operands are the op's inputs, its results the op's outputs (a tuple for the
// grouped allreduce); XLA chooses the buffers. The call's attributes (an MLIR
// dictionary in backend_config, built by XlaAttributes) carry everything the
// TF kernel reads from its attrs: the engine name (the same name the non-XLA
// kernel uses, so negotiation by name, the response cache and fusion work as
// without XLA), the collective kind, the reduce op, the scale factors, the
// broadcast root.
//
// At run time XLA calls the handler registered for its platform ("Host",
// "CUDA") with the buffers; the handler turns them into engine requests
// (BuildRequests) and waits for them (EnqueueAndWait, nvgroup/engine.h). The
// engine bounds that wait (NVGROUP_TIMEOUT, dead-rank detection), and every
// engine error returns from the handler as an ffi::Error with the same code, so
// XLA's program fails with TensorFlow's usual error class (UnavailableError for
// a dead peer, FailedPreconditionError for a cross-rank mismatch) on every rank.
//
// Allgather: XLA needs every shape at compile time, but the first dimension of
// the result is the sum of the ranks' first dimensions. The tf2xla kernel
// therefore allgathers the first dimensions once, when the program is compiled
// (a collective named "<name>/xla_rows"), and compiles that result shape; at run
// time the engine's negotiated shape is checked against it, so a rank whose
// input changed after the others compiled fails on every rank instead of
// writing past the buffer.
#pragma once

#include <string>
#include <vector>

#include "nvgroup/engine.h"
#include "nvgroup/status.h"
#include "nvgroup/types.h"
#include "xla/ffi/api/ffi.h"

namespace nvgroup {
namespace xla_adapter {

namespace ffi = ::xla::ffi;

// The one custom-call target; the handler for each platform is registered
// under this name.
constexpr const char* kXlaTarget = "nvgroup_collective";
// Host only: the asynchronous handler (xla_ops.cc), used when NVGROUP_XLA_ASYNC=1
// at compile time. The CUDA handler is registered under both names.
constexpr const char* kXlaAsyncTarget = "nvgroup_collective_async";

// What the custom call's attributes say (XlaAttributes writes them, the
// handlers decode them into this).
struct CallAttributes {
  std::string name;                       // engine name (grouped: member i is "<name>[i]")
  CollectiveType type = CollectiveType::kAllreduce;
  bool grouped = false;                   // NvgroupGroupedAllreduce
  ReduceOp op = ReduceOp::kSum;
  double prescale_factor = 1.0;
  double postscale_factor = 1.0;
  int root_rank = 0;
};

// The MLIR dictionary text of `attributes` (backend_config of the custom call).
std::string XlaAttributes(const CallAttributes& attributes);

// Builds one engine request per (argument, result) pair; device and
// ready_event are left to the caller. Fails on a buffer the engine cannot take.
Status BuildRequests(const CallAttributes& attributes, ffi::RemainingArgs args,
                     ffi::RemainingRets rets, std::vector<CollectiveRequest>* requests);

// Engine status -> the XLA FFI error with the same code (the handlers' one
// conversion point).
ffi::Error ToFfiError(const Status& status);

// Registers `handler` for `target` on XLA platform `platform` ("Host",
// "CUDA") in the FFI registry inside TensorFlow's library; prints a failure.
bool RegisterHandler(const char* target, const char* platform, XLA_FFI_Handler* handler);

// Decodes the handler attributes (ints as i64, scale factors as f64).
Status DecodeAttributes(std::string_view name, int64_t type, int64_t grouped, int64_t op,
                        double prescale, double postscale, int64_t root, CallAttributes* out);

}  // namespace xla_adapter
}  // namespace nvgroup
