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

#include "common/checks.h"
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

// A CUDA event of device `ordinal` (timing off); XLA's thread gets its
// current device back afterwards.
Status CreatePlainEvent(int ordinal, cudaEvent_t* event) {
  int previous = 0;
  cudaError_t error = cudaGetDevice(&previous);
  if (error != cudaSuccess) return CudaStatus("cudaGetDevice", error);
  if ((error = cudaSetDevice(ordinal)) != cudaSuccess) return CudaStatus("cudaSetDevice", error);
  error = cudaEventCreateWithFlags(event, cudaEventDisableTiming);
  const cudaError_t restored = cudaSetDevice(previous);
  if (error != cudaSuccess) {
    *event = nullptr;
    return CudaStatus("cudaEventCreateWithFlags", error);
  }
  if (restored != cudaSuccess) {
    cudaEventDestroy(*event);
    *event = nullptr;
    return CudaStatus("cudaSetDevice (restoring XLA's device)", restored);
  }
  return Status::Ok();
}

// The readiness event: a new event recorded on XLA's `stream` (of device
// `ordinal`).
Status RecordReadyEvent(cudaStream_t stream, int ordinal, cudaEvent_t* event) {
  NVG_RETURN_IF_ERROR(CreatePlainEvent(ordinal, event));
  const cudaError_t error = cudaEventRecord(*event, stream);
  if (error != cudaSuccess) {
    cudaEventDestroy(*event);
    *event = nullptr;
    return CudaStatus("cudaEventRecord", error);
  }
  return Status::Ok();
}

// One call's requests, shared by their callbacks (engine threads) and the
// handler (XLA's thread), which may return before the last `done` runs.
struct CallState {
  CallState(cudaStream_t s, cudaEvent_t e, int n)
      : stream(s), ready_event(e), pending(n), device_pending(n) {}
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
    if (error != cudaSuccess)
      first_error = CudaStatus("cudaStreamWaitEvent (XLA's stream on the collective)", error);
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
  for (CollectiveRequest& q : requests) q.device = Device::Cuda(ordinal);
  // Note [Calls launch registered groups] (xla_ops.h): one done and one event for a launch.
  StatusOr<uint64_t> registration =
      CallRegistrations::For(std::string(wire.name) + "@cuda" + std::to_string(ordinal), requests);
  if (!registration.ok()) {
    cudaEventDestroy(event);  // no request took it
    return ToFfiError(registration.status());
  }
  const uint64_t group = registration.value();
  const int count = static_cast<int>(requests.size());
  auto state = std::make_shared<CallState>(stream, event,
                                           group != 0 ? 1 : count);  // owns the event from here
  for (CollectiveRequest& q : requests) {
    q.ready_event = event;
    q.done = [state](const Status& s) { state->OnDone(s); };
    q.completion_event_ready = [state](void* e) { state->OnCompletionEvent(e); };
  }
  if (group != 0)
    status = LaunchCall(group, requests, event, [state](const Status& s) { state->OnDone(s); },
                        [state](void* e) { state->OnCompletionEvent(e); });
  else status = count == 1 ? Enqueue(std::move(requests[0])) : EnqueueGroup(std::move(requests));
  if (!status.ok()) return ToFfiError(status);  // rejected: no callback runs
  // Bounded: every accepted request's `done` runs in bounded time (engine.h).
  std::unique_lock<std::mutex> lock(state->mu);
  state->changed.wait(lock, [&] { return state->stream_waits || state->pending == 0; });
  if (state->stream_waits)
    return ffi::Error::Success();  // the `done`s follow; a late error aborts the engine
  // Every `done` ran without the early event (an error, or the engine had no
  // event and drained its stream: then the result is complete already).
  return ToFfiError(state->first_error);
}

// ---------------------------------------------------------------------------
// The pair (Note [Start and done], xla_ops.h) on the GPU.
//
// Stream order. The start records the readiness event on XLA's stream (the
// engine's stream waits for it on the device) and submits; it returns at
// once, so XLA's host thread goes on enqueueing backprop. When the engine
// hands over the bucket's completion event (engine thread,
// completion_event_ready), the relay stream waits for it and records the
// call's own `finished` event: the engine's event is valid only during that
// callback, and XLA's stream must not wait there (that would put all of
// XLA's later work, wherever its host thread is, behind the collective).
// The done makes XLA's stream wait for `finished`, so only the work XLA
// enqueues after the done -- the results' users -- waits for the collective.
// Until the engine has handed the event over (negotiation: every rank started
// the collective) the done waits on the host; XLA's host thread usually runs
// far ahead of the GPU, so the GPU keeps its queue meanwhile.
// Buffers: the engine reads the inputs and writes the results only in work
// ordered before its completion event, hence before `finished`, hence before
// anything XLA enqueues after the done; XLA keeps both allocated until the
// done (xla_ops.h). A device-side failure after the event is the same as for
// the single call (the engine aborts; the next collective fails).

