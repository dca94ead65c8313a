// The custom-call handlers for XLA's host platform (xla_ops.h): the single
// call (synchronous, and asynchronous with NVGROUP_XLA_ASYNC=1) and the pair
// (Note [Start and done]); registered under their targets at load time.
#include "ops/xla_ops.h"

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <string>
#include <utility>
#include <vector>

#include "common/checks.h"


namespace nvgroup {
namespace xla_adapter {

namespace {

// Host handler: the buffers are complete when XLA calls it; no readiness event.
ffi::Error HostCollective(ffi::RemainingArgs args, ffi::RemainingRets rets, WireAttributes wire) {
  std::vector<CollectiveRequest> requests;
  Status status = DecodeCall(wire, args, rets, &requests);
  if (status.ok()) status = EnqueueAndWait(std::move(requests));
  return ToFfiError(status);
}

// The asynchronous variant (target kXlaAsyncTarget, NVGROUP_XLA_ASYNC=1): the
// handler enqueues and returns a future that the engine's done callbacks
// complete, so XLA's CPU runtime may run independent work meanwhile. XLA resumes
// the program in the thread that completes the future, which must not be an
// engine thread (it would stall negotiation): a completion thread of ours does it.
class CompletionThread {
 public:
  static void Run(std::function<void()> task) {
    static CompletionThread* thread = new CompletionThread();  // never destroyed: runs until exit
    {
      std::lock_guard<std::mutex> lock(thread->mu_);
      thread->tasks_.push_back(std::move(task));
    }
    thread->cv_.notify_one();
  }

 private:
  CompletionThread() {
    std::thread([this] {
      for (;;) {
        std::function<void()> task;
        {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [this] { return !tasks_.empty(); });
          task = std::move(tasks_.front());
          tasks_.pop_front();
        }
        task();
      }
    }).detach();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
};

ffi::Future HostCollectiveAsync(ffi::RemainingArgs args, ffi::RemainingRets rets, WireAttributes wire) {
  ffi::Promise promise;
  ffi::Future future(promise);
  std::vector<CollectiveRequest> requests;
  Status status = DecodeCall(wire, args, rets, &requests);
  if (!status.ok()) {
    promise.SetError(ToFfiError(status));
    return future;
  }
  struct State {
    explicit State(ffi::Promise p, size_t n) : promise(std::move(p)), pending(n) {}
    ffi::Promise promise;
    std::mutex mu;
    size_t pending;
    Status first_error;
  };
  auto state = std::make_shared<State>(promise, requests.size());
  for (CollectiveRequest& q : requests) {
    q.done = [state](const Status& s) {
      {
        std::lock_guard<std::mutex> lock(state->mu);
        if (!s.ok() && state->first_error.ok()) state->first_error = s;
        if (--state->pending != 0) return;
      }
      CompletionThread::Run([state] {
        if (state->first_error.ok()) state->promise.SetAvailable();
        else state->promise.SetError(ToFfiError(state->first_error));
      });
    };
  }
  const size_t count = requests.size();
  status = count == 1 ? Enqueue(std::move(requests[0])) : EnqueueGroup(std::move(requests));
  if (!status.ok()) promise.SetError(ToFfiError(status));  // rejected: no callback runs
  return future;
}

XLA_FFI_DEFINE_HANDLER(kHostCollectiveAsync, HostCollectiveAsync, BindCall(ffi::Ffi::Bind()));

// The pair on the host (Note [Start and done], xla_ops.h): the start submits,
// the done waits on the host until every request completed.
struct HostPairCall : PairCall {
  explicit HostPairCall(int n) : pending(n) {}
  bool Finished() override {
    std::lock_guard<std::mutex> lock(mu);
    return pending == 0;
  }
  void OnDone(const Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    if (!s.ok() && first_error.ok()) first_error = s;
    --pending;
    changed.notify_all();
  }
  std::mutex mu;  // guards the members below
  std::condition_variable changed;
  int pending;    // requests whose `done` has not run
  Status first_error;
};

ffi::Error HostCollectiveStart(ffi::RemainingArgs args, ffi::RemainingRets rets, WireAttributes wire) {
  std::vector<CollectiveRequest> requests;
  Status status = DecodeCall(wire, args, rets, &requests);
  if (!status.ok()) return ToFfiError(status);
  const std::string name(wire.name);
  // Note [Calls launch registered groups] (xla_ops.h): one done for a launch.
  StatusOr<uint64_t> registration = CallRegistrations::For(name + "@host", requests);
  if (!registration.ok()) return ToFfiError(registration.status());
  const uint64_t group = registration.value();
  auto call = std::make_shared<HostPairCall>(group != 0 ? 1 : static_cast<int>(requests.size()));
  for (CollectiveRequest& q : requests) q.done = [call](const Status& s) { call->OnDone(s); };
  status = PairCalls::Put(name, call);
  if (!status.ok()) return ToFfiError(status);
  const size_t count = requests.size();
  if (group != 0)
    status = LaunchCall(group, requests, nullptr, [call](const Status& s) { call->OnDone(s); }, nullptr);
  else status = count == 1 ? Enqueue(std::move(requests[0])) : EnqueueGroup(std::move(requests));
  if (!status.ok()) PairCalls::Take(name);  // rejected: no callback runs, no done will look for it
  return ToFfiError(status);
}

ffi::Error HostCollectiveDone(ffi::RemainingArgs args, ffi::RemainingRets rets, WireAttributes wire) {
  std::string name;
  std::vector<DoneBuffer> buffers;
  Status status = DecodeDone(wire, args, rets, &name, &buffers);
  if (!status.ok()) return ToFfiError(status);
  std::shared_ptr<PairCall> taken = PairCalls::Take(name);
  auto* call = dynamic_cast<HostPairCall*>(taken.get());
  if (call == nullptr)
    return ToFfiError(Status::Internal("nvgroup XLA done call '" + name + "' found no start of that name"));
  {
    // Bounded: every accepted request's `done` runs in bounded time (engine.h).
    std::unique_lock<std::mutex> lock(call->mu);
    call->changed.wait(lock, [call] { return call->pending == 0; });
    if (!call->first_error.ok()) return ToFfiError(call->first_error);
  }
  for (const DoneBuffer& b : buffers)
    if (b.from != b.to) std::memcpy(b.to, b.from, b.bytes);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kHostCollectiveStart, HostCollectiveStart, BindCall(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kHostCollectiveDone, HostCollectiveDone, BindCall(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER(kHostCollective, HostCollective, BindCall(ffi::Ffi::Bind()));

}  // namespace

namespace {
[[maybe_unused]] const bool kHostRegistered =
    RegisterHandler(kXlaTarget, "Host", kHostCollective) &&
    RegisterHandler(kXlaAsyncTarget, "Host", kHostCollectiveAsync) &&
    RegisterHandler(kXlaStartTarget, "Host", kHostCollectiveStart) &&
    RegisterHandler(kXlaDoneTarget, "Host", kHostCollectiveDone);
}  // namespace

}  // namespace xla_adapter
}  // namespace nvgroup
