// The engine: Init/Shutdown/Enqueue (nvgroup/engine.h) and the background loop.
//
// How it works (Horovod's pipeline; see STYLE.md §A.4):
//   1. Enqueue validates the request on this rank and puts a self-contained
//      TensorEntry into the TensorQueue, waking the background thread.
//   2. Each cycle the background loop takes the queued entries, then all ranks
//      agree on what is ready everywhere: first through the response cache
//      (one bitwise-AND allreduce, see response_cache.h), then, only when some
//      rank has something rank 0 has not seen, through rank 0 (gather the
//      request lists, Coordinator builds responses, broadcast the response list).
//   3. The cycle's responses (cache hits in slot order, then rank 0's list) are
//      planned into fusion buckets (fusion.h) and run through a Communicator.
//   4. Each request's `done` runs once, with OK or the error.
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
//  * Shutdown is agreed: a rank that wants to stop clears a bit in the cycle's
//    allreduce, and all ranks leave the loop after that same cycle, so no rank
//    is left inside a collective.
#include "nvgroup/engine.h"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "common/checks.h"
#include "common/env.h"
#include "common/logging.h"
#include "engine/controller.h"
#include "engine/fusion.h"
#include "engine/response_cache.h"
#include "engine/stall_inspector.h"
#include "engine/tensor_queue.h"
#include "engine/timeline.h"
#include "engine/wire_format.h"
#include "nvgroup/communicator.h"

namespace nvgroup {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Init's own collectives wait at least this long: ranks reach hvd.init() after
// importing TensorFlow, which takes tens of seconds on a loaded host, so the
// peer timeout (meant for a running job) would be too eager here.
constexpr double kMinInitTimeoutS = 120.0;

// Polls a non-blocking MPI operation until it completes, `abort` is set or
// `timeout_s` passes. Spins (yielding) briefly for latency, then sleeps in
// growing steps so oversubscribed hosts are not starved.
Status WaitMpi(MPI_Request* request, const std::string& what, double timeout_s,
               const std::atomic<bool>& abort) {
  // 64 yields cover a sub-10 us round trip on one host (ANCHORS §4: 23 us for
  // a plain MPI op over 2 ranks); 200 us bounds the added latency once sleeping.
  constexpr int kSpinIterations = 64;
  constexpr int kMaxSleepUs = 200;
  const double deadline = Now() + timeout_s;
  int sleep_us = 1;
  for (int i = 0;; ++i) {
    int done = 0;
    NVG_MPI_CHECK(MPI_Test(request, &done, MPI_STATUS_IGNORE));
    if (done) return Status::Ok();
    if (abort.load(std::memory_order_relaxed))
      return Status::Aborted("nvgroup_tf was aborted while waiting in " + what);
    if (Now() > deadline)
      return Status::Unavailable(
          "no answer from the other ranks for " + std::to_string(static_cast<int>(timeout_s)) +
          " s in " + what + " (NVGROUP_TIMEOUT): a rank is hung, has exited, or stopped calling "
          "nvgroup_tf; the engine has stopped");
    if (i < kSpinIterations) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      sleep_us = std::min(kMaxSleepUs, sleep_us * 2);
    }
  }
}

uint64_t GroupId(const std::vector<CollectiveRequest>& requests) {
  // FNV-1a 64 over the sorted names, '\0'-separated: the same on every rank
  // that submits the same set of names, whatever their order.
  std::vector<std::string> names;
  for (const CollectiveRequest& r : requests) names.push_back(r.name);
  std::sort(names.begin(), names.end());
  uint64_t h = 1469598103934665603ull;
  for (const std::string& n : names) {
    for (unsigned char c : n) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0) * 1099511628211ull;
  }
  return h == 0 ? 1 : h;  // 0 means "not grouped"
}

// Runs `done` callbacks of CUDA requests after their stream work completes, on
// its own thread so the background loop keeps negotiating meanwhile.
class Finalizer {
 public:
  using Job = std::function<void()>;
  Finalizer() : thread_([this] { Run(); }) {}
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

class Engine {
 public:
  Engine(const Knobs& knobs, MPI_Comm comm, int rank, int size, std::unique_ptr<Communicator> cpu)
      : knobs_(knobs),
        comm_(comm),
        rank_(rank),
        size_(size),
        cpu_comm_(std::move(cpu)),
        topology_(cpu_comm_->topology()),
        cache_(knobs.cache_capacity),
        cache_words_((knobs.cache_capacity + 63) / 64),
        stall_(size, knobs.stall_warning_s, knobs.stall_shutdown_s),
        coordinator_(size, &stall_) {
    // See Note [Reporting stuck cache hits].
    report_cached_after_s_ = 1.0;
    if (knobs.stall_warning_s > 0) report_cached_after_s_ = std::min(report_cached_after_s_, knobs.stall_warning_s / 2);
    if (knobs.stall_shutdown_s > 0) report_cached_after_s_ = std::min(report_cached_after_s_, knobs.stall_shutdown_s / 2);
    if (rank_ == 0 && !knobs.timeline_path.empty()) {
      Status s = timeline_.Open(knobs.timeline_path, Now());
      if (!s.ok()) NVG_LOG(kWarning) << s.message() << "; continuing without a timeline";
    }
    thread_ = std::thread([this] { Loop(); });
  }