// The stream that relays the engine's completion events to the calls' own
// events: one per device, created at the first use, never destroyed (calls
// may run until exit).
StatusOr<cudaStream_t> RelayStream(int ordinal) {
  static std::mutex mu;
  static std::vector<cudaStream_t> streams;
  std::lock_guard<std::mutex> lock(mu);
  if (ordinal < 0) return Status::Internal("relay stream for device " + std::to_string(ordinal));
  if (streams.size() <= static_cast<size_t>(ordinal)) streams.resize(ordinal + 1, nullptr);
  if (streams[ordinal] == nullptr) {
    int previous = 0;
    cudaError_t error = cudaGetDevice(&previous);
    if (error != cudaSuccess) return CudaStatus("cudaGetDevice", error);
    if ((error = cudaSetDevice(ordinal)) != cudaSuccess) return CudaStatus("cudaSetDevice", error);
    cudaStream_t stream = nullptr;
    error = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    const cudaError_t restored = cudaSetDevice(previous);
    if (error != cudaSuccess) return CudaStatus("cudaStreamCreateWithFlags (relay stream)", error);
    if (restored != cudaSuccess) return CudaStatus("cudaSetDevice (restoring the device)", restored);
    streams[ordinal] = stream;
  }
  return streams[ordinal];
}

struct CudaPairCall : PairCall {
  CudaPairCall(int ordinal_, cudaEvent_t ready, cudaEvent_t finished_, cudaStream_t relay_, int n)
      : ordinal(ordinal_),
        ready_event(ready),
        finished(finished_),
        relay(relay_),
        pending(n),
        device_pending(n) {}
  // Runs after the last `done` and the done handler, whichever is later
  // (cudaEventDestroy of an event still waited on is deferred by CUDA).
  ~CudaPairCall() override {
    for (cudaEvent_t e : {ready_event, finished}) {
      const cudaError_t error = cudaEventDestroy(e);
      if (error != cudaSuccess)
        std::fprintf(stderr, "nvgroup_tf: cudaEventDestroy of an XLA collective's event failed: %s\n",
                     cudaGetErrorString(error));
    }
  }
  bool Finished() override {
    std::lock_guard<std::mutex> lock(mu);
    return pending == 0;
  }

  // completion_event_ready (engine thread; the event is valid during the call).
  void OnCompletionEvent(void* completion_event) {
    std::lock_guard<std::mutex> lock(mu);
    if (--device_pending != 0 || !first_error.ok()) return;
    int previous = 0;
    cudaError_t error = cudaGetDevice(&previous);
    if (error == cudaSuccess && previous != ordinal) error = cudaSetDevice(ordinal);
    if (error == cudaSuccess)
      error = cudaStreamWaitEvent(relay, static_cast<cudaEvent_t>(completion_event), 0);
    if (error == cudaSuccess) error = cudaEventRecord(finished, relay);
    if (previous != ordinal) {
      const cudaError_t restored = cudaSetDevice(previous);
      if (error == cudaSuccess) error = restored;
    }
    if (error != cudaSuccess)
      first_error = CudaStatus("relaying an XLA collective's completion event", error);
    else relayed = true;
    changed.notify_all();
  }

  void OnDone(const Status& status) {
    std::lock_guard<std::mutex> lock(mu);
    if (!status.ok() && first_error.ok()) first_error = status;
    --pending;
    changed.notify_all();
  }

  const int ordinal;
  const cudaEvent_t ready_event;  // recorded on XLA's stream by the start
  const cudaEvent_t finished;     // recorded on the relay stream after the engine's event
  const cudaStream_t relay;
  std::mutex mu;                  // guards the members below
  std::condition_variable changed;
  int pending;                    // requests whose `done` has not run
  int device_pending;             // requests whose completion event has not arrived
  bool relayed = false;           // `finished` is recorded
  Status first_error;
};

