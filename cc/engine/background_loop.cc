// The background loop (background_loop.h): each cycle admits the queue's
// submissions, agrees with the other ranks on what is ready (the cache-bit
// allreduce, carrying the state digest and the shutdown bit), negotiates
// through rank 0 when some rank needs it, and executes; also the engine's
// start, stop and abort. The plan cache is in plan_cache.cc, execution in
// executor.cc, completion in completion.cc.
#include "engine/background_loop.h"

#include <algorithm>
#include <chrono>
#include <functional>

#include "common/checks.h"
#include "common/logging.h"
#include "common/thread_setup.h"
#include "engine/engine_control.h"
#include "engine/rank_lists.h"
#include "engine/wait_policy.h"
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
      cpu_comm_(std::move(cpu)),
      topology_(cpu_comm_->topology()),
      queue_(rank),
      cache_(knobs.cache_capacity),
      cache_words_((knobs.cache_capacity + 63) / 64),
      claimed_slots_(std::max(knobs.cache_capacity, 0), 0),
      stall_(size, knobs.stall_warning_s, knobs.stall_shutdown_s),
      coordinator_(size, &stall_) {
  // See Note [Reporting stuck cache hits].
  report_cached_after_s_ = 1.0;
  if (knobs.stall_warning_s > 0) report_cached_after_s_ = std::min(report_cached_after_s_, knobs.stall_warning_s / 2);
  if (knobs.stall_shutdown_s > 0) report_cached_after_s_ = std::min(report_cached_after_s_, knobs.stall_shutdown_s / 2);
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
    if (!s.ok()) NVG_LOG(kWarning) << "NVGROUP_TIMELINE: " << s.message() << "; continuing without a timeline";
  }
  if (cuda != nullptr) {  // created by Init (EngineOptions::cuda_at_init)
    cuda_comm_ = std::move(cuda);
    cuda_comm_for_abort_ = cuda_comm_.get();
    cuda_ordinal_ = cuda_comm_->device().ordinal;
#ifdef NVGROUP_WITH_CUDA
    completion_events_ = std::make_unique<CompletionEvents>(cuda_ordinal_);
#endif
    finalizer_ = std::make_unique<Finalizer>();
    finalizer_thread_ = finalizer_->thread_id();
  }
  thread_ = std::thread([this] { Loop(); });
}

Engine::~Engine() { Stop(); }

// Note [Reporting stuck cache hits]
// A cached request only sets its bit; rank 0 hears of it only if a negotiation
// round happens. If it is not ready on every rank within report_cached_after_s_
// (1 s, or half the stall warning/shutdown time when shorter), this rank forces
// a round and reports it, so the stall inspector can name the missing ranks.
// Reporting does not stop it from completing through the cache later: rank 0
// then forgets its report (Coordinator::Forget). 1 s: ranks of a healthy job
// drift apart by milliseconds to ~100 ms per step (input pipelines, stragglers),
// so steady-state steps never pay for a report, while the default 60 s stall
// warning still sees the name almost from the start.

void Engine::TimelineAdmitted(const TensorEntry& entry, double now) {
  timeline_.Begin(entry.request.name, "QUEUE", entry.enqueue_time);
  timeline_.End(entry.request.name, "QUEUE", now);
  timeline_.Begin(entry.request.name, "NEGOTIATE", now);
}

void Engine::Admit(TensorEntry entry, double now) {
  if (timeline_.enabled()) TimelineAdmitted(entry, now);
  if (entry.request.type == CollectiveType::kJoin) joined_ = true;
  // Note [Refused duplicates]: after a refusal of its name (a cached group's
  // entries came before any refusal: AdmitSubmission).
  const bool held = !refusals_.empty() && refusals_.count(entry.request.name) != 0;
  AddPending(std::move(entry), now);
  if (held) order_.back()->held = true;
}

void Engine::AddRefusal(const Submission& refusal) {
  for (const std::string& name : refusal.refused_names)
    refusals_[name].unreported.push_back(refusal.refused_duplicate);
}

