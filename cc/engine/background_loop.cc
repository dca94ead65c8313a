#include "engine/background_loop.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <functional>

#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "common/checks.h"
#include "common/logging.h"
#include "engine/collectives_extra.h"
#include "engine/engine_control.h"
#include "engine/idle_wait.h"
#include "engine/wire_format.h"

namespace nvgroup {

// Runs `done` callbacks of CUDA requests after their stream work completes, on
// its own thread so the background loop keeps negotiating meanwhile.
class Finalizer {
 public:
  using Job = std::function<void()>;
  Finalizer() : thread_([this] { Run(); }) {}
  std::thread::id thread_id() const { return thread_.get_id(); }
  ~Finalizer() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  void Add(Job job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop_ and drained
      Job job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      job();
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it uses exist
};

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
    StatusOr<std::unique_ptr<LivenessMonitor>> liveness =
        LivenessMonitor::Create(comm_, knobs.peer_timeout_s, [](const Status& lost) { AbortEngine(lost); });
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
  AddPending(std::move(entry), now);
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

const Engine::Plan* Engine::PlanFor(const Submission& s) const {
  if (s.group_id == 0 || joined_) return nullptr;
  auto it = plans_.find(s.group_id);
  if (it == plans_.end()) return nullptr;
  const Plan& plan = it->second;
  if (plan.entry_of.size() != s.entries.size() || !PlanMatchesCache(plan)) return nullptr;
  // Names are unique among the submission's entries (TensorQueue::Push), so
  // a match of every member makes entry_of a one-to-one map.
  for (size_t k = 0; k < plan.slots.size(); ++k) {
    const uint32_t e = plan.entry_of[k];
    if (e >= s.entries.size() || !EntryMatchesResponse(s.entries[e], cache_.Get(plan.slots[k]), rank_))
      return nullptr;
  }
  return &plan;
}

void Engine::AdmitSubmission(Submission submission, double now) {
  Add(counters_.queue_entries);
  if (PlanFor(submission) != nullptr) {  // Note [Cached groups]
    if (timeline_.enabled())
      for (const TensorEntry& e : submission.entries) TimelineAdmitted(e, now);
    auto g = std::make_unique<CachedGroup>();
    g->submission = std::move(submission);
    g->since = now;
    cached_groups_.push_back(std::move(g));
    Add(counters_.cached_group_admissions);
    return;
  }
  for (TensorEntry& e : submission.entries) Admit(std::move(e), now);
}

void Engine::DemoteCachedGroups(double now, bool all) {
  size_t kept = 0;
  for (std::unique_ptr<CachedGroup>& g : cached_groups_) {
    // A plan that changed while the group waited (evicted, a member
    // renegotiated) no longer describes it: PlanFor checks it again.
    if (!all && now - g->since < report_cached_after_s_ && PlanFor(g->submission) != nullptr) {
      cached_groups_[kept++] = std::move(g);
      continue;
    }
    Add(counters_.cached_group_demotions);
    // The timeline's admission events were written when the group came.
    for (TensorEntry& e : g->submission.entries) AddPending(std::move(e), g->since);
  }
  cached_groups_.resize(kept);
}

void Engine::TakeReadyCachedGroups(const std::vector<uint64_t>& bits) {
  size_t kept = 0;
  for (std::unique_ptr<CachedGroup>& g : cached_groups_) {
    const Plan& plan = plans_.at(g->submission.group_id);  // checked by DemoteCachedGroups this cycle
    bool ready = true;
    for (const auto& [word, mask] : plan.bit_words) ready = ready && (bits[1 + word] & mask) == mask;
    if (!ready) {
      cached_groups_[kept++] = std::move(g);
      continue;
    }
    for (int slot : plan.slots) claimed_slots_[slot] = 1;
    ready_groups_.push_back(std::move(g));
  }
  cached_groups_.resize(kept);
}

bool Engine::FillCacheBits(double now, std::vector<uint64_t>* bits) {
  std::vector<int> slots(order_.size(), -1);
  const std::vector<Pending*>& entries = order_;
  std::unordered_map<uint64_t, uint32_t> group_hits;
  for (size_t i = 0; i < order_.size(); ++i) {
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
    if (!p->reported && (slots[i] < 0 || now - p->since >= report_cached_after_s_)) must_report = true;
  }
  for (const std::unique_ptr<CachedGroup>& g : cached_groups_)  // Note [Cached groups]
    for (const auto& [word, mask] : plans_.at(g->submission.group_id).bit_words) (*bits)[1 + word] |= mask;
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
    if (p->reported) continue;
    p->reported = true;
    mine.push_back(p->entry.Report());
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

StatusOr<Communicator*> Engine::GetCommunicator(const Device& device) {
  if (device.kind == DeviceKind::kCpu) return cpu_comm_.get();
  if (cuda_comm_ == nullptr) {
    // Collective: every rank reaches this through the same response.
    CommunicatorOptions options;
    options.group_size = knobs_.group_size;
    options.pipeline_chunk_bytes = knobs_.pipeline_chunk;
    options.timeout_seconds = knobs_.peer_timeout_s;
    options.knobs = &knobs_;  // agreed across ranks at Init
    StatusOr<std::unique_ptr<Communicator>> c =
        CreateCommunicator(MPI_Comm_c2f(comm_), device, options);
    if (!c.ok()) return c.status().WithContext("creating the communicator for " + device.ToString());
    cuda_comm_ = c.consume();
    cuda_comm_for_abort_ = cuda_comm_.get();
    cuda_ordinal_ = device.ordinal;
#ifdef NVGROUP_WITH_CUDA
    completion_events_ = std::make_unique<CompletionEvents>(device.ordinal);
#endif
    finalizer_ = std::make_unique<Finalizer>();
    finalizer_thread_ = finalizer_->thread_id();
  }
  if (device.ordinal != cuda_ordinal_)
    return Status::Unimplemented("nvgroup_tf drives one CUDA device per process: this rank uses " +
                                 Device::Cuda(cuda_ordinal_).ToString() + ", not " + device.ToString());
  return cuda_comm_.get();
}

void Engine::CallDone(TensorEntry* e, const Status& status) {
  DoneCallback done = std::move(e->request.done);
  e->request.done = nullptr;  // a moved-from std::function is unspecified; this marks "completed"
  try {
    done(status);
  } catch (...) {  // a callback must not take the loop down
    NVG_LOG(kError) << "the done callback of '" << e->request.name << "' threw; ignored";
  }
}

void Engine::Complete(TensorEntry* e, const Status& status) {
  queue_.Finish(e->request.name);
  CallDone(e, status);
}

void Engine::CompleteAfterStream(Communicator* comm, const std::vector<TensorEntry*>& done) {
  if (comm->device().kind == DeviceKind::kCpu) {
    const double start = MonotonicSeconds();
    queue_.Finish(done.data(), done.size());  // one lock for the bucket
    for (TensorEntry* e : done) CallDone(e, Status::Ok());
    AddSeconds(counters_.complete_ns, MonotonicSeconds() - start);
    return;
  }
  // One event per bucket, recorded after its copy out: the finalizer waits for
  // this bucket's work only, not for the buckets enqueued after it. Without an
  // event (creation failed) it falls back to draining the whole stream.
  void* event = nullptr;
#ifdef NVGROUP_WITH_CUDA
  if (completion_events_ != nullptr) {
    StatusOr<void*> e = completion_events_->Acquire();
    if (e.ok() && comm->RecordEvent(e.value(), nullptr).ok()) {
      event = e.value();
    } else if (e.ok()) {
      completion_events_->Release(e.value());
    }
  }
#endif
  // The Pending objects are owned by the Work list, which dies at the end of
  // the cycle: move the callbacks into the job. A request with
  // completion_event_ready hears of the event now; its name leaves the
  // in-flight set first, so the adapter may resubmit it at once (its `done`
  // below then must not Finish the name again).
  struct Callback {
    std::string name;
    DoneCallback done;
    bool finished_early = false;
  };
  // The entries die with the cycle and nothing reads their names after this
  // (the timeline's events are written): the names move, not copy.
  std::vector<Callback> callbacks;
  callbacks.reserve(done.size());
  bool any_early = false;
  for (TensorEntry* e : done) {
    CollectiveRequest& q = e->request;
    Callback c{std::move(q.name), std::move(q.done), false};
    q.done = nullptr;
    if (event != nullptr && q.completion_event_ready) {
      queue_.Finish(c.name);
      c.finished_early = any_early = true;
      try {
        q.completion_event_ready(event);
      } catch (...) {
        NVG_LOG(kError) << "the completion_event_ready callback of '" << c.name << "' threw; ignored";
      }
    }
    callbacks.push_back(std::move(c));
  }
  finalizer_->Add([this, comm, event, any_early, callbacks = std::move(callbacks)]() mutable {
    // Orders `done` after the device finished the bucket's copy out.
    Status s = event != nullptr ? comm->WaitRecordedEvent(event) : comm->Synchronize(nullptr);
#ifdef NVGROUP_WITH_CUDA
    if (event != nullptr) completion_events_->Release(event);
#endif
    // An adapter may already have let its stream run on the event: a
    // device-side failure must then stop every later collective.
    if (!s.ok() && any_early) Abort(s);
    for (Callback& c : callbacks) {
      if (!c.finished_early) queue_.Finish(c.name);
      try {
        c.done(s);
      } catch (...) {
        NVG_LOG(kError) << "the done callback of '" << c.name << "' threw; ignored";
      }
    }
  });
}

Status Engine::RunAllreduceBucket(const FusionBucket& bucket, const BucketMember* members) {
  const size_t n = bucket.offsets.size();
  const ResponseMessage& first = *members[0].response;
  const Device device = members[0].entry->request.device;
  StatusOr<Communicator*> comm_or = GetCommunicator(device);
  if (!comm_or.ok()) return comm_or.status();
  Communicator* comm = comm_or.value();
  if (bucket.bytes > comm->registered_capacity()) {
    // Larger than this device's registered buffer: one tensor at a time, the
    // communicator cutting each into pieces. The arithmetic is the fused
    // path's (same scaled copies, same fold), so the bits are too.
    for (size_t k = 0; k < n; ++k) NVG_RETURN_IF_ERROR(RunAllreduceAlone(members[k]));
    return Status::Ok();
  }
  // Every other bucket, one tensor or many, takes this path (on the GPU no
  // pointer checks; no extra scaling pass for a lone tensor).
  const size_t element = DataTypeSize(first.dtype);
  // Average of floats is a sum with the division folded into the copy out;
  // integers use the communicator's own (truncating) average unless scale
  // factors are given (then Horovod's: sum, then * postscale / size).
  ReduceOp op = first.op;
  double postscale = first.postscale_factor;
  if (op == ReduceOp::kAverage && AverageByPostscale(first)) {
    op = ReduceOp::kSum;
    postscale /= size_;
  }
  Add(counters_.buckets);
  Add(counters_.bucket_tensors, n);
  BucketScratch& b = bucket_scratch_;
  b.members.clear();
  b.done.clear();
  b.events.clear();
  // Distinct ready events of the bucket (a framework records one event for a
  // whole step's gradients, so usually one).
  for (size_t k = 0; k < n; ++k) {
    TensorEntry* p = members[k].entry;
    const size_t count = ResponseBytes(*members[k].response) / element;
    b.members.push_back({p->request.input, p->request.output, count, bucket.offsets[k]});
    b.done.push_back(p);
    void* e = p->request.ready_event;
    if (e != nullptr && std::find(b.events.begin(), b.events.end(), e) == b.events.end()) b.events.push_back(e);
  }
  // Orders the copy-in after the framework produced the inputs (GPU-side
  // waits, one per distinct event).
  for (void* e : b.events) NVG_RETURN_IF_ERROR(comm->WaitEvent(e, nullptr));
  Add(counters_.ready_event_waits, b.events.size());
  // The timeline's per-tensor phases, from the communicator's phase reports.
  struct Marker {
    Timeline* timeline;
    const std::vector<TensorEntry*>* done;
  } marker{&timeline_, &b.done};
  Communicator::PhaseObserver observer;
  if (timeline_.enabled()) {
    observer.context = &marker;
    observer.mark = [](void* context, Communicator::FusedPhase phase, bool begin) {
      static const char* const kNames[] = {"FUSION_COPY_IN", "ALLREDUCE", "FUSION_COPY_OUT"};
      const Marker& m = *static_cast<const Marker*>(context);
      const char* name = kNames[static_cast<int>(phase)];
      const double t = MonotonicSeconds();
      for (TensorEntry* p : *m.done)
        begin ? m.timeline->Begin(p->request.name, name, t) : m.timeline->End(p->request.name, name, t);
    };
  }
  // The communicator fuses the members (Communicator::FusedAllreduce): the
  // prescale rides on the copy in, the postscale (and an Average's division)
  // on the copy out, and it skips the registered buffer where no peer reads it.
  if (bucket.bytes > 0)
    NVG_RETURN_IF_ERROR(comm->FusedAllreduce(b.members.data(), b.members.size(), bucket.bytes, first.dtype, op,
                                             first.prescale_factor, postscale, nullptr, observer));
  CompleteAfterStream(comm, b.done);
  return Status::Ok();
}

Status Engine::RunAllreduceAlone(const BucketMember& m) {
  const ResponseMessage& r = *m.response;
  const CollectiveRequest& q = m.entry->request;
  StatusOr<Communicator*> comm_or = GetCommunicator(q.device);
  if (!comm_or.ok()) return comm_or.status();
  Communicator* comm = comm_or.value();
  const size_t count = static_cast<size_t>(NumElements(r.shape));
  ReduceOp op = r.op;
  double postscale = r.postscale_factor;
  if (op == ReduceOp::kAverage && AverageByPostscale(r)) {
    op = ReduceOp::kSum;
    postscale /= size_;
  }
  Add(counters_.buckets);
  Add(counters_.bucket_tensors);
  NVG_RETURN_IF_ERROR(comm->WaitEvent(q.ready_event, nullptr));
  if (timeline_.enabled()) timeline_.Begin(q.name, "ALLREDUCE", MonotonicSeconds());
  const void* source = q.input;
  if (r.prescale_factor != 1.0) {  // scale into the output, then reduce in place
    Communicator::CopySpec pre{q.input, q.output, count};
    NVG_RETURN_IF_ERROR(comm->BatchedScaledCopy(&pre, 1, r.dtype, r.prescale_factor, nullptr));
    source = q.output;
  }
  NVG_RETURN_IF_ERROR(comm->Allreduce(source, q.output, count, r.dtype, op, nullptr));
  if (postscale != 1.0) {
    Communicator::CopySpec post{q.output, q.output, count};
    NVG_RETURN_IF_ERROR(comm->BatchedScaledCopy(&post, 1, r.dtype, postscale, nullptr));
  }
  if (timeline_.enabled()) timeline_.End(q.name, "ALLREDUCE", MonotonicSeconds());
  CompleteAfterStream(comm, {m.entry});
  return Status::Ok();
}

Status Engine::RunAllgather(Work* w) {
  const ResponseMessage& r = *w->response;
  const CollectiveRequest& q = w->pending->entry.request;
  StatusOr<Communicator*> comm_or = GetCommunicator(q.device);
  if (!comm_or.ok()) return comm_or.status();
  Communicator* comm = comm_or.value();
  std::vector<int64_t> out_shape = q.shape;
  out_shape[0] = 0;
  for (int64_t d : r.first_dims) out_shape[0] += d;
  std::vector<int64_t> row(q.shape.begin() + 1, q.shape.end());
  const size_t row_bytes = static_cast<size_t>(NumElements(row)) * DataTypeSize(r.dtype);
  std::vector<size_t> bytes_per_rank;
  for (int64_t d : r.first_dims) bytes_per_rank.push_back(static_cast<size_t>(d) * row_bytes);

  void* out = nullptr;
  Status alloc = q.allocate_output(out_shape, &out);
  // A host allocation failure on this rank must not leave the others inside
  // Allgatherv: take part with a scratch buffer, then report the failure.
  std::vector<char> scratch;
  if (!alloc.ok() || (out == nullptr && NumElements(out_shape) > 0)) {
    if (alloc.ok()) alloc = Status::Internal("allocate_output returned no buffer");
    if (q.device.kind != DeviceKind::kCpu) return alloc.WithContext("allocating the allgather output");
    scratch.resize(static_cast<size_t>(NumElements(out_shape)) * DataTypeSize(r.dtype));
    out = scratch.data();
  }
  NVG_RETURN_IF_ERROR(comm->WaitEvent(q.ready_event, nullptr));
  if (timeline_.enabled()) timeline_.Begin(q.name, "ALLGATHER", MonotonicSeconds());
  NVG_RETURN_IF_ERROR(comm->Allgatherv(q.input, out, bytes_per_rank, nullptr));
  if (timeline_.enabled()) timeline_.End(q.name, "ALLGATHER", MonotonicSeconds());
  if (!scratch.empty() || !alloc.ok()) {
    Complete(w->pending.get(), alloc.WithContext("allocating the allgather output"));
    return Status::Ok();
  }
  CompleteAfterStream(comm, {&w->pending->entry});
  return Status::Ok();
}

Status Engine::RunBroadcast(Work* w) {
  const ResponseMessage& r = *w->response;
  const CollectiveRequest& q = w->pending->entry.request;
  StatusOr<Communicator*> comm_or = GetCommunicator(q.device);
  if (!comm_or.ok()) return comm_or.status();
  Communicator* comm = comm_or.value();
  const size_t bytes = static_cast<size_t>(NumElements(r.shape)) * DataTypeSize(r.dtype);
  NVG_RETURN_IF_ERROR(comm->WaitEvent(q.ready_event, nullptr));
  if (timeline_.enabled()) timeline_.Begin(q.name, "BROADCAST", MonotonicSeconds());
  if (rank_ == r.root_rank && q.input != q.output && bytes > 0) {
    Communicator::CopySpec copy{q.input, q.output, bytes};
    NVG_RETURN_IF_ERROR(comm->BatchedScaledCopy(&copy, 1, DataType::kUint8, 1.0, nullptr));
  }
  if (bytes > 0) NVG_RETURN_IF_ERROR(comm->Broadcast(q.output, bytes, r.root_rank, nullptr));
  if (timeline_.enabled()) timeline_.End(q.name, "BROADCAST", MonotonicSeconds());
  CompleteAfterStream(comm, {&w->pending->entry});
  return Status::Ok();
}

Status Engine::RunBucket(const FusionBucket& bucket, std::vector<Work>* work) {
  Work& first = (*work)[bucket.responses[0]];
  if (!first.response->ok()) {  // error responses are buckets of their own
    if (first.pending) Complete(first.pending.get(), Status(first.response->error_code, first.response->error_message));
    return Status::Ok();
  }
  Status s;
  switch (first.response->type) {
    case CollectiveType::kAllreduce: {
      plan_members_.clear();
      for (size_t i : bucket.responses) plan_members_.push_back({(*work)[i].response, &(*work)[i].pending->entry});
      return RunMembers(bucket, plan_members_.data());
    }
    case CollectiveType::kAllgather: s = RunAllgather(&first); break;
    case CollectiveType::kBroadcast: s = RunBroadcast(&first); break;
    case CollectiveType::kReducescatter: s = RunReducescatter(&first); break;
    case CollectiveType::kAlltoall: s = RunAlltoall(&first); break;
    case CollectiveType::kJoin: s = RunJoin(&first); break;
  }
  if (s.ok()) return s;
  std::vector<TensorEntry*> entries;
  for (size_t i : bucket.responses)
    if ((*work)[i].pending != nullptr) entries.push_back(&(*work)[i].pending->entry);
  return FailEntries(s, entries.data(), entries.size());
}

Status Engine::RunMembers(const FusionBucket& bucket, const BucketMember* members) {
  Status s = RunAllreduceBucket(bucket, members);
  if (s.ok()) return s;
  std::vector<TensorEntry*> entries;
  for (size_t k = 0; k < bucket.offsets.size(); ++k) entries.push_back(members[k].entry);
  return FailEntries(s, entries.data(), entries.size());
}

Status Engine::FailEntries(const Status& status, TensorEntry* const* entries, size_t n) {
  if (status.ok()) return status;
  const Status s = Cause(status);
  // The same call failed on every rank (same arguments, same order); fail the
  // bucket's requests. A lost or aborted peer ends the loop.
  for (size_t i = 0; i < n; ++i)
    if (entries[i]->request.done) Complete(entries[i], s);
  if (s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kAborted) return s;
  return Status::Ok();
}

Status Engine::RunPlans(std::vector<Work>* work, size_t cache_hits, std::vector<bool>* done) {
  if (plans_.empty()) return Status::Ok();
  plan_runs_.clear();
  for (const std::unique_ptr<CachedGroup>& g : ready_groups_) {
    Plan& plan = plans_.at(g->submission.group_id);
    plan_runs_.push_back({plan.first_slot, &plan, g.get()});
  }
  // The cache hits of whole groups (TakeCacheHits takes groups whole), in
  // order of their first member.
  std::vector<uint64_t> groups;
  for (size_t i = 0; i < cache_hits; ++i) {
    const ResponseMessage& r = *(*work)[i].response;
    if (r.group_id == 0 || (*done)[i]) continue;
    if (std::find(groups.begin(), groups.end(), r.group_id) == groups.end()) groups.push_back(r.group_id);
  }
  if (slot_to_work_.size() != static_cast<size_t>(cache_.capacity())) slot_to_work_.assign(cache_.capacity(), 0);
  for (size_t i = 0; i < cache_hits; ++i)
    if ((*work)[i].slot >= 0) slot_to_work_[(*work)[i].slot] = i;
  for (uint64_t group : groups) {
    auto it = plans_.find(group);
    if (it == plans_.end()) continue;
    Plan& plan = it->second;
    bool valid = PlanMatchesCache(plan);
    for (size_t k = 0; k < plan.slots.size() && valid; ++k) {
      // The slot is one of this cycle's hits (the hits hold the group whole);
      // entries of slots not hit this cycle are stale, hence both checks.
      const int slot = plan.slots[k];
      valid = slot_to_work_[slot] < cache_hits && (*work)[slot_to_work_[slot]].slot == slot;
    }
    if (!valid || plan.slots.size() != (*work)[slot_to_work_[plan.slots[0]]].response->group_size) {
      plans_digest_ ^= plan.id;  // a member changed: the group replans after it runs
      plans_.erase(it);
      continue;
    }
    plan_runs_.push_back({plan.first_slot, &plan, nullptr});
  }
  // Every rank runs the same plans in the same order (lowest member slot
  // first), whether it admitted a group whole or entry by entry.
  std::sort(plan_runs_.begin(), plan_runs_.end(),
            [](const PlanRun& a, const PlanRun& b) { return a.first_slot < b.first_slot; });
  for (const PlanRun& run : plan_runs_) {
    Plan& plan = *run.plan;
    plan.last_use = ++plan_clock_;
    Add(counters_.plan_launches);
    if (run.group != nullptr) Add(counters_.cached_group_runs);
    for (const FusionBucket& b : plan.buckets) {
      plan_members_.clear();
      for (size_t k : b.responses) {
        if (run.group != nullptr) {
          plan_members_.push_back({&cache_.Get(plan.slots[k]), &run.group->submission.entries[plan.entry_of[k]]});
        } else {
          const size_t i = slot_to_work_[plan.slots[k]];
          (*done)[i] = true;
          plan_members_.push_back({(*work)[i].response, &(*work)[i].pending->entry});
        }
      }
      NVG_RETURN_IF_ERROR(RunMembers(b, plan_members_.data()));
    }
  }
  return Status::Ok();
}

bool Engine::PlanMatchesCache(const Plan& plan) const {
  for (size_t k = 0; k < plan.slots.size(); ++k)
    if (cache_.generation(plan.slots[k]) != plan.generations[k]) return false;
  return !plan.slots.empty();
}

void Engine::MakePlans(const std::vector<Work>& work) {
  if (cache_.capacity() == 0) return;
  std::unordered_map<uint64_t, std::vector<size_t>> members;  // group id -> work indices
  std::vector<uint64_t> order;
  uint64_t kept = 0;  // the last group found with a valid plan (members are adjacent)
  for (size_t i = 0; i < work.size(); ++i) {
    const ResponseMessage& r = *work[i].response;
    if (r.group_id == 0 || (r.group_id == kept && kept != 0)) continue;
    auto existing = plans_.find(r.group_id);
    if (existing != plans_.end()) {
      if (PlanMatchesCache(existing->second)) {  // checked once per group, not per member
        kept = r.group_id;
        continue;
      }
      plans_digest_ ^= existing->second.id;  // a member was renegotiated: replan below
      plans_.erase(existing);
    }
    auto [it, inserted] = members.try_emplace(r.group_id);
    if (inserted) order.push_back(r.group_id);
    it->second.push_back(i);
  }
  const size_t threshold = std::min(knobs_.fusion_threshold, cpu_comm_->registered_capacity());
  for (uint64_t group : order) {
    const std::vector<size_t>& idx = members[group];
    Plan plan;
    std::vector<ResponseMessage> responses;
    bool ok = idx.size() == work[idx[0]].response->group_size;
    for (size_t i : idx) {
      const ResponseMessage& r = *work[i].response;
      const int slot = work[i].slot >= 0 ? work[i].slot : cache_.Find(r.name);
      ok = ok && r.ok() && r.type == CollectiveType::kAllreduce && slot >= 0 &&
           ResponseDigest(cache_.Get(slot)) == ResponseDigest(r);
      if (!ok) break;
      plan.slots.push_back(slot);
      plan.generations.push_back(cache_.generation(slot));
      responses.push_back(r);
    }
    if (!ok) continue;
    plan.buckets = PlanFusion(responses, threshold);
    // This rank's own: how to admit the group whole next time (Note [Cached
    // groups]); a member without its own entry (a join's stand-in) leaves
    // entry_of empty, so the group is always admitted entry by entry.
    plan.first_slot = *std::min_element(plan.slots.begin(), plan.slots.end());
    for (size_t i : idx) {
      const Pending* p = work[i].pending.get();
      if (p == nullptr || joined_) {
        plan.entry_of.clear();
        break;
      }
      plan.entry_of.push_back(p->entry.group_index);
    }
    std::vector<int> sorted = plan.slots;
    std::sort(sorted.begin(), sorted.end());
    for (int slot : sorted) {
      if (plan.bit_words.empty() || plan.bit_words.back().first != slot / 64) plan.bit_words.push_back({slot / 64, 0});
      plan.bit_words.back().second |= uint64_t{1} << (slot % 64);
    }
    uint64_t h = group;
    auto mix = [&h](uint64_t v) {
      h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);  // boost::hash_combine's constant
    };
    for (size_t k = 0; k < plan.slots.size(); ++k) {
      mix(static_cast<uint64_t>(plan.slots[k]));
      mix(plan.generations[k]);
    }
    for (const FusionBucket& b : plan.buckets) {
      mix(b.responses.size());
      for (size_t k = 0; k < b.responses.size(); ++k) {
        mix(b.responses[k]);
        mix(b.offsets[k]);
      }
    }
    plan.id = h;
    if (plans_.size() >= kMaxPlans) {  // evict the least recently used (unique clock values)
      auto lru = plans_.begin();
      for (auto p = plans_.begin(); p != plans_.end(); ++p)
        if (p->second.last_use < lru->second.last_use) lru = p;
      plans_digest_ ^= lru->second.id;
      plans_.erase(lru);
    }
    plan.last_use = ++plan_clock_;
    plans_digest_ ^= plan.id;
    plans_.emplace(group, std::move(plan));
  }
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
#ifdef __linux__
  // Sleeps of this thread (the admission gap, the cycle wait, WaitMpi's
  // backoff) end when asked, not up to 50 us later (the default timer slack).
  (void)prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
#endif
  NameThisThread("nvg-loop");
  Status exit_status;
  bool shut_down = false;
  const double cycle_s = knobs_.cycle_time_ms / 1000.0;
  int quick_cycles = kQuickCycles;  // Note [Leftovers start the next cycle]
  std::vector<Submission> fresh;
  for (;; ++cycle_) {
    if (abort_) break;  // exit_status is replaced by the abort reason below
    fresh.clear();
    bool shutdown_requested = false;
    const bool leftovers = !pending_.empty() && quick_cycles > 0;
    // Note [An idle rank sleeps] (idle_wait.h).
    const bool nothing_in_flight = pending_.empty() && cached_groups_.empty() && !joined_;
    const double wait_s = leftovers ? std::min(kLeftoverWaitS, cycle_s) : IdleCycleWaitSeconds(cycle_s, nothing_in_flight);
    AddSeconds(counters_.idle_ns, queue_.WaitAndPop(wait_s,
                                                    std::min(kAdmissionGapS, cycle_s), cycle_s, &fresh,
                                                    &shutdown_requested));
    if (leftovers) Add(counters_.quick_cycles);
    Add(counters_.cycles);
    if (liveness_) liveness_->SetProgress(cycle_);
    if (timeline_command_pending_.load(std::memory_order_acquire)) ApplyTimelineCommand();
    const double now = MonotonicSeconds();
    for (Submission& s : fresh) AdmitSubmission(std::move(s), now);
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
      // Note [An idle rank sleeps]: an idle rank's agreement waits for its peers' cycle.
      exit_status = WaitMpi(&req, "the agreement allreduce", knobs_.peer_timeout_s, abort_, static_cast<int64_t>(cycle_),
                            /*sleep_at_once=*/nothing_in_flight && fresh.empty() && !shutdown_requested);
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
    quick_cycles = work.empty() && ready_groups_.empty() ? quick_cycles - 1 : kQuickCycles;
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
        std::string ranks;
        for (int r : silent.value()) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
        exit_status = Status::Unavailable(exit_status.message() + "; ranks [" + ranks +
                                          "] did not answer a liveness probe");
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
  {
    std::lock_guard<std::mutex> lock(timeline_mu_);
    timeline_loop_gone_ = true;
    if (timeline_command_pending_) {
      timeline_command_pending_ = false;
      timeline_answer_ = Status::FailedPrecondition("the engine's background loop has stopped");
      timeline_answered_ = true;
    }
  }
  timeline_cv_.notify_all();
  {
    std::lock_guard<std::mutex> lock(exit_mu_);
    loop_exited_ = true;
  }
  exit_cv_.notify_all();
}

// ---- Run-time timeline control ------------------------------------------------

Status Engine::ControlTimeline(bool start, const std::string& path, bool mark_cycles) {
  if (rank_ != 0) return Status::Ok();  // rank 0 writes the timeline, as with NVGROUP_TIMELINE
  const char* what = start ? "start_timeline" : "stop_timeline";
  std::lock_guard<std::mutex> one_at_a_time(timeline_call_mu_);
  std::unique_lock<std::mutex> lock(timeline_mu_);
  if (timeline_loop_gone_)
    return Status::FailedPrecondition(std::string(what) + ": the engine's background loop has stopped");
  timeline_command_ = TimelineCommand{start, path, mark_cycles};
  timeline_answered_ = false;
  timeline_command_pending_.store(true, std::memory_order_release);
  if (!timeline_cv_.wait_for(lock, std::chrono::duration<double>(knobs_.peer_timeout_s + 1.0),
                             [this] { return timeline_answered_; })) {
    timeline_command_pending_ = false;
    return Status::Unavailable(std::string(what) + ": the background loop did not take the change within " +
                               std::to_string(knobs_.peer_timeout_s) + " s (NVGROUP_TIMEOUT)");
  }
  return timeline_answer_.ok() ? timeline_answer_ : timeline_answer_.WithContext(what);
}

void Engine::ApplyTimelineCommand() {
  std::lock_guard<std::mutex> lock(timeline_mu_);
  if (!timeline_command_pending_) return;  // the caller gave up meanwhile
  timeline_command_pending_ = false;
  if (timeline_command_.start) {
    timeline_answer_ = timeline_.Open(timeline_command_.path, MonotonicSeconds());
    mark_cycles_ = timeline_answer_.ok() && timeline_command_.mark_cycles;
  } else {
    timeline_.Close();
    mark_cycles_ = false;
    timeline_answer_ = Status::Ok();
  }
  timeline_answered_ = true;
  timeline_cv_.notify_all();
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
  if (liveness_) liveness_->Close();  // BYE: this rank leaves on purpose, not a death
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
  auto get = [](const std::atomic<uint64_t>& c) { return c.load(std::memory_order_relaxed); };
  auto seconds = [&](const std::atomic<uint64_t>& c) { return static_cast<double>(get(c)) * 1e-9; };
  EngineStats st;
  st.cycles = get(counters_.cycles);
  st.negotiation_rounds = get(counters_.negotiation_rounds);
  st.cached_responses = get(counters_.cached_responses);
  st.negotiated_responses = get(counters_.negotiated_responses);
  st.plan_launches = get(counters_.plan_launches);
  st.buckets = get(counters_.buckets);
  st.bucket_tensors = get(counters_.bucket_tensors);
  st.ready_event_waits = get(counters_.ready_event_waits);
  st.agreement_allreduces = get(counters_.agreement_allreduces);
  st.quick_cycles = get(counters_.quick_cycles);
  st.queue_entries = get(counters_.queue_entries);
  st.admitted_entries = get(counters_.admitted_entries);
  st.cached_group_admissions = get(counters_.cached_group_admissions);
  st.cached_group_runs = get(counters_.cached_group_runs);
  st.cached_group_demotions = get(counters_.cached_group_demotions);
  st.groups_not_batched = queue_.groups_not_batched();
  st.admit_s = seconds(counters_.admit_ns);
  st.lookup_s = seconds(counters_.lookup_ns);
  st.complete_s = seconds(counters_.complete_ns);
  st.idle_s = seconds(counters_.idle_ns);
  st.agree_s = seconds(counters_.agree_ns);
  st.negotiate_s = seconds(counters_.negotiate_ns);
  st.execute_s = seconds(counters_.execute_ns);
  return st;
}

bool Engine::OnEngineThread() const {
  const std::thread::id me = std::this_thread::get_id();
  return me == thread_.get_id() || me == finalizer_thread_.load();
}

}  // namespace nvgroup
