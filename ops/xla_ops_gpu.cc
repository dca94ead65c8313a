// The XLA custom-call handler for XLA's CUDA platform (design in xla_ops.h).
// Built only with GOOGLE_CUDA (setup.py with NVGROUP_WITH_CUDA=1).
//
// How it works. XLA GPU calls the handler on its host thread while it enqueues
// the program on XLA's stream; the operands are complete only once the stream
// reaches this point. The handler records a cudaEvent on that stream (the
// engine's readiness signal: its own stream waits for it on the device, no host
// block) and enqueues the requests. When it may return is the one choice,
// NVGROUP_XLA_CUDA_WAIT (read once, at the first call):
//
//  * "stream" (default): as soon as the engine has *enqueued* the collective
//    on its stream. The engine then hands over a cudaEvent recorded after the
//    output is written (engine.h, completion_event_ready) and the handler makes
//    XLA's stream wait on it (cudaStreamWaitEvent captures the event at call
//    time), so every kernel XLA enqueues after the call runs after the result
//    is complete, on the device, and XLA's host thread goes on enqueueing the
//    rest of the step meanwhile: the GPU does not drain at each bucket. The
//    host still waits for negotiation (every rank submitted the collective),
//    which is what keeps the ranks' collectives in one order (xla_ops.h,
//    "Order").
//  * "host": until the engine's `done`, which comes only after the result is
//    complete on the device (a synchronous call; XLA's
//    host thread, and so the GPU's queue, waits for each bucket).
//
// What the early return rests on:
//  * Pointers. XLA may reuse an operand's or result's memory as soon as the
//    call returned, but only for work it enqueues on its stream afterwards,
//    which waits for the engine's event; the engine reads the input and writes
//    the output only in work enqueued before that event (on the host it touches
//    them only before completion_event_ready: the host-staged cross steps copy
//    in and out on the engine's stream), so nothing reads or writes them later.
//  * Several requests (a grouped op may span buckets): the engine runs one
//    call's requests in order on one stream, so the event of the last one to
//    arrive covers the earlier ones; the handler waits on that one only.
//  * Errors. An error known before the event (a mismatch, a dead peer during
//    negotiation, a failed enqueue) still fails this call on every rank. A
//    device-side failure the engine sees only after the event (a peer lost
//    mid-kernel) cannot fail a call that already returned: the engine then
//    aborts (engine.h), so the next collective of every rank fails naming it.
//    The bounded wait is the engine's (NVGROUP_TIMEOUT, dead-rank detection).
//  * The readiness event is destroyed when the last `done` ran: the engine's
//    wait on it is enqueued long before (cudaStreamWaitEvent captured it).
#if GOOGLE_CUDA

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/env.h"
#include "ops/xla_ops.h"