  ~Engine() { Stop(); }

  const Topology& topology() const { return topology_; }
  int size() const { return size_; }
  Status Submit(std::vector<TensorEntry> entries) { return queue_.Push(std::move(entries)); }
  Status Stop();

 private:
  struct Pending {
    TensorEntry entry;
    bool reported = false;  // sent to rank 0 in a negotiation round
    double since = 0;       // when the loop took it from the queue
  };
  // A response with this rank's entry (absent for error responses about names
  // this rank never submitted).
  struct Work {
    ResponseMessage response;
    std::unique_ptr<Pending> pending;
  };

  void Loop();
  void Admit(TensorEntry entry, double now);
  bool FillCacheBits(double now, std::vector<uint64_t>* bits);
  std::vector<Work> TakeCacheHits(const std::vector<uint64_t>& bits);
  Status Negotiate(double now, std::vector<Work>* work);
  // The first `cache_hits` entries of `work` came from the response cache.
  Status Execute(std::vector<Work>* work, size_t cache_hits);
  Status RunAllreduceBucket(const FusionBucket& bucket, std::vector<Work>* work);
  Status RunAllreduceAlone(Work* w);
  Status RunAllgather(Work* w);
  Status RunBroadcast(Work* w);
  StatusOr<Communicator*> GetCommunicator(const Device& device);
  void Complete(Pending* p, const Status& status);
  // CPU: completes at once. CUDA: after the communicator's stream drains.
  void CompleteAfterStream(Communicator* comm, std::vector<Pending*> done);
  Status Wait(MPI_Request* request, const std::string& what) {
    return WaitMpi(request, what, knobs_.peer_timeout_s, abort_);
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

  TensorQueue queue_;
  std::atomic<bool> abort_{false};
  std::atomic<bool> loop_exited_{false};
  std::mutex exit_mu_;
  std::condition_variable exit_cv_;
  bool mpi_broken_ = false;  // a negotiation request never completed: leave comm_ alone
  bool stopped_ = false;

  // Background-thread state.
  std::unordered_map<std::string, std::unique_ptr<Pending>> pending_;
  std::vector<std::string> order_;  // pending_ names, oldest first
  ResponseCache cache_;
  const int cache_words_;
  double report_cached_after_s_;
  StallInspector stall_;      // rank 0
  Coordinator coordinator_;   // rank 0
  std::vector<ResponseMessage> stalled_;  // rank 0: stall errors for the next round
  Timeline timeline_;         // rank 0
  uint64_t cycle_ = 0;

  std::thread thread_;  // last: starts after everything it uses exists
};

// Note [Reporting stuck cache hits]
// A cached request only sets its bit; rank 0 hears of it only if a negotiation
// round happens. If it is not ready on every rank within report_cached_after_s_
// (1 s, or half the stall warning/shutdown time when shorter), this rank forces
// a round and reports it, so the stall inspector can name the missing ranks.
// Reporting does not stop it from completing through the cache later: rank 0
// then forgets its report (Coordinator::Forget).

void Engine::Admit(TensorEntry entry, double now) {
  if (timeline_.enabled()) {
    timeline_.Begin(entry.request.name, "QUEUE", entry.enqueue_time);
    timeline_.End(entry.request.name, "QUEUE", now);
    timeline_.Begin(entry.request.name, "NEGOTIATE", now);
  }
  auto p = std::make_unique<Pending>();
  p->since = now;
  std::string name = entry.request.name;
  p->entry = std::move(entry);
  order_.push_back(name);
  pending_[name] = std::move(p);
}

bool Engine::FillCacheBits(double now, std::vector<uint64_t>* bits) {
  std::vector<int> slots(order_.size(), -1);
  std::unordered_map<uint64_t, uint32_t> group_hits;
  for (size_t i = 0; i < order_.size(); ++i) {
    const RequestMessage& m = pending_[order_[i]]->entry.message;
    int slot = cache_.Find(m.name);
    if (slot >= 0 && RequestMatchesResponse(m, cache_.Get(slot), rank_)) {
      slots[i] = slot;
      if (m.group_id != 0) ++group_hits[m.group_id];
    }
  }
  bool must_report = false;
  for (size_t i = 0; i < order_.size(); ++i) {
    Pending* p = pending_[order_[i]].get();
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
  return must_report;
}

std::vector<Engine::Work> Engine::TakeCacheHits(const std::vector<uint64_t>& bits) {
  std::vector<int> hits;
  std::unordered_map<uint64_t, uint32_t> group_hits;
  for (int slot = 0; slot < cache_.capacity(); ++slot) {
    if (!(bits[1 + slot / 64] >> (slot % 64) & 1)) continue;
    hits.push_back(slot);
    if (cache_.Get(slot).group_id != 0) ++group_hits[cache_.Get(slot).group_id];
  }
  std::vector<Work> work;
  for (int slot : hits) {
    const ResponseMessage& r = cache_.Get(slot);
    if (r.group_id != 0 && group_hits[r.group_id] != r.group_size) continue;
    Work w;
    w.response = r;
    auto it = pending_.find(r.name);
    w.pending = std::move(it->second);  // the bit is set only for pending names
    pending_.erase(it);
    cache_.Touch(slot);
    if (rank_ == 0) coordinator_.Forget(r.name);
    work.push_back(std::move(w));
  }
  return work;
}

Status Engine::Negotiate(double now, std::vector<Work>* work) {
  std::vector<RequestMessage> mine;
  for (const std::string& name : order_) {
    auto it = pending_.find(name);
    if (it == pending_.end() || it->second->reported) continue;
    it->second->reported = true;
    mine.push_back(it->second->entry.message);
  }
  const std::vector<uint8_t> request_bytes = EncodeRequestList(mine);
  const std::string round = "negotiation round " + std::to_string(cycle_);

  // Gather every rank's request list at rank 0: lengths, then bytes.
  int my_length = static_cast<int>(request_bytes.size());
  std::vector<int> lengths(rank_ == 0 ? size_ : 1), displs(rank_ == 0 ? size_ : 1, 0);
  MPI_Request req;
  NVG_MPI_CHECK(MPI_Igather(&my_length, 1, MPI_INT, lengths.data(), 1, MPI_INT, 0, comm_, &req));
  NVG_RETURN_IF_ERROR(Wait(&req, "the request-length gather of " + round));
  std::vector<uint8_t> gathered;
  if (rank_ == 0) {
    size_t total = 0;
    for (int r = 0; r < size_; ++r) {
      displs[r] = static_cast<int>(total);
      total += lengths[r];
    }
    gathered.resize(std::max<size_t>(total, 1));
  }
  NVG_MPI_CHECK(MPI_Igatherv(request_bytes.data(), my_length, MPI_BYTE, gathered.data(),
                             lengths.data(), displs.data(), MPI_BYTE, 0, comm_, &req));
  NVG_RETURN_IF_ERROR(Wait(&req, "the request gather of " + round));

  // Rank 0 decides; everyone receives the same response list.
  ResponseList list;
  std::vector<uint8_t> response_bytes;
  if (rank_ == 0) {
    for (int r = 0; r < size_ && list.fatal_code == StatusCode::kOk; ++r) {
      std::vector<RequestMessage> requests;
      Status s = DecodeRequestList(gathered.data() + displs[r], lengths[r], &requests);
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
    response_bytes = EncodeResponseList(list);
  }
  uint64_t response_length = response_bytes.size();
  NVG_MPI_CHECK(MPI_Ibcast(&response_length, 1, MPI_UINT64_T, 0, comm_, &req));
  NVG_RETURN_IF_ERROR(Wait(&req, "the response-length broadcast of " + round));
  if (rank_ != 0) response_bytes.resize(response_length);
  NVG_MPI_CHECK(MPI_Ibcast(response_bytes.data(), static_cast<int>(response_length), MPI_BYTE, 0, comm_, &req));
  NVG_RETURN_IF_ERROR(Wait(&req, "the response broadcast of " + round));
  if (rank_ != 0)
    NVG_RETURN_IF_ERROR(DecodeResponseList(response_bytes.data(), response_bytes.size(), &list));
  if (list.fatal_code != StatusCode::kOk) return Status(list.fatal_code, list.fatal_message);

  for (ResponseMessage& r : list.responses) {
    if (r.ok()) cache_.Put(r);
    Work w;
    auto it = pending_.find(r.name);
    if (it != pending_.end()) {
      w.pending = std::move(it->second);
      pending_.erase(it);
    } else if (r.ok()) {
      return Status::Internal("rank 0 released '" + r.name + "', which this rank never submitted");
    }
    w.response = std::move(r);
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
    StatusOr<std::unique_ptr<Communicator>> c =
        CreateCommunicator(MPI_Comm_c2f(comm_), device, options);
    if (!c.ok()) return c.status().WithContext("creating the communicator for " + device.ToString());
    cuda_comm_ = c.consume();
    cuda_ordinal_ = device.ordinal;
    finalizer_ = std::make_unique<Finalizer>();
  }
  if (device.ordinal != cuda_ordinal_)
    return Status::Unimplemented("nvgroup_tf drives one CUDA device per process: this rank uses " +
                                 Device::Cuda(cuda_ordinal_).ToString() + ", not " + device.ToString());
  return cuda_comm_.get();
}

void Engine::Complete(Pending* p, const Status& status) {
  queue_.Finish(p->entry.request.name);
  DoneCallback done = std::move(p->entry.request.done);
  try {
    done(status);
  } catch (...) {  // a callback must not take the loop down
    NVG_LOG(kError) << "the done callback of '" << p->entry.request.name << "' threw; ignored";
  }
}

void Engine::CompleteAfterStream(Communicator* comm, std::vector<Pending*> done) {
  if (comm->device().kind == DeviceKind::kCpu) {
    for (Pending* p : done) Complete(p, Status::Ok());
    return;
  }
  // The Pending objects are owned by the Work list, which dies at the end of
  // the cycle: move the callbacks into the job.
  std::vector<std::pair<std::string, DoneCallback>> callbacks;
  for (Pending* p : done) callbacks.emplace_back(p->entry.request.name, std::move(p->entry.request.done));
  finalizer_->Add([this, comm, callbacks = std::move(callbacks)]() mutable {
    Status s = comm->Synchronize(nullptr);
    for (auto& [name, cb] : callbacks) {
      queue_.Finish(name);
      try {
        cb(s);
      } catch (...) {
        NVG_LOG(kError) << "the done callback of '" << name << "' threw; ignored";
      }
    }
  });
}

Status Engine::RunAllreduceBucket(const FusionBucket& bucket, std::vector<Work>* work) {
  const ResponseMessage& first = (*work)[bucket.responses[0]].response;
  const Device device = (*work)[bucket.responses[0]].pending->entry.request.device;
  StatusOr<Communicator*> comm_or = GetCommunicator(device);
  if (!comm_or.ok()) return comm_or.status();
  Communicator* comm = comm_or.value();
  if (bucket.bytes > comm->registered_capacity()) {
    // Larger than the registered buffer (a tensor above the threshold, or a
    // CUDA buffer smaller than the CPU one): one tensor at a time, unfused.
    for (size_t i : bucket.responses) NVG_RETURN_IF_ERROR(RunAllreduceAlone(&(*work)[i]));
    return Status::Ok();
  }
  const size_t element = DataTypeSize(first.dtype);
  // Average of floats is a sum with the division folded into the copy out;
  // integers use the communicator's own (truncating) average.
  ReduceOp op = first.op;
  double postscale = first.postscale_factor;
  if (op == ReduceOp::kAverage && IsFloatingPoint(first.dtype)) {
    op = ReduceOp::kSum;
    postscale /= size_;
  }
  char* buffer = static_cast<char*>(comm->registered_buffer());
  std::vector<Communicator::CopySpec> in, out;
  std::vector<Pending*> done;
  for (size_t k = 0; k < bucket.responses.size(); ++k) {
    Pending* p = (*work)[bucket.responses[k]].pending.get();
    const size_t count = ResponseBytes((*work)[bucket.responses[k]].response) / element;
    in.push_back({p->entry.request.input, buffer + bucket.offsets[k], count});
    out.push_back({buffer + bucket.offsets[k], p->entry.request.output, count});
    done.push_back(p);
    // Orders the copy-in after the framework produced the input (GPU-side wait).
    NVG_RETURN_IF_ERROR(comm->WaitEvent(p->entry.request.ready_event, nullptr));
  }
  auto mark = [&](const char* phase, bool begin) {
    if (!timeline_.enabled()) return;
    double t = Now();
    for (Pending* p : done)
      begin ? timeline_.Begin(p->entry.request.name, phase, t) : timeline_.End(p->entry.request.name, phase, t);
  };
  if (bucket.bytes > 0) {
    mark("FUSION_COPY_IN", true);
    NVG_RETURN_IF_ERROR(comm->BatchedScaledCopy(in.data(), in.size(), first.dtype, first.prescale_factor, nullptr));
    mark("FUSION_COPY_IN", false);
    mark("ALLREDUCE", true);
    NVG_RETURN_IF_ERROR(comm->Allreduce(buffer, buffer, bucket.bytes / element, first.dtype, op, nullptr));
    mark("ALLREDUCE", false);
    mark("FUSION_COPY_OUT", true);
    NVG_RETURN_IF_ERROR(comm->BatchedScaledCopy(out.data(), out.size(), first.dtype, postscale, nullptr));
    mark("FUSION_COPY_OUT", false);
  }
  CompleteAfterStream(comm, std::move(done));
  return Status::Ok();
}

Status Engine::RunAllreduceAlone(Work* w) {
  const ResponseMessage& r = w->response;
  const CollectiveRequest& q = w->pending->entry.request;
  StatusOr<Communicator*> comm_or = GetCommunicator(q.device);
  if (!comm_or.ok()) return comm_or.status();
  Communicator* comm = comm_or.value();
  const size_t count = static_cast<size_t>(NumElements(r.shape));
  ReduceOp op = r.op;
  double postscale = r.postscale_factor;
  if (op == ReduceOp::kAverage && IsFloatingPoint(r.dtype)) {
    op = ReduceOp::kSum;
    postscale /= size_;
  }
  NVG_RETURN_IF_ERROR(comm->WaitEvent(q.ready_event, nullptr));
  if (timeline_.enabled()) timeline_.Begin(q.name, "ALLREDUCE", Now());
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
  if (timeline_.enabled()) timeline_.End(q.name, "ALLREDUCE", Now());
  CompleteAfterStream(comm, {w->pending.get()});
  return Status::Ok();
}

Status Engine::RunAllgather(Work* w) {
  const ResponseMessage& r = w->response;
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
  if (timeline_.enabled()) timeline_.Begin(q.name, "ALLGATHER", Now());
  NVG_RETURN_IF_ERROR(comm->Allgatherv(q.input, out, bytes_per_rank, nullptr));
  if (timeline_.enabled()) timeline_.End(q.name, "ALLGATHER", Now());
  if (!scratch.empty() || !alloc.ok()) {
    Complete(w->pending.get(), alloc.WithContext("allocating the allgather output"));
    return Status::Ok();
  }
  CompleteAfterStream(comm, {w->pending.get()});
  return Status::Ok();
}

Status Engine::RunBroadcast(Work* w) {
  const ResponseMessage& r = w->response;
  const CollectiveRequest& q = w->pending->entry.request;
  StatusOr<Communicator*> comm_or = GetCommunicator(q.device);
  if (!comm_or.ok()) return comm_or.status();
  Communicator* comm = comm_or.value();
  const size_t bytes = static_cast<size_t>(NumElements(r.shape)) * DataTypeSize(r.dtype);
  NVG_RETURN_IF_ERROR(comm->WaitEvent(q.ready_event, nullptr));
  if (timeline_.enabled()) timeline_.Begin(q.name, "BROADCAST", Now());
  if (rank_ == r.root_rank && q.input != q.output && bytes > 0) {
    Communicator::CopySpec copy{q.input, q.output, bytes};
    NVG_RETURN_IF_ERROR(comm->BatchedScaledCopy(&copy, 1, DataType::kUint8, 1.0, nullptr));
  }
  if (bytes > 0) NVG_RETURN_IF_ERROR(comm->Broadcast(q.output, bytes, r.root_rank, nullptr));
  if (timeline_.enabled()) timeline_.End(q.name, "BROADCAST", Now());
  CompleteAfterStream(comm, {w->pending.get()});
  return Status::Ok();
}

Status Engine::Execute(std::vector<Work>* work, size_t cache_hits) {
  if (work->empty()) return Status::Ok();
  NVG_LOG(kDebug) << "cycle " << cycle_ << ": executing " << work->size() << " responses ("
                  << cache_hits << " from the response cache, " << work->size() - cache_hits
                  << " negotiated through rank 0)";
  std::vector<ResponseMessage> responses;
  for (const Work& w : *work) responses.push_back(w.response);
  const size_t threshold = std::min(knobs_.fusion_threshold, cpu_comm_->registered_capacity());
  const double now = Now();
  if (timeline_.enabled())
    for (const Work& w : *work)
      if (w.pending) timeline_.End(w.response.name, "NEGOTIATE", now);
  for (const FusionBucket& bucket : PlanFusion(responses, threshold)) {
    Work& first = (*work)[bucket.responses[0]];
    if (!first.response.ok()) {  // error responses are buckets of their own
      if (first.pending) Complete(first.pending.get(), Status(first.response.error_code, first.response.error_message));
      continue;
    }
    Status s;
    switch (first.response.type) {
      case CollectiveType::kAllreduce: s = RunAllreduceBucket(bucket, work); break;
      case CollectiveType::kAllgather: s = RunAllgather(&first); break;
      case CollectiveType::kBroadcast: s = RunBroadcast(&first); break;
    }
    if (s.ok()) continue;
    // The same call failed on every rank (same arguments, same order); fail the
    // bucket's requests. A lost or aborted peer ends the loop.
    for (size_t i : bucket.responses) {
      Pending* p = (*work)[i].pending.get();
      if (p != nullptr && p->entry.request.done) Complete(p, s);
    }
    if (s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kAborted) return s;
  }
  return Status::Ok();
}

void Engine::Loop() {
  Status exit_status;
  bool shut_down = false;
  for (;; ++cycle_) {
    std::vector<TensorEntry> fresh;
    bool shutdown_requested = false;
    queue_.WaitAndPop(knobs_.cycle_time_ms / 1000.0, &fresh, &shutdown_requested);
    const double now = Now();
    // Drop names that completed in the last cycle before admitting new ones
    // (a completed name may come back at once).
    order_.erase(std::remove_if(order_.begin(), order_.end(),
                                [this](const std::string& n) { return !pending_.count(n); }),
                 order_.end());
    for (TensorEntry& e : fresh) Admit(std::move(e), now);

    std::vector<uint64_t> bits(1 + cache_words_, 0);
    bool must_report = FillCacheBits(now, &bits);
    if (rank_ == 0) {
      for (ResponseMessage& r : coordinator_.TakeStalledResponses(now)) stalled_.push_back(std::move(r));
      must_report = must_report || !stalled_.empty();
    }
    bits[0] = (must_report ? 0 : kNothingToReport) | (shutdown_requested ? 0 : kNoShutdown);
    MPI_Request req;
    int rc = MPI_Iallreduce(MPI_IN_PLACE, bits.data(), static_cast<int>(bits.size()), MPI_UINT64_T,
                            MPI_BAND, comm_, &req);
    if (rc != MPI_SUCCESS) {
      exit_status = Status::Internal("MPI_Iallreduce of the cache bits failed: " + MpiErrorString(rc));
      break;
    }
    // Orders this cycle after every rank's decision for it: all ranks read the
    // same bits, so all take the same branches below.
    exit_status = Wait(&req, "the cache-bit allreduce of cycle " + std::to_string(cycle_));
    if (!exit_status.ok()) break;
    if (!(bits[0] & kNoShutdown)) {
      shut_down = true;
      break;
    }
    std::vector<Work> work = TakeCacheHits(bits);
    const size_t cache_hits = work.size();
    if (!(bits[0] & kNothingToReport)) {
      exit_status = Negotiate(now, &work);
      if (!exit_status.ok()) break;
    }
    exit_status = Execute(&work, cache_hits);
    if (!exit_status.ok()) break;
  }

  if (!shut_down) {
    if (exit_status.code() == StatusCode::kUnavailable || exit_status.code() == StatusCode::kAborted)
      mpi_broken_ = true;
    NVG_LOG(kError) << "background loop stopped: " << exit_status.ToString();
    cpu_comm_->Abort();
    if (cuda_comm_) cuda_comm_->Abort();
  }
  // Fail what is left: pending entries, then anything queued after the last cycle.
  const Status closed = shut_down ? Status::Aborted("nvgroup_tf was shut down") : exit_status;
  std::vector<TensorEntry> queued = queue_.Close(closed);
  for (TensorEntry& e : queued) Admit(std::move(e), Now());
  for (const std::string& name : order_) {
    auto it = pending_.find(name);
    if (it == pending_.end()) continue;
    Complete(it->second.get(),
             shut_down ? Status::Aborted("nvgroup_tf was shut down with '" + name + "' in flight")
                       : exit_status);
    pending_.erase(it);
  }
  timeline_.Close();
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
  finalizer_.reset();  // runs the remaining CUDA completions
  cuda_comm_.reset();
  cpu_comm_.reset();
  // After a timeout a negotiation request may never complete; freeing the
  // communicator under it is undefined, so it is left to MPI_Finalize.
  int finalized = 0;
  NVG_MPI_CHECK(MPI_Finalized(&finalized));
  if (!mpi_broken_ && !abort_ && !finalized) NVG_MPI_CHECK(MPI_Comm_free(&comm_));
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Process-wide state and the public API.

std::mutex g_mu;                  // guards the three below
std::shared_ptr<Engine> g_engine;
bool g_initialized_mpi = false;   // Init called MPI_Init_thread

Status ValidateRequest(const CollectiveRequest& q, int size) {
  const std::string who = "collective '" + q.name + "'";
  if (q.name.empty()) return Status::InvalidArgument("a collective needs a non-empty name");
  if (static_cast<int>(q.dtype) >= kNumDataTypes)
    return Status::InvalidArgument(who + ": unknown dtype " + std::to_string(static_cast<int>(q.dtype)));
  if (static_cast<int>(q.type) > static_cast<int>(CollectiveType::kBroadcast))
    return Status::InvalidArgument(who + ": unknown collective type " + std::to_string(static_cast<int>(q.type)));
  if (!q.done) return Status::InvalidArgument(who + ": no done callback");
  for (int64_t d : q.shape)
    if (d < 0) return Status::InvalidArgument(who + ": negative dimension in shape " + ShapeToString(q.shape));
  if (q.device.kind == DeviceKind::kCuda) {
    if (q.device.ordinal < 0) return Status::InvalidArgument(who + ": CUDA device ordinal must be >= 0");
#ifndef NVGROUP_WITH_CUDA
    return Status::Unimplemented(who + ": device " + q.device.ToString() +
                                 " needs a CUDA build of nvgroup_tf (NVGROUP_WITH_CUDA=1)");
#endif
  } else if (q.device.kind != DeviceKind::kCpu) {
    return Status::InvalidArgument(who + ": unknown device kind");
  }
  const bool has_data = NumElements(q.shape) > 0;
  if (has_data && q.input == nullptr) return Status::InvalidArgument(who + ": input pointer is null");
  switch (q.type) {
    case CollectiveType::kAllreduce:
      if (!SupportsReduction(q.dtype))
        return Status::Unimplemented(who + ": allreduce does not support dtype " + DataTypeName(q.dtype) +
                                     " (float16, bfloat16, float32, float64, int32, int64 only)");
      if (static_cast<int>(q.op) > static_cast<int>(ReduceOp::kProduct))
        return Status::InvalidArgument(who + ": unknown reduce op " + std::to_string(static_cast<int>(q.op)));
      if (!std::isfinite(q.prescale_factor) || !std::isfinite(q.postscale_factor))
        return Status::InvalidArgument(who + ": scale factors must be finite");
      if (!IsFloatingPoint(q.dtype) && (q.prescale_factor != 1.0 || q.postscale_factor != 1.0))
        return Status::InvalidArgument(who + ": prescale/postscale factors other than 1 need a "
                                       "floating-point dtype, not " + DataTypeName(q.dtype));
      if (has_data && q.output == nullptr) return Status::InvalidArgument(who + ": output pointer is null");
      break;
    case CollectiveType::kAllgather:
      if (q.shape.empty())
        return Status::InvalidArgument(who + ": allgather needs a tensor of rank >= 1 (got a scalar)");
      if (!q.allocate_output) return Status::InvalidArgument(who + ": allgather needs allocate_output");
      break;
    case CollectiveType::kBroadcast:
      if (q.root_rank < 0 || q.root_rank >= size)
        return Status::InvalidArgument(who + ": root rank " + std::to_string(q.root_rank) +
                                       " is out of range [0, " + std::to_string(size) + ")");
      if (has_data && q.output == nullptr) return Status::InvalidArgument(who + ": output pointer is null");
      break;
  }
  return Status::Ok();
}

StatusOr<std::shared_ptr<Engine>> CurrentEngine() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_engine == nullptr)
    return Status::FailedPrecondition("nvgroup_tf has not been initialized; call hvd.init() first");
  return g_engine;
}

Status Submit(std::vector<CollectiveRequest> requests, bool grouped) {
  StatusOr<std::shared_ptr<Engine>> engine = CurrentEngine();
  if (!engine.ok()) return engine.status();
  if (requests.empty()) return Status::InvalidArgument("EnqueueGroup needs at least one request");
  const uint64_t group_id = grouped && requests.size() > 1 ? GroupId(requests) : 0;
  const double now = Now();
  std::vector<TensorEntry> entries;
  for (CollectiveRequest& q : requests) {
    NVG_RETURN_IF_ERROR(ValidateRequest(q, engine.value()->size()));
    TensorEntry e;
    RequestMessage& m = e.message;
    m.name = q.name;
    m.type = q.type;
    m.dtype = q.dtype;
    m.device_kind = q.device.kind;
    m.op = q.op;
    m.prescale_factor = q.prescale_factor;
    m.postscale_factor = q.postscale_factor;
    m.root_rank = q.root_rank;
    m.shape = q.shape;
    m.group_id = group_id;
    m.group_size = group_id != 0 ? static_cast<uint32_t>(requests.size()) : 0;
    e.request = std::move(q);
    e.enqueue_time = now;
    entries.push_back(std::move(e));
  }
  return engine.value()->Submit(std::move(entries));
}

// Parses the knobs on every rank and makes Init fail on every rank if any
// rank's environment is malformed or the ranks disagree on a knob that shapes
// the collectives (fusion threshold and cache size decide which collectives
// run). Gathers each rank's verdict so every rank can name the culprit.
Status AgreeOnKnobs(MPI_Comm comm, int rank, int size, StatusOr<Knobs>* knobs, double timeout_s) {
  std::atomic<bool> never{false};
  std::string mine = knobs->ok() ? std::string() : knobs->status().message();
  int64_t summary[3] = {static_cast<int64_t>(mine.size()),
                        knobs->ok() ? static_cast<int64_t>(knobs->value().fusion_threshold) : -1,
                        knobs->ok() ? knobs->value().cache_capacity : -1};
  std::vector<int64_t> all(3 * size);
  MPI_Request req;
  NVG_MPI_CHECK(MPI_Iallgather(summary, 3, MPI_INT64_T, all.data(), 3, MPI_INT64_T, comm, &req));
  NVG_RETURN_IF_ERROR(WaitMpi(&req, "Init's environment check", timeout_s, never));
  std::vector<int> lengths(size), displs(size);
  int total = 0;
  for (int r = 0; r < size; ++r) {
    lengths[r] = static_cast<int>(all[3 * r]);
    displs[r] = total;
    total += lengths[r];
  }
  std::string texts(std::max(total, 1), '\0');
  NVG_MPI_CHECK(MPI_Iallgatherv(mine.data(), static_cast<int>(mine.size()), MPI_CHAR, &texts[0],
                                lengths.data(), displs.data(), MPI_CHAR, comm, &req));
  NVG_RETURN_IF_ERROR(WaitMpi(&req, "Init's environment check", timeout_s, never));
  if (!knobs->ok()) return knobs->status();
  for (int r = 0; r < size; ++r)
    if (lengths[r] > 0)
      return Status::InvalidArgument("nvgroup_tf initialization failed on rank " + std::to_string(r) +
                                     ": " + texts.substr(displs[r], lengths[r]));
  for (int r = 1; r < size; ++r) {
    if (all[3 * r + 1] != all[1])
      return Status::InvalidArgument("NVGROUP_FUSION_THRESHOLD differs across ranks: rank 0 has " +
                                     std::to_string(all[1]) + ", rank " + std::to_string(r) + " has " +
                                     std::to_string(all[3 * r + 1]) + "; it must be the same on every rank");
    if (all[3 * r + 2] != all[2])
      return Status::InvalidArgument("NVGROUP_CACHE_CAPACITY differs across ranks: rank 0 has " +
                                     std::to_string(all[2]) + ", rank " + std::to_string(r) + " has " +
                                     std::to_string(all[3 * r + 2]) + "; it must be the same on every rank");
  }
  (void)rank;
  return Status::Ok();
}

}  // namespace

Status Init(const EngineOptions& options) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_engine != nullptr) return Status::Ok();
  int initialized = 0, finalized = 0;
  NVG_MPI_CHECK(MPI_Initialized(&initialized));
  NVG_MPI_CHECK(MPI_Finalized(&finalized));
  if (finalized) return Status::FailedPrecondition("MPI was already finalized; nvgroup_tf cannot start again");
  if (!initialized) {
    int provided = 0;
    NVG_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
    g_initialized_mpi = true;
  }
  int provided = 0;
  NVG_MPI_CHECK(MPI_Query_thread(&provided));
  if (provided < MPI_THREAD_MULTIPLE)
    NVG_LOG(kWarning) << "MPI provides thread level " << provided << ", not MPI_THREAD_MULTIPLE: "
                      << "do not call MPI from other threads while nvgroup_tf runs";

