// The running engine: class Engine, the background thread that owns one
// set's collectives from Init to Shutdown, and the objects it drives. This
// file is where a reader finds the engine; each object lives in a file named
// for it.
//
// How it works (Horovod's pipeline):
//   1. Enqueue validates the request on this rank and puts a self-contained
//      TensorEntry into the TensorQueue, waking the background thread.
//   2. Each cycle the background loop takes the queued entries, then all ranks
//      agree on what is ready everywhere: first through the response cache
//      (one bitwise-AND allreduce, see response_cache.h), then, only when some
//      rank has something rank 0 has not seen, through rank 0 (gather the
//      request lists, Coordinator builds responses, broadcast the response list).
//   3. The cycle's responses (cache hits in slot order, then rank 0's list) are
//      planned into fusion buckets (fusion.h; whole cached groups run from
//      their plans, plan_cache.h) and run through a Communicator (execution.h).
//   4. Each request's `done` runs once, with OK or the error (completion.h).
//
// The objects (each owns its state; the Engine owns them all):
//   TensorQueue (tensor_queue.h)    the hand-off from the submitting threads,
//                                   the names in flight, admission batching.
//   Negotiation (negotiation.h)     this rank's side of agreement: the pending
//                                   entries (admission order), refusals of
//                                   duplicates, the response cache and its
//                                   bits, join and its stand-ins, the cycle's
//                                   MPI buffers, the negotiation round; on
//                                   rank 0 the Coordinator (coordinator.h,
//                                   rank 0's rules) and the StallInspector.
//   CachedGroups (cached_groups.h)  the plans (PlanCache, plan_cache.h), the
//                                   groups admitted whole and the cycle's ready
//                                   groups; demotion back into entries; runs
//                                   groups from their plans, makes new plans.
//   Execution (execution.h)         the communicators, one runner per
//                                   collective type, and Completion
//                                   (completion.h: the Finalizer, CUDA
//                                   completion events).
//   AbortSignal (abort_signal.h)    the abort flag every wait polls, the first
//                                   reason, the communicators to abort.
//   Engine (this file)              the thread, the Loop, stop and abort; the
//                                   counters (counters.h, timed by PhaseTimer)
//                                   and rank 0's timeline (timeline.h,
//                                   timeline_control.h). Its methods are in
//                                   background_loop.cc.
//
// One gradient, hop by hop (object, file):
//   EnqueueGroup -> Runtime::Submit (runtime.cc) -> Engine::Submit ->
//   TensorQueue::Push (tensor_queue.cc); then in Engine::Loop
//   (background_loop.cc), one named step each:
//   WaitForSubmissions: TensorQueue::WaitAndPop;
//   AdmitSubmissions:   CachedGroups::Admit (cached_groups.cc), whole against
//                       its plan or entry by entry into Negotiation::Admit
//                       (negotiation.cc);
//   Agree:              Negotiation::FillCacheBits, CachedGroups::SetCacheBits,
//                       one bitwise-AND allreduce;
//   TakeAgreedWork:     CachedGroups::TakeReady, Negotiation::TakeCacheHits;
//   NegotiateRound:     Negotiation::Round, when the agreement asked for one
//                       (rank 0's Coordinator, coordinator.cc);
//   Execute:            CachedGroups::RunPlans, or PlanFusion (fusion.cc),
//                       then Execution::RunMembers / RunBucket (execution.cc)
//                       -> Communicator -> Completion::CompleteAfterStream
//                       (completion.cc) -> the request's `done`.
// (BeginCycle and ReadAgreement, between them, touch no request: the cycle's
// counters, liveness progress and timeline command; what the AND says.)
//
// Design constraints of the background loop (written down as Horovod does):
//  * Only the background thread calls MPI after Init, on the engine's own
//    duplicate of the user's communicator, so negotiation never interleaves with
//    the user's MPI traffic and needs no locks around MPI.
//  * Every rank runs the same sequence of collectives: each cycle is exactly one
//    cache-bit allreduce, then the negotiation round if that allreduce says any
//    rank needs it (all ranks read the same bits), then the same buckets in the
//    same order (all ranks hold the same response list and cache).
//  * Ranks may submit in any order and at any time: names, not submission order,
//    match collectives across ranks.
//  * Mismatches are errors, not hangs: rank 0 turns disagreement into an error
//    response that every rank receives.
//  * No negotiation wait is unbounded: every MPI call is non-blocking and polled
//    with an abort flag and NVGROUP_TIMEOUT; a silent peer fails every pending
//    request with kUnavailable and stops the loop.
//  * Abort (engine_control.h, for a liveness monitor) raises a flag every wait
//    polls; the loop then fails everything with the abort's reason. Memory an
//    abandoned MPI operation may still touch is never freed (CycleBuffers,
//    negotiation.h).
//  * Shutdown is agreed: a rank that wants to stop clears a bit in the cycle's
//    allreduce, and all ranks leave the loop after that same cycle, so no rank
//    is left inside a collective.
#pragma once

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/env.h"
#include "engine/abort_signal.h"
#include "engine/cached_groups.h"
#include "engine/counters.h"
#include "engine/cycle_work.h"
#include "engine/execution.h"
#include "engine/negotiation.h"
#include "engine/tensor_queue.h"
#include "engine/timeline.h"
#include "engine/timeline_control.h"
#include "engine/wait_policy.h"
#include "nvgroup/communicator.h"
#include "nvgroup/engine.h"
#include "transport/liveness.h"

