// The XLA custom-call handler for XLA's CUDA platform (design in xla_ops.h).
// Built only with GOOGLE_CUDA (setup.py with NVGROUP_WITH_CUDA=1).
//
// How it works. XLA GPU calls the handler on its host thread while it enqueues
// the program on XLA's stream; the operands are complete only once the stream
// reaches this point. The handler records a cudaEvent on that stream (the
// engine's readiness signal: its own stream waits for it on the device, no host
// block) and waits on the host until the engine has called done -- which it
// does only after the results are complete on the device (engine.h) -- so the
// work XLA enqueues after the call reads finished results. One synchronous call
// per collective (per bucket for the grouped ops); see xla_ops.h.
#if GOOGLE_CUDA

#include <cuda_runtime_api.h>

#include <string>
#include <utility>
#include <vector>

#include "ops/xla_ops.h"

namespace nvgroup {
namespace xla_adapter {
namespace {

Status CudaStatus(const char* what, cudaError_t error) {
  return Status::Internal(std::string(what) + " failed: " + cudaGetErrorString(error));
}

// The event must belong to the stream's device; XLA's thread gets its current
// device back afterwards.
Status RecordReadyEvent(cudaStream_t stream, int ordinal, cudaEvent_t* event) {
  int previous = 0;
  cudaError_t error = cudaGetDevice(&previous);
  if (error != cudaSuccess) return CudaStatus("cudaGetDevice", error);
  error = cudaSetDevice(ordinal);
  if (error != cudaSuccess) return CudaStatus("cudaSetDevice", error);
  Status status;
  error = cudaEventCreateWithFlags(event, cudaEventDisableTiming);
  if (error != cudaSuccess) {
    *event = nullptr;
    status = CudaStatus("cudaEventCreateWithFlags", error);
  } else if ((error = cudaEventRecord(*event, stream)) != cudaSuccess) {
    cudaEventDestroy(*event);
    *event = nullptr;
    status = CudaStatus("cudaEventRecord", error);
  }
  error = cudaSetDevice(previous);
  if (status.ok() && error != cudaSuccess) {
    cudaEventDestroy(*event);
    *event = nullptr;
    status = CudaStatus("cudaSetDevice (restoring XLA's device)", error);
  }
  return status;
}

ffi::Error CudaCollective(cudaStream_t stream, int32_t ordinal, ffi::RemainingArgs args,
                          ffi::RemainingRets rets, WireAttributes wire) {
  std::vector<CollectiveRequest> requests;
  Status status = DecodeCall(wire, args, rets, &requests);
  cudaEvent_t event = nullptr;
  if (status.ok()) status = RecordReadyEvent(stream, ordinal, &event);
  if (status.ok()) {
    for (CollectiveRequest& q : requests) {
      q.device = Device::Cuda(ordinal);
      q.ready_event = event;
    }
    status = EnqueueAndWait(std::move(requests));
  }
  // The engine is done with the event once every request's done ran.
  if (event != nullptr) {
    cudaError_t error = cudaEventDestroy(event);
    if (status.ok() && error != cudaSuccess) status = CudaStatus("cudaEventDestroy", error);
  }
  return ToFfiError(status);
}

XLA_FFI_DEFINE_HANDLER(kCudaCollective, CudaCollective,
                       BindCall(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()));

[[maybe_unused]] const bool kCudaRegistered = RegisterHandler(kXlaTarget, "CUDA", kCudaCollective) &&
                                              RegisterHandler(kXlaAsyncTarget, "CUDA", kCudaCollective);

}  // namespace
}  // namespace xla_adapter
}  // namespace nvgroup

#endif  // GOOGLE_CUDA