  StatusOr<Knobs> knobs = ParseKnobsFromEnvironment();
  const double timeout_s = std::max(kMinInitTimeoutS, knobs.ok() ? knobs.value().peer_timeout_s : 0.0);
  MPI_Comm user = options.mpi_comm_fortran == -1
                      ? MPI_COMM_WORLD
                      : MPI_Comm_f2c(static_cast<MPI_Fint>(options.mpi_comm_fortran));
  if (user == MPI_COMM_NULL)
    return Status::InvalidArgument("the MPI communicator handle " + std::to_string(options.mpi_comm_fortran) +
                                   " is MPI_COMM_NULL");
  MPI_Comm comm;
  MPI_Request req;
  std::atomic<bool> never{false};
  NVG_MPI_CHECK(MPI_Comm_idup(user, &comm, &req));
  NVG_RETURN_IF_ERROR(WaitMpi(&req, "Init's communicator duplication", timeout_s, never));
  int rank = 0, size = 1;
  NVG_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  NVG_MPI_CHECK(MPI_Comm_size(comm, &size));
  SetLogRank(rank);
  Status agreed = AgreeOnKnobs(comm, rank, size, &knobs, timeout_s);
  if (!agreed.ok()) {
    MPI_Comm_free(&comm);
    return agreed.WithContext("nvgroup_tf.init");
  }
  SetLogLevel(static_cast<LogLevel>(knobs.value().log_level));