bool Engine::RefusalDue(const std::string& name) const {
  auto r = refusals_.find(name);
  if (r == refusals_.end() || r->second.reported || r->second.unreported.empty()) return false;
  // Not before this rank's request of that name that came before it (held
  // ones came after it).
  auto p = pending_.find(name);
  return p == pending_.end() || p->second->held;
}

bool Engine::AnyRefusalDue() const {
  for (const auto& [name, r] : refusals_)
    if (RefusalDue(name)) return true;
  return false;
}

bool Engine::TakeRefusalAnswer(const ResponseMessage& r) {
  auto it = refusals_.find(r.name);
  if (it == refusals_.end() || !it->second.reported) return false;
  it->second.reported = false;
  if (it->second.unreported.empty()) {
    refusals_.erase(it);
    auto p = pending_.find(r.name);
    if (p != pending_.end()) p->second->held = false;  // reported or cached from the next cycle on
  }
  return true;
}

void Engine::AddPending(TensorEntry entry, double since) {
  Add(counters_.admitted_entries);
  auto p = std::make_unique<Pending>();
  p->since = since;
  p->entry = std::move(entry);
  order_.push_back(p.get());
  const std::string& name = p->entry.request.name;
  pending_.emplace(name, std::move(p));  // names in flight are unique (TensorQueue::Push)
}

void Engine::DropTaken() {
  order_.erase(std::remove_if(order_.begin(), order_.end(), [](const Pending* p) { return p->taken; }), order_.end());
}

bool Engine::FillCacheBits(double now, std::vector<uint64_t>* bits) {
  std::vector<int> slots(order_.size(), -1);
  const std::vector<Pending*>& entries = order_;
  std::unordered_map<uint64_t, uint32_t> group_hits;
  for (size_t i = 0; i < order_.size(); ++i) {
    if (entries[i]->held) continue;  // Note [Refused duplicates]: no bit, no report
    const RequestMessage& m = entries[i]->entry.message;
    int slot = cache_.Find(entries[i]->entry.request.name);
    if (slot >= 0 && EntryMatchesResponse(entries[i]->entry, cache_.Get(slot), rank_)) {
      slots[i] = slot;
      if (m.group_id != 0) ++group_hits[m.group_id];
    }
  }
  bool must_report = false;
  for (size_t i = 0; i < order_.size(); ++i) {
    Pending* p = entries[i];
    const RequestMessage& m = p->entry.message;
    // A group hits the cache whole or not at all (all its members arrive in
    // the same cycle: TensorQueue::Push is atomic).
    if (slots[i] >= 0 && m.group_id != 0 &&
        (group_hits[m.group_id] != m.group_size ||
         cache_.GroupCount(m.group_id) != static_cast<int>(m.group_size)))
      slots[i] = -1;
    if (slots[i] >= 0) (*bits)[1 + slots[i] / 64] |= uint64_t{1} << (slots[i] % 64);
    if (!p->reported && !p->held && (slots[i] < 0 || now - p->since >= report_cached_after_s_))
      must_report = true;
  }
  if (!refusals_.empty() && AnyRefusalDue()) must_report = true;
  for (const std::unique_ptr<CachedGroup>& g : cached_groups_)  // Note [Cached groups]
    for (const auto& [word, mask] : plans_.At(g->submission.group_id).bit_words) (*bits)[1 + word] |= mask;
  if (joined_) SetJoinedCacheBits(bits);
  return must_report;
}