namespace nvgroup {

// One running engine (Init to Shutdown): the queue, the background thread and
// everything it owns.
class Engine {
 public:
  // Starts the background thread. `comm` (the engine's duplicate of the user's
  // communicator) and `cpu` are owned from here on.
  // `watch_liveness`: run the dead-rank monitor (set 0's engine; the engines
  // of process sets rely on it: AbortEngine aborts them all). `cuda`, when
  // given, is the CUDA communicator Init created already
  // (EngineOptions::cuda_at_init); otherwise the first CUDA response creates it.
  Engine(const Knobs& knobs, MPI_Comm comm, int rank, int size, std::unique_ptr<Communicator> cpu,
         bool watch_liveness = true, std::unique_ptr<Communicator> cuda = nullptr);
  ~Engine();

  const Topology& topology() const { return topology_; }
  int size() const { return size_; }
  Status Submit(Submission submission) { return queue_.Push(std::move(submission)); }
  // A registered group's names (Note [Registered names], tensor_queue.h).
  Status Reserve(uint64_t group, const std::vector<TensorEntry>& entries) {
    return queue_.Reserve(group, entries);
  }
  Status Unreserve(uint64_t group) { return queue_.Unreserve(group); }
  // Agrees on shutdown with the other ranks, fails what is in flight with
  // kAborted, joins the thread and frees the communicators. Idempotent.
  Status Stop();
  // Stop() leaves the liveness monitor running (heartbeats only) for
  // TakeLiveness, instead of saying BYE; set before Stop().
  void KeepLivenessAfterStop() { keep_liveness_ = true; }
  std::unique_ptr<LivenessMonitor> TakeLiveness() { return std::move(liveness_); }
  // Makes every wait in flight return and the loop stop, failing every pending
  // and later request with `reason` (see engine_control.h). Any thread; the
  // first reason wins.
  void Abort(const Status& reason) { abort_.Raise(reason); }
  // True on the engine's own threads (where done callbacks run): Stop() must
  // not be called there, it would join itself.
  bool OnEngineThread() const;
  // After Stop(): whether MPI can no longer be trusted to finish, because a
  // peer was lost (Abort, e.g. from the liveness monitor) or a negotiation
  // request never completed. MPI_Finalize would then wait for the lost rank.
  bool LostPeers() const { return abort_.raised() || mpi_broken_; }
  // start_timeline/stop_timeline (engine.h). Rank 0 hands the change to the
  // background thread, which alone touches timeline_, and waits (bounded by
  // NVGROUP_TIMEOUT) until the loop applied it; other ranks return OK.
  Status ControlTimeline(bool start, const std::string& path, bool mark_cycles);
  EngineStats Stats() const;
  // Testing (engine_control.h): makes this rank's state digest differ from
  // the other ranks' from the next cycle on.
  void PerturbStateDigest() { perturb_digest_.store(1, std::memory_order_relaxed); }