ffi::Error CudaCollectiveStart(cudaStream_t stream, int32_t ordinal, ffi::RemainingArgs args,
                               ffi::RemainingRets rets, WireAttributes wire) {
  std::vector<CollectiveRequest> requests;
  Status status = DecodeCall(wire, args, rets, &requests);
  if (!status.ok()) return ToFfiError(status);
  StatusOr<cudaStream_t> relay = RelayStream(ordinal);
  if (!relay.ok()) return ToFfiError(relay.status());
  cudaEvent_t ready = nullptr, finished = nullptr;
  status = CreatePlainEvent(ordinal, &finished);
  if (status.ok()) status = RecordReadyEvent(stream, ordinal, &ready);
  if (!status.ok()) {
    if (finished != nullptr) cudaEventDestroy(finished);
    return ToFfiError(status);
  }
  const std::string name(wire.name);
  for (CollectiveRequest& q : requests) q.device = Device::Cuda(ordinal);
  // Note [Calls launch registered groups] (xla_ops.h): one done and one event for a launch.
  StatusOr<uint64_t> registration = CallRegistrations::For(name + "@cuda" + std::to_string(ordinal),
                                                           requests);
  if (!registration.ok()) {
    cudaEventDestroy(ready);  // no request took them
    cudaEventDestroy(finished);
    return ToFfiError(registration.status());
  }
  const uint64_t group = registration.value();
  const int count = static_cast<int>(requests.size());
  auto call = std::make_shared<CudaPairCall>(ordinal, ready, finished, relay.value(),
                                             group != 0 ? 1 : count);  // owns the events
  for (CollectiveRequest& q : requests) {
    q.ready_event = ready;
    q.done = [call](const Status& s) { call->OnDone(s); };
    q.completion_event_ready = [call](void* e) { call->OnCompletionEvent(e); };
  }
  status = PairCalls::Put(name, call);
  if (!status.ok()) return ToFfiError(status);
  if (group != 0)
    status = LaunchCall(group, requests, ready, [call](const Status& s) { call->OnDone(s); },
                        [call](void* e) { call->OnCompletionEvent(e); });
  else status = count == 1 ? Enqueue(std::move(requests[0])) : EnqueueGroup(std::move(requests));
  if (!status.ok()) PairCalls::Take(name);  // rejected: no callback runs, no done will look for it
  return ToFfiError(status);
}

ffi::Error CudaCollectiveDone(cudaStream_t stream, int32_t /*ordinal*/, ffi::RemainingArgs args,
                              ffi::RemainingRets rets, WireAttributes wire) {
  std::string name;
  std::vector<DoneBuffer> buffers;
  Status status = DecodeDone(wire, args, rets, &name, &buffers);
  if (!status.ok()) return ToFfiError(status);
  std::shared_ptr<PairCall> taken = PairCalls::Take(name);
  auto* call = dynamic_cast<CudaPairCall*>(taken.get());
  if (call == nullptr)
    return ToFfiError(Status::Internal("nvgroup XLA done call '" + name + "' found no start of that name"));
  {
    // Bounded: every accepted request's `done` runs in bounded time (engine.h).
    std::unique_lock<std::mutex> lock(call->mu);
    call->changed.wait(lock, [call] { return call->relayed || call->pending == 0; });
    if (!call->first_error.ok()) return ToFfiError(call->first_error);
    if (call->relayed) {
      const cudaError_t error = cudaStreamWaitEvent(stream, call->finished, 0);
      if (error != cudaSuccess)
        return ToFfiError(CudaStatus("cudaStreamWaitEvent (XLA's stream on the collective)", error));
    }
    // Else every `done` ran without an event: the result is complete already.
  }
  for (const DoneBuffer& b : buffers) {
    if (b.from == b.to) continue;
    const cudaError_t error = cudaMemcpyAsync(b.to, b.from, b.bytes, cudaMemcpyDeviceToDevice, stream);
    if (error != cudaSuccess) return ToFfiError(CudaStatus("cudaMemcpyAsync (the done's result)", error));
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(
    kCudaCollectiveStart, CudaCollectiveStart,
    BindCall(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()));
XLA_FFI_DEFINE_HANDLER(
    kCudaCollectiveDone, CudaCollectiveDone,
    BindCall(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()));

XLA_FFI_DEFINE_HANDLER(
    kCudaCollective, CudaCollective,
    BindCall(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()));

[[maybe_unused]] const bool kCudaRegistered = RegisterHandler(kXlaTarget, "CUDA", kCudaCollective) &&
                                              RegisterHandler(kXlaAsyncTarget, "CUDA", kCudaCollective) &&
                                              RegisterHandler(kXlaStartTarget, "CUDA",
                                                              kCudaCollectiveStart) &&
                                              RegisterHandler(kXlaDoneTarget, "CUDA", kCudaCollectiveDone);

}  // namespace
}  // namespace xla_adapter
}  // namespace nvgroup

#endif  // GOOGLE_CUDA