std::vector<Engine::Work> Engine::TakeCacheHits(const std::vector<uint64_t>& bits) {
  std::vector<int> hits;
  std::unordered_map<uint64_t, uint32_t> group_hits;
  for (int word = 0; word < cache_words_; ++word) {
    for (uint64_t b = bits[1 + word]; b != 0; b &= b - 1) {
      const int slot = word * 64 + __builtin_ctzll(b);
      hits.push_back(slot);
      if (!claimed_slots_[slot] && cache_.Get(slot).group_id != 0) ++group_hits[cache_.Get(slot).group_id];
    }
  }
  const bool forget = rank_ == 0 && coordinator_.HoldsReports();
  std::vector<Work> work;
  for (int slot : hits) {
    const ResponseMessage& r = cache_.Get(slot);
    if (claimed_slots_[slot]) {  // a member of a ready cached group (RunPlans runs it)
      claimed_slots_[slot] = 0;
      cache_.Touch(slot);  // in slot order with the other hits: the LRU stays the same on every rank
      if (forget) coordinator_.Forget(r.name);
      continue;
    }
    if (r.group_id != 0 && group_hits[r.group_id] != r.group_size) continue;
    Work w;
    w.response = &r;
    w.slot = slot;
    auto it = pending_.find(r.name);
    if (it != pending_.end()) {
      w.pending = std::move(it->second);  // the bit is set only for pending names...
      w.pending->taken = true;
      pending_.erase(it);
    } else {
      w.pending = MakeJoinStandIn(r);  // ...or, on a joined rank, for stand-ins
    }
    cache_.Touch(slot);
    if (forget) coordinator_.Forget(r.name);
    work.push_back(std::move(w));
  }
  return work;
}

Status Engine::Negotiate(double now, std::vector<Work>* work) {
  std::vector<RequestMessage> mine;
  for (Pending* p : order_) {  // the cycle's cache hits left order_ (DropTaken)
    if (p->reported || p->held) continue;
    p->reported = true;
    mine.push_back(p->entry.Report());
  }
  // Note [Refused duplicates]: the refusals due, after this cycle's demotions
  // and cache hits (a request ahead of a refusal is in pending_ by now).
  for (auto& [name, refusal] : refusals_) {
    if (!RefusalDue(name)) continue;
    RequestMessage& m = mine.emplace_back();
    m.name = name;
    m.refused_duplicate = std::move(refusal.unreported.front());
    refusal.unreported.pop_front();
    refusal.reported = true;
  }
  CycleBuffers& b = *mpi_buffers_;
  b.request_bytes = EncodeRequestList(mine);

  // Gather every rank's request list at rank 0: lengths, then bytes. Orders
  // rank 0's decision after every rank's report of this cycle.
  b.my_length = static_cast<int>(b.request_bytes.size());
  b.lengths.assign(rank_ == 0 ? size_ : 1, 0);
  b.displs.assign(rank_ == 0 ? size_ : 1, 0);
  MPI_Request req;
  NVG_MPI_CHECK(MPI_Igather(&b.my_length, 1, MPI_INT, b.lengths.data(), 1, MPI_INT, 0, comm_, &req));
  NVG_RETURN_IF_ERROR(Wait(&req, "the request-length gather of the negotiation round"));
  size_t total = 0;
  if (rank_ == 0) {
    for (int r = 0; r < size_; ++r) {
      b.displs[r] = static_cast<int>(total);
      total += b.lengths[r];
    }
  }
  b.gathered.resize(std::max<size_t>(total, 1));
  NVG_MPI_CHECK(MPI_Igatherv(b.request_bytes.data(), b.my_length, MPI_BYTE, b.gathered.data(),
                             b.lengths.data(), b.displs.data(), MPI_BYTE, 0, comm_, &req));
  NVG_RETURN_IF_ERROR(Wait(&req, "the request gather of the negotiation round"));

  // Rank 0 decides; everyone receives the same response list. The broadcast
  // orders every rank's execution (and cache update) after rank 0's decision,
  // so all ranks execute and cache the same responses in the same order.
  ResponseList list;
  if (rank_ == 0) {
    for (int r = 0; r < size_ && list.fatal_code == StatusCode::kOk; ++r) {
      std::vector<RequestMessage> requests;
      Status s = DecodeRequestList(b.gathered.data() + b.displs[r], b.lengths[r], &requests);
      if (!s.ok()) {
        list.fatal_code = s.code();
        list.fatal_message = "rank 0 could not read rank " + std::to_string(r) + "'s requests: " + s.message();
        break;
      }
      for (RequestMessage& q : requests) coordinator_.AddRequest(r, std::move(q), now);
    }
    list.responses = std::move(stalled_);
    stalled_.clear();
    for (ResponseMessage& r : coordinator_.TakeReadyResponses()) list.responses.push_back(std::move(r));
    b.response_bytes = EncodeResponseList(list);
  }
  b.response_length = b.response_bytes.size();
  NVG_MPI_CHECK(MPI_Ibcast(&b.response_length, 1, MPI_UINT64_T, 0, comm_, &req));
  NVG_RETURN_IF_ERROR(Wait(&req, "the response-length broadcast of the negotiation round"));
  if (rank_ != 0) b.response_bytes.resize(b.response_length);
  NVG_MPI_CHECK(MPI_Ibcast(b.response_bytes.data(), static_cast<int>(b.response_length), MPI_BYTE, 0, comm_, &req));
  NVG_RETURN_IF_ERROR(Wait(&req, "the response broadcast of the negotiation round"));
  if (rank_ != 0)
    NVG_RETURN_IF_ERROR(DecodeResponseList(b.response_bytes.data(), b.response_bytes.size(), &list));
  if (list.fatal_code != StatusCode::kOk) return Status(list.fatal_code, list.fatal_message);

  for (ResponseMessage& r : list.responses) {
    if (!refusals_.empty() && TakeRefusalAnswer(r)) {  // Note [Refused duplicates]
      if (r.ok())
        return Status::Internal("rank 0 released '" + r.name + "', whose collective this rank refused as a "
                                "duplicate, as a success");
      continue;
    }
    if (r.ok() && r.type != CollectiveType::kJoin) cache_.Put(r);  // a join's answer changes
    Work w;
    auto it = pending_.find(r.name);
    if (it != pending_.end()) {
      w.pending = std::move(it->second);
      w.pending->taken = true;
      pending_.erase(it);
    } else if (r.ok() && joined_) {
      w.pending = MakeJoinStandIn(r);  // rank 0 counted this joined rank in
      if (w.pending == nullptr)
        return Status::Internal("rank 0 released '" + r.name + "' to joined rank " + std::to_string(rank_) +
                                ", which cannot stand in for a " + CollectiveTypeName(r.type));
    } else if (r.ok()) {
      return Status::Internal("rank 0 released '" + r.name + "', which this rank never submitted");
    }
    w.owned = std::make_unique<ResponseMessage>(std::move(r));
    w.response = w.owned.get();
    work->push_back(std::move(w));
  }
  return Status::Ok();
}

