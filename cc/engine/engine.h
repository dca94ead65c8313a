// The running engine (class Engine) and its background loop: the cycle that
// admits requests, agrees across ranks on what is ready, negotiates through
// rank 0 and executes. The Engine's methods live by concept: the cycle, start,
// stop and abort in background_loop.cc; the plan cache in plan_cache.{h,cc};
// the collectives in executor.cc; completion in completion.{h,cc}; counters
// in counters.h and timeline control in timeline_control.h.
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
//      their plans, plan_cache.h) and run through a Communicator (executor.cc).
//   4. Each request's `done` runs once, with OK or the error (completion.h).
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
//    abandoned MPI operation may still touch is never freed (CycleBuffers).
//  * Shutdown is agreed: a rank that wants to stop clears a bit in the cycle's
//    allreduce, and all ranks leave the loop after that same cycle, so no rank
//    is left inside a collective.
#pragma once

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/env.h"
#include "engine/completion.h"
#include "engine/completion_events.h"
#include "engine/coordinator.h"
#include "engine/counters.h"
#include "engine/fusion.h"
#include "engine/mpi_wait.h"
#include "engine/plan_cache.h"
#include "engine/response_cache.h"
#include "engine/stall_inspector.h"
#include "engine/tensor_queue.h"
#include "engine/timeline.h"
#include "engine/timeline_control.h"
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
  void Abort(const Status& reason);
  // True on the engine's own threads (where done callbacks run): Stop() must
  // not be called there, it would join itself.
  bool OnEngineThread() const;
  // After Stop(): whether MPI can no longer be trusted to finish, because a
  // peer was lost (Abort, e.g. from the liveness monitor) or a negotiation
  // request never completed. MPI_Finalize would then wait for the lost rank.
  bool LostPeers() const { return abort_.load() || mpi_broken_; }
  // start_timeline/stop_timeline (engine.h). Rank 0 hands the change to the
  // background thread, which alone touches timeline_, and waits (bounded by
  // NVGROUP_TIMEOUT) until the loop applied it; other ranks return OK.
  Status ControlTimeline(bool start, const std::string& path, bool mark_cycles);
  EngineStats Stats() const;
  // Testing (engine_control.h): makes this rank's state digest differ from
  // the other ranks' from the next cycle on.
  void PerturbStateDigest() { perturb_digest_.store(1, std::memory_order_relaxed); }

 private:
  struct Pending {
    TensorEntry entry;
    bool reported = false;  // sent to rank 0 in a negotiation round
    bool taken = false;     // moved out of pending_ this cycle (order_ drops it)
    // Admitted after a refusal of its name that rank 0 has not answered yet:
    // neither reported nor in the cache bits until then (Note [Refused
    // duplicates] in controller.h).
    bool held = false;
    double since = 0;       // when the loop took it from the queue
  };
  // A response with this rank's entry (absent for error responses about names
  // this rank never submitted).
  struct Work {
    // A cache hit's slot in cache_ (not copied: the cache does not change
    // between TakeCacheHits and the end of Execute, but in a cycle with a
    // negotiation round, whose Puts may, so Loop makes the hits Own() theirs
    // before it), or `owned`.
    const ResponseMessage* response = nullptr;
    std::unique_ptr<ResponseMessage> owned;
    std::unique_ptr<Pending> pending;
    int slot = -1;  // the response cache slot it came from (cache hits only)
    void Own() {
      if (owned == nullptr) owned = std::make_unique<ResponseMessage>(*response);
      response = owned.get();
    }
  };

  // One member of an allreduce bucket: its agreed response and its entry.
  struct BucketMember {
    const ResponseMessage* response;
    TensorEntry* entry;
  };

  // ---- The plan cache (plan_cache.cc) ----
  // One submission from the queue: whole, if it fits its plan, else per entry.
  void AdmitSubmission(Submission submission, double now);
  // The plan `s` can run from unchanged, or null.
  const Plan* PlanFor(const Submission& s) const;
  // Admits the cached groups' entries one by one (Note [Cached groups]);
  // `all`: every group, else only those that can no longer run whole.
  void DemoteCachedGroups(double now, bool all);
  // Moves the cached groups whose bits survived the agreement into
  // ready_groups_ and marks their slots in claimed_slots_.
  void TakeReadyCachedGroups(const std::vector<uint64_t>& bits);
  // Runs the cycle's whole cached groups that have a valid plan (those from
  // ready_groups_ and those in the first `cache_hits` work entries); marks
  // their work entries in `done`.
  Status RunPlans(std::vector<Work>* work, size_t cache_hits, std::vector<bool>* done);
  // Records plans for groups of this cycle that ran whole without one.
  void MakePlans(const std::vector<Work>& work);

  // ---- The cycle (background_loop.cc) ----
  // The state digest of Note [Cached plans]: the response cache and the plans.
  uint64_t StateDigest() const { return cache_.digest() ^ plans_.digest(); }
  void Loop();
  // `s`, or the reason given to Abort() when there is one: after an abort
  // (e.g. a peer died) every failure is a consequence of it.
  Status Cause(const Status& s);
  void Admit(TensorEntry entry, double now);
  // Note [Refused duplicates] (controller.h): a refused push from the queue.
  void AddRefusal(const Submission& refusal);
  // Whether a refusal of `name` is due for the next negotiation round.
  bool RefusalDue(const std::string& name) const;
  bool AnyRefusalDue() const;
  // Whether `r` answers this rank's reported refusal of its name (consumed).
  bool TakeRefusalAnswer(const ResponseMessage& r);
  // Admit's bookkeeping: a Pending in pending_ and order_, waiting since `since`.
  void AddPending(TensorEntry entry, double since);
  void TimelineAdmitted(const TensorEntry& entry, double now);
  bool FillCacheBits(double now, std::vector<uint64_t>* bits);
  std::vector<Work> TakeCacheHits(const std::vector<uint64_t>& bits);
  Status Negotiate(double now, std::vector<Work>* work);
  // The first `cache_hits` entries of `work` came from the response cache.
  Status Execute(std::vector<Work>* work, size_t cache_hits);

  // ---- The executor (executor.cc) ----
  // Runs an allreduce bucket over `members` (one per bucket.offsets entry).
  Status RunAllreduceBucket(const FusionBucket& bucket, const BucketMember* members);
  // Runs `bucket` (PlanFusion's, indices into *work) and fails its requests
  // with the cause if it fails; returns the error that ends the loop, if any.
  Status RunBucket(const FusionBucket& bucket, std::vector<Work>* work);
  // RunAllreduceBucket, then on failure what RunBucket does.
  Status RunMembers(const FusionBucket& bucket, const BucketMember* members);
  // `s` OK: OK. Else fails the entries not completed yet with the cause and
  // returns it if it ends the loop (a lost or aborted peer), else OK.
  Status FailEntries(const Status& s, TensorEntry* const* entries, size_t n);
  Status RunAllreduceAlone(const BucketMember& m);
  Status RunAllgather(Work* w);
  Status RunBroadcast(Work* w);
  Status RunReducescatter(Work* w);
  Status RunAlltoall(Work* w);
  Status RunJoin(Work* w);
  // Join: on a rank that has joined, the stand-in request for a collective it
  // never submitted (zeros in, output discarded); null if `r` cannot take one.
  std::unique_ptr<Pending> MakeJoinStandIn(const ResponseMessage& r);
  // Join: cache bits a joined rank sets for every cached response it can
  // stand in for.
  void SetJoinedCacheBits(std::vector<uint64_t>* bits);
  StatusOr<Communicator*> GetCommunicator(const Device& device);

  // ---- Completion (completion.cc) ----
  void Complete(TensorEntry* e, const Status& status);
  void Complete(Pending* p, const Status& status) { Complete(&p->entry, status); }
  // Runs the entry's done callback once (it must have one), catching throws.
  static void CallDone(TensorEntry* e, const Status& status);
  // CPU: completes at once (one Finish for all, then the callbacks in one
  // loop). CUDA: after the bucket's completion event (completion_event_ready
  // hears of it first, engine.h).
  void CompleteAfterStream(Communicator* comm, const std::vector<TensorEntry*>& done);

  // `what` names the operation in a timeout or abort message (of this cycle).
  Status Wait(MPI_Request* request, const char* what) {
    return WaitMpi(request, what, knobs_.peer_timeout_s, abort_, static_cast<int64_t>(cycle_));
  }

  const Knobs knobs_;
  MPI_Comm comm_;
  const int rank_;
  const int size_;
  std::unique_ptr<Communicator> cpu_comm_;
  const Topology topology_;  // a copy: readable after Stop freed the communicators
  std::unique_ptr<Communicator> cuda_comm_;  // created by the first CUDA response
  int cuda_ordinal_ = -1;
  std::unique_ptr<Finalizer> finalizer_;  // with cuda_comm_
  std::unique_ptr<CompletionEvents> completion_events_;  // with cuda_comm_ (CUDA builds)
  std::atomic<std::thread::id> finalizer_thread_{};

  TensorQueue queue_;
  std::atomic<bool> abort_{false};  // polled by every negotiation wait
  std::mutex abort_mu_;              // guards the two below and the communicators' lifetime for Abort
  Status abort_status_;              // why Abort was called (OK if it was not)
  bool comms_freed_ = false;
  std::atomic<Communicator*> cuda_comm_for_abort_{nullptr};
  std::atomic<bool> loop_exited_{false};
  std::mutex exit_mu_;
  std::condition_variable exit_cv_;
  bool mpi_broken_ = false;  // a negotiation request never completed: leave comm_ alone
  bool stopped_ = false;

  // Memory that the cycle's non-blocking MPI operations read or write. An
  // operation abandoned after a timeout or an abort may still complete later,
  // so once that happened this memory is never freed (Stop leaks it).
  struct CycleBuffers {
    std::vector<uint64_t> bits;  // flag word + cache bits
    int my_length = 0;
    std::vector<int> lengths, displs;
    std::vector<uint8_t> request_bytes, gathered, response_bytes;
    uint64_t response_length = 0;
  };
  std::unique_ptr<CycleBuffers> mpi_buffers_ = std::make_unique<CycleBuffers>();

  // Background-thread state.
  std::unordered_map<std::string, std::unique_ptr<Pending>> pending_;
  // This rank's refusals of each name not answered yet (Note [Refused
  // duplicates] in controller.h): the names in flight that refused them,
  // oldest first, and whether the oldest was reported (at most one of a name
  // is out at a time).
  struct Refusals {
    std::deque<std::string> unreported;
    bool reported = false;
  };
  std::unordered_map<std::string, Refusals> refusals_;
  std::vector<Pending*> order_;  // pending_'s entries, oldest first
  // Drops the entries taken out of pending_ from order_ (before they die
  // with the cycle's work).
  void DropTaken();
  ResponseCache cache_;
  const int cache_words_;
  PlanCache plans_;                           // the same on every rank
  std::atomic<uint64_t> perturb_digest_{0};   // PerturbStateDigest
  std::vector<size_t> slot_to_work_;          // scratch of RunPlans, one per cache slot
  std::vector<std::unique_ptr<CachedGroup>> cached_groups_;  // admitted whole, waiting (oldest first)
  std::vector<std::unique_ptr<CachedGroup>> ready_groups_;   // this cycle's, to run from their plans
  std::vector<uint8_t> claimed_slots_;        // slots of ready_groups_ (TakeCacheHits skips them)
  struct PlanRun {                            // RunPlans' list: one group to run from its plan
    int first_slot;
    Plan* plan;
    CachedGroup* group;  // null: the members are work entries
  };
  std::vector<PlanRun> plan_runs_;
  std::vector<BucketMember> plan_members_;    // RunPlans' members of one bucket
  struct BucketScratch {                      // RunAllreduceBucket's lists, reused across buckets
    std::vector<Communicator::FusedMember> members;
    std::vector<TensorEntry*> done;
    std::vector<void*> events;
  };
  BucketScratch bucket_scratch_;
  double report_cached_after_s_;
  StallInspector stall_;      // rank 0
  Coordinator coordinator_;   // rank 0
  std::vector<ResponseMessage> stalled_;  // rank 0: stall errors for the next round
  Timeline timeline_;         // rank 0
  bool mark_cycles_ = false;  // background thread: CYCLE_START events (start_timeline)

  // Run-time timeline control: ControlTimeline -> TimelineControl::Apply at
  // the top of each cycle.
  TimelineControl timeline_control_;
  uint64_t cycle_ = 0;
  bool joined_ = false;       // this rank's join is pending (executor.cc)

  // Counters behind GetEngineStats (counters.h).
  EngineCounters counters_;
  static void Add(std::atomic<uint64_t>& c, uint64_t n = 1) { EngineCounters::Add(c, n); }
  static void AddSeconds(std::atomic<uint64_t>& c, double s) { EngineCounters::AddSeconds(c, s); }

  // Dead-rank detection (transport/liveness.h): calls Abort() when a peer
  // dies. Null when its setup failed (the job runs without it).
  std::unique_ptr<LivenessMonitor> liveness_;
  bool keep_liveness_ = false;  // KeepLivenessAfterStop

  std::thread thread_;  // last: starts after everything it uses exists
};

}  // namespace nvgroup