  CommunicatorOptions copts;
  copts.group_size = knobs.value().group_size;
  copts.pipeline_chunk_bytes = knobs.value().pipeline_chunk;
  copts.timeout_seconds = knobs.value().peer_timeout_s;
  StatusOr<std::unique_ptr<Communicator>> cpu = CreateCommunicator(MPI_Comm_c2f(comm), Device::Cpu(), copts);
  if (!cpu.ok()) {
    MPI_Comm_free(&comm);
    return cpu.status().WithContext("nvgroup_tf.init: creating the CPU communicator");
  }
  g_engine = std::make_shared<Engine>(knobs.value(), comm, rank, size, cpu.consume());
  NVG_LOG(kInfo) << "initialized: " << size << " ranks, fusion threshold "
                 << knobs.value().fusion_threshold << " B, cache " << knobs.value().cache_capacity;
  return Status::Ok();
}

Status Shutdown() {
  std::shared_ptr<Engine> engine;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    engine.swap(g_engine);
  }
  if (engine == nullptr) return Status::Ok();
  return engine->Stop();
}

Status FinalizeMpi() {
  NVG_RETURN_IF_ERROR(Shutdown());
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_initialized_mpi) return Status::Ok();
  g_initialized_mpi = false;
  int finalized = 0;
  NVG_MPI_CHECK(MPI_Finalized(&finalized));
  if (!finalized) NVG_MPI_CHECK(MPI_Finalize());
  return Status::Ok();
}

bool IsInitialized() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_engine != nullptr;
}

#define NVG_TOPOLOGY_GETTER(Function, field)                            \
  StatusOr<int> Function() {                                            \
    StatusOr<std::shared_ptr<Engine>> engine = CurrentEngine();         \
    if (!engine.ok()) return engine.status();                           \
    return engine.value()->topology().field;                            \
  }
NVG_TOPOLOGY_GETTER(Rank, rank)
NVG_TOPOLOGY_GETTER(Size, size)
NVG_TOPOLOGY_GETTER(LocalRank, local_rank)
NVG_TOPOLOGY_GETTER(LocalSize, local_size)
NVG_TOPOLOGY_GETTER(CrossRank, node_index)
NVG_TOPOLOGY_GETTER(CrossSize, node_count)
#undef NVG_TOPOLOGY_GETTER

Status Enqueue(CollectiveRequest request) {
  std::vector<CollectiveRequest> one;
  one.push_back(std::move(request));
  return Submit(std::move(one), false);
}

Status EnqueueGroup(std::vector<CollectiveRequest> requests) { return Submit(std::move(requests), true); }

}  // namespace nvgroup