 private:
  // What one cycle of the loop carries from step to step.
  struct Cycle {
    bool shutdown_requested = false;  // this rank asked to stop (the queue)
    bool leftovers = false;           // Note [Leftovers start the next cycle]
    bool nothing_in_flight = false;   // Note [An idle rank sleeps] (wait_policy.h)
    double now = 0;                   // after the wait: the cycle's admission time
    double admitted = 0;              // when admission ended (the cache lookup starts)
    double agreed = 0;                // when the agreement completed
    bool round = false;               // the agreement asked for a negotiation round
    bool shut_down = false;           // the agreement stops every rank
    size_t cache_hits = 0;            // the first entries of the work list came from the cache
  };
  // The loop's state across cycles.
  struct LoopState {
    int quick_cycles = 0;            // Note [Leftovers start the next cycle]
    ExpectedWork expected;           // Note [Waiting for a lock-step caller] (wait_policy.h)
    std::vector<Submission> fresh;   // the cycle's submissions from the queue
    // An idle agreement's sleeps (WaitMpi's sleep_unless_woken): TensorQueue::SleepUnlessPushed.
    std::function<bool(double)> sleep_unless_pushed;
  };

  // The state digest of Note [Cached plans]: the response cache and the plans.
  uint64_t StateDigest() const { return negotiation_.cache().digest() ^ groups_.digest(); }
  void Loop();
  // ---- The loop's steps (background_loop.cc), in cycle order ----
  // Waits for the queue (the wait policy, wait_policy.h) and takes its
  // submissions into loop->fresh.
  void WaitForSubmissions(LoopState* loop, Cycle* c);
  // Counts the cycle, reports progress to the liveness monitor, applies a
  // timeline command; the cycle's clock starts.
  void BeginCycle(Cycle* c);
  // Admits the cycle's submissions and refusals; demotes cached groups that
  // can no longer run whole.
  void AdmitSubmissions(LoopState* loop, Cycle* c);
  // The cycle's agreement: this rank's cache bits, flags and state digest
  // through one bitwise-AND allreduce (and its wait).
  Status Agree(const LoopState& loop, Cycle* c);
  // What the agreement says: the digests' check (an error when the ranks'
  // states differ), shutdown, whether a negotiation round follows.
  Status ReadAgreement(Cycle* c);
  // The agreed work: the ready cached groups and the cache hits.
  std::vector<Work> TakeAgreedWork(Cycle* c);
  // The negotiation round through rank 0 (Negotiation::Round).
  Status NegotiateRound(const Cycle& c, std::vector<Work>* work);
  // Runs the cycle's work: whole cached groups from their plans, the rest in
  // fusion buckets; makes plans for groups that ran whole.
  Status Execute(std::vector<Work>* work, size_t cache_hits);
  // A failed cycle: completes what it took and had not completed with `cause`.
  void FailCycle(std::vector<Work>* work, const Status& cause);
  // After the last cycle: the exit's cause, then every request left fails.
  void ExitLoop(Status exit_status, bool shut_down);

  const Knobs knobs_;
  MPI_Comm comm_;
  const int rank_;
  const int size_;
  const Topology topology_;  // a copy: readable after Stop freed the communicators

  TensorQueue queue_;
  AbortSignal abort_;
  // Counters behind GetEngineStats (counters.h).
  EngineCounters counters_;
  Timeline timeline_;         // rank 0
  bool mark_cycles_ = false;  // background thread: CYCLE_START events (start_timeline)
  // Run-time timeline control: ControlTimeline -> TimelineControl::Apply at
  // the top of each cycle.
  TimelineControl timeline_control_;

  // Background-thread state (the objects of the comment at the top).
  Negotiation negotiation_;
  CachedGroups groups_;
  Execution execution_;
  std::atomic<uint64_t> perturb_digest_{0};  // PerturbStateDigest
  uint64_t cycle_ = 0;

  std::atomic<bool> loop_exited_{false};
  std::mutex exit_mu_;
  std::condition_variable exit_cv_;
  bool mpi_broken_ = false;  // a negotiation request never completed: leave comm_ alone
  bool stopped_ = false;

  // Dead-rank detection (transport/liveness.h): calls Abort() when a peer
  // dies. Null when its setup failed (the job runs without it).
  std::unique_ptr<LivenessMonitor> liveness_;
  bool keep_liveness_ = false;  // KeepLivenessAfterStop

  std::thread thread_;  // last: starts after everything it uses exists
};

}  // namespace nvgroup