Status Engine::Execute(std::vector<Work>* work, size_t cache_hits) {
  if (work->empty() && ready_groups_.empty()) return Status::Ok();
  NVG_LOG(kDebug) << "cycle " << cycle_ << ": executing " << work->size() << " responses ("
                  << cache_hits << " from the response cache, " << work->size() - cache_hits
                  << " negotiated through rank 0) and " << ready_groups_.size() << " cached groups";
  const double now = MonotonicSeconds();
  if (mark_cycles_ && timeline_.enabled()) timeline_.MarkCycle(now);
  if (timeline_.enabled()) {
    for (const Work& w : *work)
      if (w.pending) timeline_.End(w.response->name, "NEGOTIATE", now);
    for (const std::unique_ptr<CachedGroup>& g : ready_groups_)
      for (const TensorEntry& e : g->submission.entries) timeline_.End(e.request.name, "NEGOTIATE", now);
  }
  // Whole cached groups with a plan first (Note [Cached plans]), then the rest
  // through the fusion planner, in response order.
  std::vector<bool> done(work->size(), false);
  NVG_RETURN_IF_ERROR(RunPlans(work, cache_hits, &done));
  std::vector<size_t> rest;
  std::vector<const ResponseMessage*> responses;
  for (size_t i = 0; i < work->size(); ++i) {
    if (done[i]) continue;
    rest.push_back(i);
    responses.push_back((*work)[i].response);
  }
  if (!rest.empty()) {
    const size_t threshold = std::min(knobs_.fusion_threshold, cpu_comm_->registered_capacity());
    for (FusionBucket bucket : PlanFusion(responses, threshold)) {
      for (size_t& k : bucket.responses) k = rest[k];
      NVG_RETURN_IF_ERROR(RunBucket(bucket, work));
    }
  }
  MakePlans(*work);
  return Status::Ok();
}

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
  const double cycle_s = knobs_.cycle_time_ms / 1000.0;
  int quick_cycles = kQuickCycles;  // Note [Leftovers start the next cycle]
  ExpectedWork expected;             // Note [Waiting for a lock-step caller] (wait_policy.h)
  const std::function<bool(double)> sleep_unless_pushed = [this](double s) { return queue_.SleepUnlessPushed(s); };
  std::vector<Submission> fresh;
  for (;; ++cycle_) {
    if (abort_) break;  // exit_status is replaced by the abort reason below
    fresh.clear();
    bool shutdown_requested = false;
    const bool leftovers = !pending_.empty() && quick_cycles > 0;
    // Note [An idle rank sleeps] and Note [Waiting for a lock-step caller] (wait_policy.h).
    const bool nothing_in_flight =
        pending_.empty() && cached_groups_.empty() && !joined_ && (refusals_.empty() || !AnyRefusalDue());
    const double wait_s = leftovers ? std::min(kLeftoverWaitS, cycle_s) : IdleCycleWaitSeconds(cycle_s, nothing_in_flight);
    AddSeconds(counters_.idle_ns, queue_.WaitAndPop(wait_s, expected.PollSeconds(MonotonicSeconds()),
                                                    std::min(kAdmissionGapS, cycle_s), cycle_s, &fresh,
                                                    &shutdown_requested));
    if (leftovers) Add(counters_.quick_cycles);
    Add(counters_.cycles);
    if (liveness_) liveness_->SetProgress(cycle_);
    if (timeline_control_.pending()) timeline_control_.Apply(&timeline_, &mark_cycles_);
    const double now = MonotonicSeconds();
    if (!fresh.empty()) expected.Activity(now);
    for (Submission& s : fresh) {
      if (s.refused_names.empty()) AdmitSubmission(std::move(s), now);
      else AddRefusal(s);
    }
    // Note [Cached groups]: groups that waited too long or whose plan changed.
    if (!cached_groups_.empty()) DemoteCachedGroups(now, joined_);
    const double admitted = MonotonicSeconds();
    AddSeconds(counters_.admit_ns, admitted - now);

    std::vector<uint64_t>& bits = mpi_buffers_->bits;
    // Flag word, cache bits, then the state digest and its complement (see
    // kStateDigestWords).
    bits.assign(1 + cache_words_ + kStateDigestWords, 0);
    const uint64_t digest = StateDigest() ^ perturb_digest_.load(std::memory_order_relaxed);
    bits[1 + cache_words_] = digest;
    bits[2 + cache_words_] = ~digest;
    bool must_report = FillCacheBits(now, &bits);
    AddSeconds(counters_.lookup_ns, MonotonicSeconds() - admitted);
    if (rank_ == 0) {
      for (ResponseMessage& r : coordinator_.TakeStalledResponses(now)) stalled_.push_back(std::move(r));
      must_report = must_report || !stalled_.empty();
    }
    bits[0] = (must_report ? 0 : kNothingToReport) | (shutdown_requested ? 0 : kNoShutdown);
    // Orders this cycle after every rank's decision for it: all ranks read the
    // same bits, so all take the same branches below. With one rank the bits
    // are already their AND over the ranks: no MPI call.
    if (size_ > 1) {
      MPI_Request req;
      int rc = MPI_Iallreduce(MPI_IN_PLACE, bits.data(), static_cast<int>(bits.size()), MPI_UINT64_T,
                              MPI_BAND, comm_, &req);
      if (rc != MPI_SUCCESS) {
        exit_status = Status::Internal("MPI_Iallreduce of the cache bits failed: " + MpiErrorString(rc));
        break;
      }
      Add(counters_.agreement_allreduces);
      // Note [An idle rank sleeps]: an idle rank's agreement waits for its
      // peers' cycle, asleep until a submission comes (Note [Waiting for a
      // lock-step caller]).
      exit_status = WaitMpi(&req, "the agreement allreduce", knobs_.peer_timeout_s, abort_, static_cast<int64_t>(cycle_),
                            /*sleep_at_once=*/nothing_in_flight && fresh.empty() && !shutdown_requested,
                            &sleep_unless_pushed);
    }
    const double agreed = MonotonicSeconds();
    AddSeconds(counters_.agree_ns, agreed - now);
    if (!exit_status.ok()) break;
    if ((bits[1 + cache_words_] ^ bits[2 + cache_words_]) != ~uint64_t{0}) {
      // Some bit of the digest is 1 on one rank and 0 on another: the ranks'
      // caches or plans differ, so cache hits would run different collectives.
      exit_status = Status::Internal(
          "the ranks' response caches or cached plans differ (a bug in nvgroup_tf, detected by the "
          "state digest of cycle " + std::to_string(cycle_) + "); the engine has stopped rather than "
          "run mismatched collectives");
      break;
    }
    if (!(bits[0] & kNoShutdown)) {
      shut_down = true;
      break;
    }
    const double lookup_start = MonotonicSeconds();
    const bool round = !(bits[0] & kNothingToReport);
    // Note [Cached groups]: a round's cycle runs everything entry by entry.
    if (!cached_groups_.empty()) {
      if (round) DemoteCachedGroups(agreed, true);
      else TakeReadyCachedGroups(bits);
    }
    std::vector<Work> work = TakeCacheHits(bits);
    DropTaken();
    AddSeconds(counters_.lookup_ns, MonotonicSeconds() - lookup_start);
    const size_t cache_hits = work.size();
    Add(counters_.cached_responses, cache_hits);
    for (const std::unique_ptr<CachedGroup>& g : ready_groups_) Add(counters_.cached_responses, g->submission.entries.size());
    if (round) {
      for (Work& w : work) w.Own();  // Negotiate's Puts may change the hits' slots
      exit_status = Negotiate(now, &work);
      DropTaken();
      Add(counters_.negotiation_rounds);
      Add(counters_.negotiated_responses, work.size() - cache_hits);
    }
    const double negotiated = MonotonicSeconds();
    AddSeconds(counters_.negotiate_ns, negotiated - agreed);
    if (exit_status.ok()) exit_status = Execute(&work, cache_hits);
    const bool executed = !work.empty() || !ready_groups_.empty();
    quick_cycles = executed ? kQuickCycles : quick_cycles - 1;
    if (executed) expected.Activity(MonotonicSeconds());  // completions ran: the caller's next step comes
    AddSeconds(counters_.execute_ns, MonotonicSeconds() - negotiated);
    if (!exit_status.ok()) {
      exit_status = Cause(exit_status);
      // Requests taken out of pending_ this cycle but not completed yet.
      for (Work& w : work)
        if (w.pending != nullptr && w.pending->entry.request.done) Complete(w.pending.get(), exit_status);
      for (std::unique_ptr<CachedGroup>& g : ready_groups_)
        for (TensorEntry& e : g->submission.entries)
          if (e.request.done) Complete(&e, exit_status);
      ready_groups_.clear();
      break;
    }
    ready_groups_.clear();
  }

  if (!shut_down) {
    {
      std::lock_guard<std::mutex> lock(abort_mu_);
      if (!abort_status_.ok()) exit_status = abort_status_;
    }
    if (exit_status.code() == StatusCode::kUnavailable || exit_status.code() == StatusCode::kAborted)
      mpi_broken_ = true;
    if (exit_status.code() == StatusCode::kUnavailable && !abort_) {  // see Note [Liveness probe]
      StatusOr<std::vector<int>> silent = FindSilentRanks(comm_, std::min(2.0, knobs_.peer_timeout_s));
      if (silent.ok() && !silent.value().empty()) {
        exit_status = Status::Unavailable(exit_status.message() + "; ranks " + RanksText(silent.value()) +
                                          " did not answer a liveness probe");
      }
      const std::string hung = liveness_ ? liveness_->DescribeSilentPeers() : std::string();
      if (!hung.empty()) exit_status = Status::Unavailable(exit_status.message() + "; " + hung);
    }
    NVG_LOG(kError) << "background loop stopped: " << exit_status.ToString();
    cpu_comm_->Abort();
    if (cuda_comm_) cuda_comm_->Abort();
  }
  // Fail what is left: pending entries, then anything queued after the last cycle.
  const Status closed = shut_down ? Status::Aborted("nvgroup_tf was shut down") : exit_status;
  std::vector<Submission> queued = queue_.Close(closed);
  DemoteCachedGroups(MonotonicSeconds(), true);
  for (Submission& s : queued)
    for (TensorEntry& e : s.entries) Admit(std::move(e), MonotonicSeconds());
  for (Pending* p : order_)
    Complete(p, shut_down ? Status::Aborted("nvgroup_tf was shut down with '" + p->entry.request.name + "' in flight")
                          : exit_status);
  order_.clear();
  pending_.clear();
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
      abort_ = true;
      cpu_comm_->Abort();
    }
  }
  thread_.join();
  if (liveness_ && keep_liveness_ && !LostPeers()) {
    liveness_->StopWatchingProgress();  // the runtime watches MPI_Finalize with it
  } else if (liveness_) {
    liveness_->Close();  // BYE: this rank leaves on purpose, not a death
  }
  finalizer_.reset();  // runs the remaining CUDA completions
