// Completion: each request's `done` runs exactly once, with OK or the error.
// Host collectives complete at once on the background thread; CUDA
// collectives complete on the Finalizer's thread after their stream work
// (Completion::CompleteAfterStream, with one CompletionEvents event per
// bucket, completion_events.h), so the background loop keeps negotiating
// meanwhile. A name leaves the queue's in-flight set (TensorQueue::Finish)
// just before its `done` runs, so a callback may resubmit it at once.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/abort_signal.h"
#include "engine/completion_events.h"
#include "engine/counters.h"
#include "engine/tensor_queue.h"
#include "nvgroup/communicator.h"

namespace nvgroup {

// Runs `done` callbacks of CUDA requests after their stream work completes, on
// its own thread so the background loop keeps negotiating meanwhile. The
// destructor runs the jobs still queued, then joins.
class Finalizer {
 public:
  using Job = std::function<void()>;
  Finalizer() : thread_([this] { Run(); }) {}
  ~Finalizer();
  Finalizer(const Finalizer&) = delete;
  Finalizer& operator=(const Finalizer&) = delete;
  std::thread::id thread_id() const { return thread_.get_id(); }
  void Add(Job job);

 private:
  void Run();
  // Polls up to kExpectWorkS for a job beyond the `seen` ever added (Note
  // [Waiting for a lock-step caller], wait_policy.h); false: sleep.
  bool PollForJob(size_t seen);
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  std::atomic<size_t> added_{0};  // jobs ever added (Add, under mu_); read by PollForJob without it
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it uses exist
};

// The completions of one engine: at once for host collectives, through the
// Finalizer (created with the CUDA communicator, StartCuda) for CUDA ones.
class Completion {
 public:
  // `queue`: whose in-flight names completions release; `abort`: raised when
  // a CUDA bucket whose event an adapter already waits on fails.
  Completion(TensorQueue* queue, AbortSignal* abort, EngineCounters* counters)
      : queue_(queue), abort_(abort), counters_(counters) {}
  ~Completion() { Stop(); }
  Completion(const Completion&) = delete;
  Completion& operator=(const Completion&) = delete;

  // With the CUDA communicator of device `ordinal`: the Finalizer and (CUDA
  // builds) the completion events.
  void StartCuda(int ordinal);
  // Testing only (SetHostCompletionEventsForTesting, engine_control.h): host
  // collectives complete as CUDA ones do, through the Finalizer and one host
  // token per bucket (completion_events.h) announced to completion_event_ready,
  // so the CPU suite runs that path.
  void StartHostEvents();
  // Engine::Stop: runs the remaining deferred completions, then frees the
  // events (no event is pending any more). Idempotent.
  void Stop();
  // The Finalizer's thread (where CUDA `done` callbacks run), if started.
  std::thread::id finalizer_thread() const { return finalizer_thread_.load(); }

  void Complete(TensorEntry* e, const Status& status);
  // CPU: completes at once (one Finish for all, then the callbacks in one
  // loop). CUDA, and CPU after StartHostEvents: after the bucket's completion
  // event (completion_event_ready hears of it first, nvgroup/engine.h).
  void CompleteAfterStream(Communicator* comm, const std::vector<TensorEntry*>& done);

 private:
  // Runs the entry's done callback once (it must have one), catching throws.
  static void CallDone(TensorEntry* e, const Status& status);
  void StartFinalizer();  // once, by the first Start*

  TensorQueue* const queue_;
  AbortSignal* const abort_;
  EngineCounters* const counters_;
  std::unique_ptr<Finalizer> finalizer_;           // with the CUDA communicator or host events
  std::unique_ptr<CompletionEvents> cuda_events_;  // with the CUDA communicator (CUDA builds)
  std::unique_ptr<CompletionEvents> host_events_;  // StartHostEvents
  std::atomic<std::thread::id> finalizer_thread_{};
};

}  // namespace nvgroup
