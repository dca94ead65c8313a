// Completion of requests (completion.h): the Finalizer's thread, and
// Completion's Complete/CompleteAfterStream, through which every request's
// `done` runs exactly once.
#include "engine/completion.h"

#include <chrono>

#include "common/checks.h"
#include "common/logging.h"
#include "common/thread_setup.h"
#include "engine/registered_launch.h"
#include "engine/wait_policy.h"

namespace nvgroup {

Finalizer::~Finalizer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

void Finalizer::Add(Job job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
    added_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_one();
}

// After a job, the finalizer polls for the next one before it sleeps (Note
// [Waiting for a lock-step caller], wait_policy.h): in lock-step the next
// bucket's job, or the next step's first, follows within kExpectWorkS, and a
// finalizer asleep on its condition variable starts it only after the
// futex wake-up (9 us from Add to the job's start on an H100 host, 1 rank, a
// 74 us step: fin.queue_latency in benchmarks/results/
// cross_step_groups_of_one_h100x1_9d5ee5a/engine_perf_1rank_probes.log).
// Each poll yields the core, and a yield
// that found the core taken ends the polling (YieldUncontended): on a busy
// host the finalizer sleeps at once.
bool Finalizer::PollForJob(size_t seen) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point until =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kExpectWorkS));
  while (Clock::now() < until) {
    if (added_.load(std::memory_order_acquire) != seen) return true;
    if (!YieldUncontended()) return false;
  }
  return false;
}

void Finalizer::Run() {
  NameThisThread("nvg-finalizer");
  WakeOnTime();  // its jobs poll completion events between short sleeps
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stop_ and drained
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    // Jobs added up to now, read under the lock (Add counts under it): one
    // added while this job runs changes it, so the poll below sees that job.
    const size_t seen = added_.load(std::memory_order_relaxed);
    const bool more = !jobs_.empty();
    lock.unlock();
    job();
    job = nullptr;  // the job's captures (callbacks, events) go before the poll
    // A job queued behind this one is taken at once; else poll for one
    // (stop_ is read under the lock, by the wait above).
    if (!more) PollForJob(seen);
    lock.lock();
  }
}

void Completion::StartCuda(int ordinal) {
#ifdef NVGROUP_WITH_CUDA
  cuda_events_ = std::make_unique<CompletionEvents>(ordinal);
#else
  (void)ordinal;
#endif
  StartFinalizer();
}

void Completion::StartHostEvents() {
  host_events_ = std::make_unique<CompletionEvents>(CompletionEvents::kHostTokens);
  StartFinalizer();
}

void Completion::StartFinalizer() {
  if (finalizer_ != nullptr) return;
  finalizer_ = std::make_unique<Finalizer>();
  finalizer_thread_ = finalizer_->thread_id();
}

void Completion::Stop() {
  finalizer_.reset();  // runs the remaining deferred completions
  cuda_events_.reset();  // after the finalizer: no event is pending any more
  host_events_.reset();
}

void Completion::CallDone(TensorEntry* e, const Status& status) {
  DoneCallback done = std::move(e->request.done);
  e->request.done = nullptr;  // a moved-from std::function is unspecified; this marks "completed"
  try {
    done(status);
  } catch (...) {  // a callback must not take the loop down
    NVG_LOG(kError) << "the done callback of '" << e->request.name << "' threw; ignored";
  }
}

void Completion::Complete(TensorEntry* e, const Status& status) {
  queue_->Finish(&e, 1);
  CallDone(e, status);
}