namespace nvgroup {
namespace xla_adapter {
namespace {

Status CudaStatus(const char* what, cudaError_t error) {
  return Status::Internal(std::string(what) + " failed: " + cudaGetErrorString(error));
}

// NVGROUP_XLA_CUDA_WAIT (the settings table, cc/common/env.h; parsed once per
// process): true = "stream" (the default), false = "host".
StatusOr<bool> WaitOnStream() {
  static const StatusOr<bool> parsed = []() -> StatusOr<bool> {
    Knobs knobs;
    Status status = ParseSettingFromEnvironment("NVGROUP_XLA_CUDA_WAIT", &knobs);
    if (!status.ok()) return status;
    return knobs.xla_cuda_wait_on_stream;
  }();
  return parsed;
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

// One call's requests, shared by their callbacks (engine threads) and the
// handler (XLA's thread), which may return before the last `done` runs.
struct CallState {
  CallState(cudaStream_t s, cudaEvent_t e, int n) : stream(s), ready_event(e), pending(n), device_pending(n) {}
  // Runs with the last `done` (engine thread) or the handler's return, whichever
  // is later; the call's status is given by then, so a failure can only be told.
  ~CallState() {
    const cudaError_t error = cudaEventDestroy(ready_event);
    if (error != cudaSuccess)
      std::fprintf(stderr, "nvgroup_tf: cudaEventDestroy of an XLA collective's readiness event failed: %s\n",
                   cudaGetErrorString(error));
  }

  const cudaStream_t stream;     // XLA's
  const cudaEvent_t ready_event;
  std::mutex mu;                 // guards the members below
  std::condition_variable changed;
  int pending;                   // requests whose `done` has not run
  int device_pending;            // requests whose completion event has not arrived
  bool stream_waits = false;     // XLA's stream waits on the engine's last event
  Status first_error;

  // completion_event_ready (engine thread, valid only during the call).
  void OnCompletionEvent(void* completion_event) {
    std::lock_guard<std::mutex> lock(mu);
    if (--device_pending != 0 || !first_error.ok()) return;
    const cudaError_t error = cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(completion_event), 0);
    if (error != cudaSuccess) first_error = CudaStatus("cudaStreamWaitEvent (XLA's stream on the collective)", error);
    else stream_waits = true;
    changed.notify_all();
  }

  void OnDone(const Status& status) {
    std::lock_guard<std::mutex> lock(mu);
    if (!status.ok() && first_error.ok()) first_error = status;
    --pending;
    changed.notify_all();
  }
};

ffi::Error CudaCollective(cudaStream_t stream, int32_t ordinal, ffi::RemainingArgs args,
                          ffi::RemainingRets rets, WireAttributes wire) {
  StatusOr<bool> on_stream = WaitOnStream();
  if (!on_stream.ok()) return ToFfiError(on_stream.status());
  std::vector<CollectiveRequest> requests;
  Status status = DecodeCall(wire, args, rets, &requests);
  cudaEvent_t event = nullptr;
  if (status.ok()) status = RecordReadyEvent(stream, ordinal, &event);
  if (!status.ok()) return ToFfiError(status);
  if (!on_stream.value()) {  // "host"
    for (CollectiveRequest& q : requests) {
      q.device = Device::Cuda(ordinal);
      q.ready_event = event;
    }
    status = EnqueueAndWait(std::move(requests));
    // The engine is done with the event once every request's done ran.
    const cudaError_t error = cudaEventDestroy(event);
    if (status.ok() && error != cudaSuccess) status = CudaStatus("cudaEventDestroy", error);
    return ToFfiError(status);
  }
  const int count = static_cast<int>(requests.size());
  auto state = std::make_shared<CallState>(stream, event, count);  // owns the event from here
  for (CollectiveRequest& q : requests) {
    q.device = Device::Cuda(ordinal);
    q.ready_event = event;
    q.done = [state](const Status& s) { state->OnDone(s); };
    q.completion_event_ready = [state](void* e) { state->OnCompletionEvent(e); };
  }
  status = count == 1 ? Enqueue(std::move(requests[0])) : EnqueueGroup(std::move(requests));
  if (!status.ok()) return ToFfiError(status);  // rejected: no callback runs
  // Bounded: every accepted request's `done` runs in bounded time (engine.h).
  std::unique_lock<std::mutex> lock(state->mu);
  state->changed.wait(lock, [&] { return state->stream_waits || state->pending == 0; });
  if (state->stream_waits) return ffi::Error::Success();  // the `done`s follow; a late error aborts the engine
  // Every `done` ran without the early event (an error, or the engine had no
  // event and drained its stream: then the result is complete already).
  return ToFfiError(state->first_error);
}

XLA_FFI_DEFINE_HANDLER(kCudaCollective, CudaCollective,
                       BindCall(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()));

[[maybe_unused]] const bool kCudaRegistered = RegisterHandler(kXlaTarget, "CUDA", kCudaCollective) &&
                                              RegisterHandler(kXlaAsyncTarget, "CUDA", kCudaCollective);

}  // namespace
}  // namespace xla_adapter
}  // namespace nvgroup

#endif  // GOOGLE_CUDA