#ifdef NVGROUP_WITH_CUDA
  completion_events_.reset();  // after the finalizer: no event is pending any more
#endif
  {
    std::lock_guard<std::mutex> lock(abort_mu_);  // no Abort() inside a communicator being freed
    comms_freed_ = true;
  }
  cuda_comm_.reset();
  cpu_comm_.reset();
  if (mpi_broken_ || abort_) (void)mpi_buffers_.release();  // see CycleBuffers: MPI may still write there
  // After a timeout a negotiation request may never complete; freeing the
  // communicator under it is undefined, so it is left to MPI_Finalize.
  int finalized = 0;
  NVG_MPI_CHECK(MPI_Finalized(&finalized));
  if (!mpi_broken_ && !abort_ && !finalized) NVG_MPI_CHECK(MPI_Comm_free(&comm_));
  return Status::Ok();
}

Status Engine::Cause(const Status& s) {
  std::lock_guard<std::mutex> lock(abort_mu_);
  return abort_status_.ok() ? s : abort_status_;
}

void Engine::Abort(const Status& reason) {
  std::lock_guard<std::mutex> lock(abort_mu_);
  if (!abort_status_.ok() || comms_freed_) return;
  abort_status_ = reason.ok() ? Status::Aborted("nvgroup_tf was aborted") : reason;
  // Every negotiation wait polls abort_; the communicators' spin waits return
  // kAborted after Abort(). The loop then fails everything with abort_status_.
  abort_ = true;
  cpu_comm_->Abort();
  if (Communicator* c = cuda_comm_for_abort_.load()) c->Abort();
}

EngineStats Engine::Stats() const {
  return counters_.Snapshot(queue_.groups_not_batched(), queue_.lone_requests_not_batched());
}

bool Engine::OnEngineThread() const {
  const std::thread::id me = std::this_thread::get_id();
  return me == thread_.get_id() || me == finalizer_thread_.load();
}

Status Engine::ControlTimeline(bool start, const std::string& path, bool mark_cycles) {
  if (rank_ != 0) return Status::Ok();  // rank 0 writes the timeline, as with NVGROUP_TIMELINE
  return timeline_control_.Request(start, path, mark_cycles, knobs_.peer_timeout_s);
}

}  // namespace nvgroup