void Completion::CompleteAfterStream(Communicator* comm, const std::vector<TensorEntry*>& done) {
  const bool host = comm->device().kind == DeviceKind::kCpu;
  CompletionEvents* const events = host ? host_events_.get() : cuda_events_.get();
  if (host && events == nullptr) {
    PhaseTimer complete(&counters_->complete_ns);
    queue_->Finish(done.data(), done.size());  // one lock for the bucket
    for (TensorEntry* e : done) CallDone(e, Status::Ok());
    complete.Stop();
    YieldToWokenCaller();  // Note [Waiting for a lock-step caller] (wait_policy.h)
    return;
  }
  // One event per bucket, recorded after its copy out: the finalizer waits for
  // this bucket's work only, not for the buckets enqueued after it. Without an
  // event (creation failed) it falls back to draining the whole stream.
  void* event = nullptr;
  if (events != nullptr) {
    StatusOr<void*> e = events->Acquire();
    if (e.ok() && comm->RecordEvent(e.value(), nullptr).ok()) {
      event = e.value();
    } else if (e.ok()) {
      events->Release(e.value());
    }
  }
  // The Pending objects are owned by the Work list, which dies at the end of
  // the cycle: move the callbacks into the job. A request with
  // completion_event_ready hears of the event now; its name leaves the
  // in-flight set first, so the adapter may resubmit it at once (its `done`
  // below then must not Finish the name again).
  struct Callback {
    std::string name;  // empty for a registered group's member
    DoneCallback done;
    bool finished_early = false;
  };
  // Note [Registered groups] (registered_groups.h): a registered group's
  // members in a row, which the queue finishes with one count and whose
  // launch hears of the event once.
  struct RegisteredRun {
    uint64_t group;
    RegisteredLaunch* launch;
    size_t members;
    bool finished_early;
  };
  // The entries die with the cycle and nothing reads their names after this
  // (the timeline's events are written): the names move, not copy; a
  // registered group's entries keep theirs (their EntryPool reuses them).
  std::vector<Callback> callbacks;
  std::vector<RegisteredRun> runs;
  callbacks.reserve(done.size());
  bool any_early = false;
  for (TensorEntry* e : done) {
    CollectiveRequest& q = e->request;
    if (e->registered_group != 0 && e->launch != nullptr) {
      // Its `done` is RegisteredLaunch::MemberDone{e->launch}: the run
      // completes the bucket's members of the launch with one count below.
      q.done = nullptr;
      if (runs.empty() || runs.back().launch != e->launch)
        runs.push_back({e->registered_group, e->launch, 0, false});
      ++runs.back().members;
      continue;
    }
    // The queue finishes the entry by its name: before the name moves into
    // the callback (a moved-from name would finish nothing, and the name
    // would stay in flight for ever: the next submission of it is refused).
    const bool early = event != nullptr && q.completion_event_ready;
    if (early) queue_->Finish(&e, 1);
    Callback c{std::move(q.name), std::move(q.done), false};
    q.done = nullptr;
    if (early) {
      c.finished_early = any_early = true;
      try {
        q.completion_event_ready(event);
      } catch (...) {
        NVG_LOG(kError) << "the completion_event_ready callback of '" << c.name << "' threw; ignored";
      }
    }
    callbacks.push_back(std::move(c));
  }
  for (RegisteredRun& run : runs) {
    if (event == nullptr || run.launch == nullptr || !run.launch->announces_events()) continue;
    queue_->Finish(nullptr, 0, run.group, run.members);
    run.finished_early = any_early = true;
    try {
      run.launch->AnnounceEvent(event, run.members);
    } catch (...) {
      NVG_LOG(kError) << "the completion_event_ready callback of registered group " << run.group
                      << " threw; ignored";
    }
  }
  finalizer_->Add([this, comm, events, event, any_early, callbacks = std::move(callbacks),
                   runs = std::move(runs)]() mutable {
    // Orders `done` after the device finished the bucket's copy out.
    Status s = event != nullptr ? comm->WaitRecordedEvent(event) : comm->Synchronize(nullptr);
    if (event != nullptr) events->Release(event);
    // An adapter may already have let its stream run on the event: a
    // device-side failure must then stop every later collective.
    if (!s.ok() && any_early) abort_->Raise(s);
    // The names leave the in-flight set under one lock, before any `done`
    // runs (a callback may resubmit its name at once).
    std::vector<const std::string*> names;
    names.reserve(callbacks.size());
    for (const Callback& c : callbacks)
      if (!c.finished_early && !c.name.empty()) names.push_back(&c.name);
    if (!names.empty()) queue_->Finish(names.data(), names.size());
    for (const RegisteredRun& run : runs)
      if (!run.finished_early) queue_->Finish(nullptr, 0, run.group, run.members);
    for (Callback& c : callbacks) {
      try {
        c.done(s);
      } catch (...) {
        NVG_LOG(kError) << "the done callback of '" << c.name << "' threw; ignored";
      }
    }
    // Last: a launch's `done` may run here (the caller may then register,
    // launch or shut down at once).
    for (const RegisteredRun& run : runs) {
      try {
        run.launch->CompleteMembers(s, static_cast<uint32_t>(run.members));
      } catch (...) {
        NVG_LOG(kError) << "the done callback of registered group " << run.group << " threw; ignored";
      }
    }
  });
}

}  // namespace nvgroup
