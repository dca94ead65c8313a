// The Engine (engine.h): its start, the background loop (each cycle a handful
// of named steps: wait for submissions, admit them, agree with the other
// ranks on what is ready through the cache-bit allreduce, which also carries
// the state digest and the shutdown bit, take the agreed work, negotiate
// through rank 0 when some rank needs it, execute), its exit, stop and abort.
// What each step does lives in the object it calls (engine.h lists them).
#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <functional>

#include "common/checks.h"
#include "common/logging.h"
#include "common/thread_setup.h"
#include "engine/engine_control.h"
#include "engine/rank_lists.h"
#include "engine/wire_format.h"

namespace nvgroup {

// Flag word (word 0 of the cycle's bit vector). Each bit means "all clear" so
// that the bitwise AND tells whether *any* rank cleared it.
constexpr uint64_t kNothingToReport = 1u << 0;  // no rank needs a negotiation round
constexpr uint64_t kNoShutdown = 1u << 1;       // no rank asked to shut down
// After the cache bits: the rank's state digest (ResponseCache::digest() and
// the cached plans) and its complement. Under the bitwise AND, bit k of the
// two words comes out 1 and 0 (or 0 and 1) when every rank has the same bit k,
// and 0 and 0 when they differ, so XOR of the two words is all ones exactly
// when every rank holds the same digest.
constexpr int kStateDigestWords = 2;

Engine::Engine(const Knobs& knobs, MPI_Comm comm, int rank, int size, std::unique_ptr<Communicator> cpu,
               bool watch_liveness, std::unique_ptr<Communicator> cuda)
    : knobs_(knobs),
      comm_(comm),
      rank_(rank),
      size_(size),
      topology_(cpu->topology()),
      queue_(rank),
      negotiation_(knobs_, comm, rank, size, abort_.flag(), &counters_, &timeline_),
      groups_(&negotiation_, rank, &counters_, &timeline_),
      execution_(knobs_, comm, rank, size, std::move(cpu), std::move(cuda), &queue_, &abort_, &counters_,
                 &timeline_) {
  // Collective; Init's collectives just ran, so the ranks are in step and
  // NVGROUP_TIMEOUT bounds the setup.
  if (watch_liveness) {
    // A lost peer aborts every engine of the process (all process sets).
    const LivenessSettings liveness_settings{knobs.peer_timeout_s, LivenessAddressSettingsFrom(knobs)};
    StatusOr<std::unique_ptr<LivenessMonitor>> liveness =
        LivenessMonitor::Create(comm_, liveness_settings, [](const Status& lost) { AbortEngine(lost); });
    if (liveness.ok()) liveness_ = liveness.consume();
    else NVG_LOG(kWarning) << "dead-rank detection is off: " << liveness.status().message();
  }
  if (rank_ == 0 && !knobs.timeline_path.empty()) {
    Status s = timeline_.Open(knobs.timeline_path, MonotonicSeconds());
    if (!s.ok())
      NVG_LOG(kWarning) << "NVGROUP_TIMELINE: " << s.message() << "; continuing without a timeline";
  }
  thread_ = std::thread([this] { Loop(); });
}

Engine::~Engine() { Stop(); }

// Quiet time that ends admission batching (Note [Admission batching] in
// tensor_queue.h): several times the gap between two enqueues of a burst
// through pybind or TF (3-10 us), a small fraction of one cycle.
constexpr double kAdmissionGapS = 30e-6;

// Note [Leftovers start the next cycle]
// A rank whose cycle left requests pending (some rank had not submitted them
// yet: the burst was split differently across ranks, or a peer is a little
// behind) used to wait the whole cycle time (NVGROUP_CYCLE_TIME, 1 ms) for
// new entries before the next agreement, while the late rank, woken by its
// own submissions, already waited for it in that agreement: every split burst
// cost up to a cycle time. Now such a rank starts the next cycle after
// kLeftoverWaitS and waits for the late rank inside the agreement (WaitMpi:
// bounded polling, then sleeps), where it meets the late submissions as soon
// as they come. To keep ranks that wait on each other's different requests
// (each has leftovers the other lacks) from cycling at that pace, the quick
// restart is allowed for at most kQuickCycles cycles in a row that execute
// nothing; then the cycle time applies again until work runs.
constexpr double kLeftoverWaitS = 20e-6;
constexpr int kQuickCycles = 8;

void Engine::Loop() {
  // Sleeps of this thread (the admission gap, the cycle wait, WaitMpi's
  // backoff) end when asked.
  WakeOnTime();
  NameThisThread("nvg-loop");
  Status exit_status;
  bool shut_down = false;
  LoopState loop;
  loop.quick_cycles = kQuickCycles;
  loop.sleep_unless_pushed = [this](double s) { return queue_.SleepUnlessPushed(s); };
  for (;; ++cycle_) {
    if (abort_.raised()) break;  // exit_status is replaced by the abort reason in ExitLoop
    Cycle c;
    WaitForSubmissions(&loop, &c);
    BeginCycle(&c);
    PhaseTimer agree(&counters_.agree_ns, c.now);  // admit_s and lookup_s run inside agree_s
    AdmitSubmissions(&loop, &c);
    exit_status = Agree(loop, &c);
    c.agreed = agree.Stop();
    if (exit_status.ok()) exit_status = ReadAgreement(&c);
    if (!exit_status.ok()) break;
    if (c.shut_down) {
      shut_down = true;
      break;
    }
    PhaseTimer negotiate(&counters_.negotiate_ns, c.agreed);
    std::vector<Work> work = TakeAgreedWork(&c);
    if (c.round) exit_status = NegotiateRound(c, &work);
    PhaseTimer execute(&counters_.execute_ns, negotiate.Stop());
    if (exit_status.ok()) exit_status = Execute(&work, c.cache_hits);
    const bool executed = !work.empty() || !groups_.ready().empty();
    loop.quick_cycles = executed ? kQuickCycles : loop.quick_cycles - 1;
    if (executed)
      loop.expected.Activity(MonotonicSeconds());  // completions ran: the caller's next step comes
    execute.Stop();
    if (!exit_status.ok()) {
      exit_status = abort_.Cause(exit_status);
      FailCycle(&work, exit_status);
      break;
    }
    groups_.ClearReady();
  }
  ExitLoop(exit_status, shut_down);
}

void Engine::WaitForSubmissions(LoopState* loop, Cycle* c) {
  loop->fresh.clear();
  c->leftovers = negotiation_.HasPending() && loop->quick_cycles > 0;
  // Note [An idle rank sleeps] and Note [Waiting for a lock-step caller] (wait_policy.h).
  c->nothing_in_flight = negotiation_.NothingInFlight() && groups_.empty();
  const double cycle_s = knobs_.cycle_time_ms / 1000.0;
  const double wait_s = c->leftovers ? std::min(kLeftoverWaitS, cycle_s)
                                     : IdleCycleWaitSeconds(cycle_s, c->nothing_in_flight);
  EngineCounters::AddSeconds(counters_.idle_ns,
                             queue_.WaitAndPop(wait_s, loop->expected.PollSeconds(MonotonicSeconds()),
                                               std::min(kAdmissionGapS, cycle_s), cycle_s, &loop->fresh,
                                               &c->shutdown_requested));
}

void Engine::BeginCycle(Cycle* c) {
  if (c->leftovers) EngineCounters::Add(counters_.quick_cycles);
  EngineCounters::Add(counters_.cycles);
  if (liveness_) liveness_->SetProgress(cycle_);
  if (timeline_control_.pending()) timeline_control_.Apply(&timeline_, &mark_cycles_);
  c->now = MonotonicSeconds();
}

void Engine::AdmitSubmissions(LoopState* loop, Cycle* c) {
  if (!loop->fresh.empty()) loop->expected.Activity(c->now);
  PhaseTimer admit(&counters_.admit_ns, c->now);
  for (Submission& s : loop->fresh) {
    if (s.refused_names.empty()) groups_.Admit(std::move(s), c->now);
    else negotiation_.AddRefusal(s);
  }
  // Note [Cached groups]: groups that waited too long or whose plan changed.
  if (!groups_.empty()) groups_.Demote(c->now, negotiation_.joined());
  c->admitted = admit.Stop();
}

Status Engine::Agree(const LoopState& loop, Cycle* c) {
  std::vector<uint64_t>& bits = negotiation_.agreement_bits();
  const int words = negotiation_.cache_words();
  bool must_report = false;
  {
    PhaseTimer lookup(&counters_.lookup_ns, c->admitted);
    // Flag word, cache bits, then the state digest and its complement (see
    // kStateDigestWords).
    bits.assign(1 + words + kStateDigestWords, 0);
    const uint64_t digest = StateDigest() ^ perturb_digest_.load(std::memory_order_relaxed);
    bits[1 + words] = digest;
    bits[2 + words] = ~digest;
    must_report = negotiation_.FillCacheBits(c->now, &bits);
    groups_.SetCacheBits(&bits);
  }
  if (rank_ == 0) must_report = negotiation_.TakeStalledResponses(c->now) || must_report;
  bits[0] = (must_report ? 0 : kNothingToReport) | (c->shutdown_requested ? 0 : kNoShutdown);
  // Orders this cycle after every rank's decision for it: all ranks read the
  // same bits, so all take the same branches below. With one rank the bits
  // are already their AND over the ranks: no MPI call.
  if (size_ <= 1) return Status::Ok();
  MPI_Request req;
  int rc = MPI_Iallreduce(MPI_IN_PLACE, bits.data(), static_cast<int>(bits.size()), MPI_UINT64_T, MPI_BAND,
                          comm_, &req);
  if (rc != MPI_SUCCESS)
    return Status::Internal("MPI_Iallreduce of the cache bits failed: " + MpiErrorString(rc));
  EngineCounters::Add(counters_.agreement_allreduces);
  // Note [An idle rank sleeps]: an idle rank's agreement waits for its
  // peers' cycle, asleep until a submission comes (Note [Waiting for a
  // lock-step caller]).
  return WaitMpi(&req, "the agreement allreduce", knobs_.peer_timeout_s, abort_.flag(),
                 static_cast<int64_t>(cycle_),
                 /*sleep_at_once=*/c->nothing_in_flight && loop.fresh.empty() && !c->shutdown_requested,
                 &loop.sleep_unless_pushed);
}

Status Engine::ReadAgreement(Cycle* c) {
  const std::vector<uint64_t>& bits = negotiation_.agreement_bits();
  const int words = negotiation_.cache_words();
  if ((bits[1 + words] ^ bits[2 + words]) != ~uint64_t{0}) {
    // Some bit of the digest is 1 on one rank and 0 on another: the ranks'
    // caches or plans differ, so cache hits would run different collectives.
    return Status::Internal(
        "the ranks' response caches or cached plans differ (a bug in nvgroup_tf, detected by the "
        "state digest of cycle " +
        std::to_string(cycle_) +
        "); the engine has stopped rather than "
        "run mismatched collectives");
  }
  c->shut_down = !(bits[0] & kNoShutdown);
  c->round = !(bits[0] & kNothingToReport);
  return Status::Ok();
}

std::vector<Work> Engine::TakeAgreedWork(Cycle* c) {
  PhaseTimer lookup(&counters_.lookup_ns);
  const std::vector<uint64_t>& bits = negotiation_.agreement_bits();
  // Note [Cached groups]: a round's cycle runs everything entry by entry.
  if (!groups_.empty()) {
    if (c->round) groups_.Demote(c->agreed, true);
    else groups_.TakeReady(bits);
  }
  std::vector<Work> work = negotiation_.TakeCacheHits(bits);
  lookup.Stop();
  c->cache_hits = work.size();
  EngineCounters::Add(counters_.cached_responses, c->cache_hits);
  for (const std::unique_ptr<CachedGroup>& g : groups_.ready())
    EngineCounters::Add(counters_.cached_responses, g->submission.entries.size());
  return work;
}

Status Engine::NegotiateRound(const Cycle& c, std::vector<Work>* work) {
  for (Work& w : *work) w.Own();  // the round's Puts may change the hits' slots
  Status s = negotiation_.Round(c.now, cycle_, work);
  EngineCounters::Add(counters_.negotiation_rounds);
  EngineCounters::Add(counters_.negotiated_responses, work->size() - c.cache_hits);
  return s;
}

Status Engine::Execute(std::vector<Work>* work, size_t cache_hits) {
  if (work->empty() && groups_.ready().empty()) return Status::Ok();
  NVG_LOG(kDebug) << "cycle " << cycle_ << ": executing " << work->size() << " responses (" << cache_hits
                  << " from the response cache, " << work->size() - cache_hits
                  << " negotiated through rank 0) and " << groups_.ready().size() << " cached groups";
  const double now = MonotonicSeconds();
  if (mark_cycles_ && timeline_.enabled()) timeline_.MarkCycle(now);
  if (timeline_.enabled()) {
    for (const Work& w : *work)
      if (w.pending) timeline_.End(w.response->name, "NEGOTIATE", now);
    for (const std::unique_ptr<CachedGroup>& g : groups_.ready())
      for (const TensorEntry& e : g->submission.entries) timeline_.End(e.request.name, "NEGOTIATE", now);
  }
  // Whole cached groups with a plan first (Note [Cached plans]), then the rest
  // through the fusion planner, in response order.
  std::vector<bool> done(work->size(), false);
  NVG_RETURN_IF_ERROR(groups_.RunPlans(work, cache_hits, &done, &execution_));
  std::vector<size_t> rest;
  std::vector<const ResponseMessage*> responses;
  for (size_t i = 0; i < work->size(); ++i) {
    if (done[i]) continue;
    rest.push_back(i);
    responses.push_back((*work)[i].response);
  }
  const size_t threshold = execution_.fusion_threshold();
  if (!rest.empty()) {
    for (FusionBucket bucket : PlanFusion(responses, threshold)) {
      for (size_t& k : bucket.responses) k = rest[k];
      // Join: this rank's join ends as its answer runs (Execution::RunJoin).
      const ResponseMessage& first = *(*work)[bucket.responses[0]].response;
      if (first.ok() && first.type == CollectiveType::kJoin) negotiation_.EndJoin();
      NVG_RETURN_IF_ERROR(execution_.RunBucket(bucket, work));
    }
  }
  groups_.MakePlans(*work, threshold);
  return Status::Ok();
}

void Engine::FailCycle(std::vector<Work>* work, const Status& cause) {
  // Requests taken out of the pending entries this cycle but not completed yet.
  for (Work& w : *work)
    if (w.pending != nullptr && w.pending->entry.request.done) execution_.Complete(w.pending.get(), cause);
  groups_.FailReady(cause, &execution_);
}

void Engine::ExitLoop(Status exit_status, bool shut_down) {
  if (!shut_down) {
    exit_status = abort_.Cause(exit_status);
    if (exit_status.code() == StatusCode::kUnavailable || exit_status.code() == StatusCode::kAborted)
      mpi_broken_ = true;
    if (exit_status.code() == StatusCode::kUnavailable && !abort_.raised()) {  // see Note [Liveness probe]
      StatusOr<std::vector<int>> silent = FindSilentRanks(comm_, std::min(2.0, knobs_.peer_timeout_s));
      if (silent.ok() && !silent.value().empty()) {
        exit_status = Status::Unavailable(exit_status.message() + "; ranks " + RanksText(silent.value()) +
                                          " did not answer a liveness probe");
      }
      const std::string hung = liveness_ ? liveness_->DescribeSilentPeers() : std::string();
      if (!hung.empty()) exit_status = Status::Unavailable(exit_status.message() + "; " + hung);
    }
    NVG_LOG(kError) << "background loop stopped: " << exit_status.ToString();
    execution_.AbortCommunicators();
  }
  // Fail what is left: pending entries, then anything queued after the last cycle.
  const Status closed = shut_down ? Status::Aborted("nvgroup_tf was shut down") : exit_status;
  std::vector<Submission> queued = queue_.Close(closed);
  groups_.Demote(MonotonicSeconds(), true);
  for (Submission& s : queued)
    for (TensorEntry& e : s.entries) negotiation_.Admit(std::move(e), MonotonicSeconds());
  for (Pending* p : negotiation_.pending_order())
    execution_.Complete(p, shut_down ? Status::Aborted("nvgroup_tf was shut down with '" +
                                                       p->entry.request.name + "' in flight")
                                     : exit_status);
  negotiation_.ClearPending();
  timeline_.Close();
  timeline_control_.LoopGone();
  {
    std::lock_guard<std::mutex> lock(exit_mu_);
    loop_exited_ = true;
  }
  exit_cv_.notify_all();
}

Status Engine::Stop() {
  if (stopped_) return Status::Ok();
  stopped_ = true;
  queue_.RequestShutdown();
  {
    // The loop leaves at the next cycle every rank reaches; a rank that never
    // reaches it makes the cycle time out after NVGROUP_TIMEOUT. The extra
    // second covers the cycle in progress.
    std::unique_lock<std::mutex> lock(exit_mu_);
    if (!exit_cv_.wait_for(lock, std::chrono::duration<double>(knobs_.peer_timeout_s + 1.0),
                           [this] { return loop_exited_.load(); })) {
      abort_.RaiseWithoutReason();
    }
  }
  thread_.join();
  if (liveness_ && keep_liveness_ && !LostPeers()) {
    liveness_->StopWatchingProgress();  // the runtime watches MPI_Finalize with it
  } else if (liveness_) {
    liveness_->Close();  // BYE: this rank leaves on purpose, not a death
  }
  execution_.Stop();  // the remaining CUDA completions, then the communicators
  if (mpi_broken_ || abort_.raised()) negotiation_.AbandonBuffers();  // MPI may still write there
  // After a timeout a negotiation request may never complete; freeing the
  // communicator under it is undefined, so it is left to MPI_Finalize.
  int finalized = 0;
  NVG_MPI_CHECK(MPI_Finalized(&finalized));
  if (!mpi_broken_ && !abort_.raised() && !finalized) NVG_MPI_CHECK(MPI_Comm_free(&comm_));
  return Status::Ok();
}

EngineStats Engine::Stats() const {
  return counters_.Snapshot(queue_.groups_not_batched(), queue_.lone_requests_not_batched(),
                            queue_.bursts_ended_at_size());
}

bool Engine::OnEngineThread() const {
  const std::thread::id me = std::this_thread::get_id();
  return me == thread_.get_id() || me == execution_.finalizer_thread();
}

Status Engine::ControlTimeline(bool start, const std::string& path, bool mark_cycles) {
  if (rank_ != 0) return Status::Ok();  // rank 0 writes the timeline, as with NVGROUP_TIMELINE
  return timeline_control_.Request(start, path, mark_cycles, knobs_.peer_timeout_s);
}

}  // namespace nvgroup
