#include "algorithms/cross_exchange.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <string>

#include "algorithms/hierarchical_allreduce.h"
#include "common/checks.h"

namespace nvgroup {
namespace {

std::atomic<uint64_t> g_bytes_sent{0};
std::atomic<uint64_t> g_allgather_jobs{0};

// The polling schedule of Note [Cross exchange protocol]: back-to-back polls
// for this long after the last movement, then each poll yields the core. A
// small collective between ranks of one host completes in 5-30 us
// (cc/engine/wait_policy.h), so the common hand-off never leaves this phase.
constexpr double kBackToBackPollS = 50e-6;

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The P parts of a slice of `count` elements (part p: peer p).
ChunkSlices Parts(size_t count, int peers, size_t esize) {
  ChunkSlices parts;
  parts.offset = 0;
  parts.count = count;
  parts.group_size = peers;
  parts.element_size = esize;
  return parts;
}

// The two halves of one round of the exchange among the peers on `comm`, each
// appending its requests: the receives (recv_bytes[p] bytes from peer p at
// recv + recv_displs[p]) and the sends (send_bytes[p] bytes to peer p from
// send + send_displs[p]), peer me first, then me+1, ... Our own share is a
// message to ourselves only when `message_to_self` (device buffers);
// otherwise it is not moved (the fold reads it in `send`). Empty messages are
// skipped on both sides (both know every size). Point-to-point messages of one
// (source, tag, communicator) match in posting order, and every peer posts the
// receives of its rounds on a communicator in job order and their sends in job
// order, so round k of one peer meets round k of every other.
constexpr int kTag = 0;

// post(p, &request) for every peer p that has bytes[p] to move, in the order above.
template <class PostOne>
Status PostToPeers(int peers, int me, const int* bytes, bool message_to_self,
                   std::vector<MPI_Request>* requests, PostOne post) {
  for (int i = 0; i < peers; ++i) {
    const int p = (me + i) % peers;
    if (bytes[p] == 0 || (p == me && !message_to_self)) continue;
    requests->push_back(MPI_REQUEST_NULL);
    NVG_RETURN_IF_ERROR(post(p, &requests->back()));
  }
  return Status::Ok();
}

Status PostReceives(MPI_Comm comm, int peers, int me, void* recv, const int* recv_bytes,
                    const int* recv_displs, bool message_to_self, std::vector<MPI_Request>* requests) {
  return PostToPeers(peers, me, recv_bytes, message_to_self, requests, [&](int p, MPI_Request* r) {
    NVG_MPI_CHECK(MPI_Irecv(static_cast<char*>(recv) + recv_displs[p], recv_bytes[p], MPI_BYTE, p, kTag, comm,
                            r));
    return Status::Ok();
  });
}

Status PostSends(MPI_Comm comm, int peers, int me, const void* send, const int* send_bytes,
                 const int* send_displs, bool message_to_self, std::vector<MPI_Request>* requests) {
  return PostToPeers(peers, me, send_bytes, message_to_self, requests, [&](int p, MPI_Request* r) {
    NVG_MPI_CHECK(MPI_Isend(static_cast<const char*>(send) + send_displs[p], send_bytes[p], MPI_BYTE, p, kTag,
                            comm, r));
    return Status::Ok();
  });
}

// A failed exchange posts nothing more: receives posted ahead of their sends
// (a job whose `ready` never came) are cancelled, so the round can complete
// without the peers' messages. A receive that already matched is not
// cancelled; it completes once its message arrived (MPI_Cancel's semantics).
Status CancelReceives(std::vector<MPI_Request>* requests) {
  for (MPI_Request& r : *requests)
    if (r != MPI_REQUEST_NULL) NVG_MPI_CHECK(MPI_Cancel(&r));
  return Status::Ok();
}

// *done once every request of the round completed (none: at once).
Status TestRound(std::vector<MPI_Request>* requests, bool* done) {
  int flag = 1;
  if (!requests->empty())
    NVG_MPI_CHECK(MPI_Testall(static_cast<int>(requests->size()), requests->data(), &flag,
                              MPI_STATUSES_IGNORE));
  *done = flag != 0;
  if (*done) requests->clear();
  return Status::Ok();
}

}  // namespace

// One job and where it stands. Stages advance in this order only.
struct CrossExchange::Active {
  enum Stage { kWaitReady, kFirst, kWaitFold, kSecond, kFinished };
  enum Kind { kReduceScatterAllgather, kAllgatherFold, kReduceScatterOnly };
  uint64_t ticket = 0;
  uint64_t ag_index = 0;  // kReduceScatterAllgather: its place in the order of second rounds
  Kind kind = kReduceScatterAllgather;
  Job job;
  Stage stage = kWaitReady;
  // kWaitReady: the first round's receives are posted (its sends wait for `ready`).
  bool receives_posted = false;
  std::vector<MPI_Request> requests;  // the round in flight (kWaitReady: its receives)
  // Byte counts and displacements per peer (MPI counts are int) of the first
  // round (send_*, recv_*) and, reduce-scatter + allgather, of the allgather
  // (our part to every other peer: ag_send_*; theirs into `result`: ag_recv_*).
  std::vector<int> send_bytes, send_displs, recv_bytes, recv_displs;
  std::vector<int> ag_send_bytes, ag_send_displs, ag_recv_bytes, ag_recv_displs;
  size_t my_part_offset = 0;  // bytes: where our part of `result` starts
  // The fold's P copies in peer order: peer p's in `recv`, ours in `send` on
  // host memory (FoldSources).
  std::vector<const void*> sources;
};

uint64_t CrossExchange::BytesSent() { return g_bytes_sent.load(std::memory_order_relaxed); }
uint64_t CrossExchange::AllgatherJobs() { return g_allgather_jobs.load(std::memory_order_relaxed); }

StatusOr<std::unique_ptr<CrossExchange>> CrossExchange::Create(MPI_Comm cross, Options options) {
  std::unique_ptr<CrossExchange> x(new CrossExchange());
  NVG_MPI_CHECK(MPI_Comm_dup(cross, &x->rs_comm_));
  NVG_MPI_CHECK(MPI_Comm_dup(cross, &x->ag_comm_));
  NVG_MPI_CHECK(MPI_Comm_size(cross, &x->peers_));
  NVG_MPI_CHECK(MPI_Comm_rank(cross, &x->me_));
  int provided = MPI_THREAD_SINGLE;
  NVG_MPI_CHECK(MPI_Query_thread(&provided));
  x->allgather_max_bytes_ = options.allgather_max_bytes;
  x->host_memory_ = options.host_memory;
  // Every rank must agree on the mode only for performance, not correctness: the
  // posting order per communicator is the job order in both modes.
  x->threaded_ = options.use_thread && provided == MPI_THREAD_MULTIPLE && x->peers_ > 1;
  if (x->threaded_) x->thread_ = std::thread([p = x.get()] { p->ProgressLoop(); });
  return StatusOr<std::unique_ptr<CrossExchange>>(std::move(x));
}

CrossExchange::~CrossExchange() {
  if (threaded_) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;  // the loop leaves once no job is in flight (posted requests complete)
    }
    work_cv_.notify_all();
    thread_.join();
  } else {
    // complete what was posted: MPI writes into the buffers until then
    while (HasWork()) ProgressOnce();
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    if (rs_comm_ != MPI_COMM_NULL) (void)MPI_Comm_free(&rs_comm_);
    if (ag_comm_ != MPI_COMM_NULL) (void)MPI_Comm_free(&ag_comm_);
  }
}

size_t CrossExchange::AllgatherLimitBytes(size_t allgather_max_bytes, int peers) {
  return peers == 2 ? 2 * allgather_max_bytes : allgather_max_bytes;
}

CrossExchange::Variant CrossExchange::VariantFor(size_t count, size_t element_size) const {
  const size_t allgather_sends = count * element_size * static_cast<size_t>(peers_ - 1);
  return allgather_max_bytes_ > 0 && allgather_sends <= AllgatherLimitBytes(allgather_max_bytes_, peers_)
             ? Variant::kAllgatherFold
             : Variant::kReduceScatterAllgather;
}

size_t CrossExchange::RecvBytes(size_t count, size_t element_size) const {
  if (VariantFor(count, element_size) == Variant::kAllgatherFold) return count * element_size * peers_;
  return Parts(count, peers_, element_size).SliceCount(me_) * element_size * peers_;
}

size_t CrossExchange::MaxRecvBytes(size_t max_slice_bytes) const {
  // Reduce-scatter: P parts of at most ceil(n / P) rounded up to 16 bytes.
  const size_t scatter = max_slice_bytes + 16 * static_cast<size_t>(peers_);
  const size_t largest_allgather =
      peers_ > 1 ? std::min(max_slice_bytes, AllgatherLimitBytes(allgather_max_bytes_, peers_) / (peers_ - 1))
                 : max_slice_bytes;
  return std::max(scatter, largest_allgather * peers_);
}

Status CrossExchange::Start(Job job, uint64_t* ticket) {
  if (job.count * job.element_size > static_cast<size_t>(INT_MAX))
    return Status::InvalidArgument("cross-group slice of " + std::to_string(job.count * job.element_size) +
                                   " bytes exceeds MPI's int counts");
  if (!job.fold) return Status::InvalidArgument("cross-group exchange without a fold");
  auto a = std::make_unique<Active>();
  a->job = std::move(job);
  const size_t es = a->job.element_size;
  const int P = peers_;
  a->send_bytes.resize(P);
  a->send_displs.resize(P);
  a->recv_bytes.resize(P);
  a->recv_displs.resize(P);
  if (VariantFor(a->job.count, es) == Variant::kAllgatherFold) {
    a->kind = Active::kAllgatherFold;
    g_allgather_jobs.fetch_add(1, std::memory_order_relaxed);
    const int slice = static_cast<int>(a->job.count * es);
    for (int p = 0; p < P; ++p) {
      a->send_bytes[p] = slice;
      a->send_displs[p] = 0;
      a->recv_bytes[p] = slice;
      a->recv_displs[p] = p * slice;
    }
    return Enqueue(std::move(a), ticket);
  }
  const ChunkSlices parts = Parts(a->job.count, P, es);
  const int mine = static_cast<int>(parts.SliceCount(me_) * es);
  a->ag_send_bytes.assign(P, mine);
  a->ag_send_displs.assign(P, static_cast<int>(parts.SliceOffset(me_) * es));
  a->ag_recv_bytes.resize(P);
  a->ag_recv_displs.resize(P);
  for (int p = 0; p < P; ++p) {
    a->send_bytes[p] = static_cast<int>(parts.SliceCount(p) * es);
    a->send_displs[p] = static_cast<int>(parts.SliceOffset(p) * es);
    a->recv_bytes[p] = mine;
    a->recv_displs[p] = p * mine;
    a->ag_recv_bytes[p] = a->send_bytes[p];
    a->ag_recv_displs[p] = a->send_displs[p];
  }
  a->ag_send_bytes[me_] = 0;  // in place: our part is in `result` already
  a->ag_recv_bytes[me_] = 0;
  a->my_part_offset = parts.SliceOffset(me_) * es;
  return Enqueue(std::move(a), ticket);
}

Status CrossExchange::StartReduceScatter(ScatterJob sj, uint64_t* ticket) {
  if (!sj.fold) return Status::InvalidArgument("cross-group reduce-scatter without a fold");
  if (sj.part_counts == nullptr)
    return Status::InvalidArgument("cross-group reduce-scatter without part counts");
  const size_t es = sj.element_size;
  size_t send_elems = 0;
  for (int p = 0; p < peers_; ++p) send_elems += sj.part_counts[p];
  const size_t mine = sj.part_counts[me_];
  if (send_elems * es > static_cast<size_t>(INT_MAX) || mine * es * peers_ > static_cast<size_t>(INT_MAX))
    return Status::InvalidArgument("cross-group reduce-scatter chunk of " + std::to_string(send_elems * es) +
                                   " bytes exceeds MPI's int counts");
  auto a = std::make_unique<Active>();
  a->kind = Active::kReduceScatterOnly;
  a->job.send = sj.send;
  a->job.recv = sj.recv;
  a->job.result = sj.result;
  a->job.count = mine;
  a->job.element_size = es;
  a->job.fold = std::move(sj.fold);
  a->job.ready = std::move(sj.ready);
  a->job.writable = std::move(sj.writable);
  a->job.done = std::move(sj.done);
  a->send_bytes.resize(peers_);
  a->send_displs.resize(peers_);
  a->recv_bytes.assign(peers_, static_cast<int>(mine * es));
  a->recv_displs.resize(peers_);
  size_t displ = 0;
  for (int p = 0; p < peers_; ++p) {
    a->send_bytes[p] = static_cast<int>(sj.part_counts[p] * es);
    a->send_displs[p] = static_cast<int>(displ);
    displ += sj.part_counts[p] * es;
    a->recv_displs[p] = static_cast<int>(p * mine * es);
  }
  return Enqueue(std::move(a), ticket);
}

// See Note [Cross exchange protocol]: caller -> jobs.
Status CrossExchange::Enqueue(std::unique_ptr<Active> a, uint64_t* ticket) {
  // The fold's operands: on host memory our own share stays where it is in
  // `send` (the first round leaves it out); on device memory it arrives in
  // `recv` as a message to ourselves, so the P copies are contiguous there.
  a->sources.resize(peers_);
  for (int p = 0; p < peers_; ++p)
    a->sources[p] = p == me_ && host_memory_ ? static_cast<const char*>(a->job.send) + a->send_displs[me_]
                                             : static_cast<const char*>(a->job.recv) + a->recv_displs[p];
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.ok()) return failure_;
    a->ticket = next_ticket_++;
    if (a->kind == Active::kReduceScatterAllgather) a->ag_index = next_ag_index_++;
    *ticket = a->ticket;
    incoming_.push_back(std::move(a));
    submitted_.store(next_ticket_, std::memory_order_seq_cst);
  }
  TryProgress();  // post what can be posted now; a sleeping progress thread is left asleep
  return Status::Ok();
}

bool CrossExchange::HasWork() const {
  return submitted_.load(std::memory_order_seq_cst) != finished_below_.load(std::memory_order_seq_cst);
}

bool CrossExchange::Finished(uint64_t ticket) const {
  return finished_below_.load(std::memory_order_acquire) > ticket || failed_.load(std::memory_order_acquire);
}

Status CrossExchange::FailureStatus() {
  if (!failed_.load(std::memory_order_acquire)) return Status::Ok();
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

bool CrossExchange::TryProgress() {
  if (progressing_.exchange(true, std::memory_order_acquire)) return false;  // the other side progresses
  const bool moved = ProgressOnce();
  progressing_.store(false, std::memory_order_release);
  return moved;
}

// See Note [Cross exchange protocol]: the caller progresses its own wait.
Status CrossExchange::Wait(uint64_t ticket) {
  waiting_callers_.fetch_add(1, std::memory_order_seq_cst);
  Clock::time_point last = Clock::now();
  while (!Finished(ticket)) {
    if (TryProgress()) last = Clock::now();
    else if (SecondsSince(last) > kBackToBackPollS) std::this_thread::yield();
  }
  bool wake = false;
  if (threaded_) {
    std::lock_guard<std::mutex> lock(mu_);
    waiting_callers_.fetch_sub(1, std::memory_order_seq_cst);
    wake = sleeping_ && HasWork();  // jobs left in flight: the progress thread takes them over
  } else {
    waiting_callers_.fetch_sub(1, std::memory_order_seq_cst);
  }
  if (wake) work_cv_.notify_one();
  return FailureStatus();
}

// Posts and tests; never blocks in MPI. The receives of each job's first
// round are posted only after those of job k-1 (next_rs_recv_post_), its
// sends only after those of job k-1 (next_rs_send_post_) and once `ready`; a
// second round only after that of the reduce-scatter + allgather job before it
// (ag_index, next_ag_post_). Once the exchange failed nothing new is posted:
// receives posted ahead of their sends are cancelled, and requests already
// posted are tested to completion (MPI keeps writing into their buffers until
// then).
Status CrossExchange::Advance(Active& a, bool* moved) {
  Job& j = a.job;
  if (failed_.load(std::memory_order_relaxed)) {
    if (a.stage == Active::kWaitReady && !a.requests.empty()) {
      a.stage = Active::kFirst;  // cancelled once; should MPI_Cancel fail, ProgressOnce drops them
      NVG_RETURN_IF_ERROR(CancelReceives(&a.requests));
    }
    bool done = true;
    NVG_RETURN_IF_ERROR(TestRound(&a.requests, &done));
    if (done) {
      a.stage = Active::kFinished;
      *moved = true;
    }
    return Status::Ok();
  }
  if (a.stage == Active::kWaitReady) {
    // The receives go out as soon as the job is taken (`recv` is the job's
    // from Start), so a peer whose slice is staged first finds them posted;
    // the sends wait for our slice. Both halves in job order.
    const char* what = a.kind == Active::kAllgatherFold ? "posting the cross-group allgather"
                                                        : "posting the cross-group reduce-scatter";
    if (!a.receives_posted) {
      if (a.ticket != next_rs_recv_post_) return Status::Ok();
      NVG_RETURN_IF_ERROR_CTX(PostReceives(rs_comm_, peers_, me_, j.recv, a.recv_bytes.data(),
                                           a.recv_displs.data(), !host_memory_, &a.requests),
                              what);
      a.receives_posted = true;
      ++next_rs_recv_post_;
      *moved = true;
    }
    bool ready = a.ticket == next_rs_send_post_;
    if (ready && j.ready) NVG_RETURN_IF_ERROR_CTX(j.ready(&ready), "waiting for the cross-group slice");
    if (!ready) {
      // Testing the posted receives drives MPI's progress (Open MPI moves
      // messages only inside MPI calls): the peers' copies land while our
      // slice is still being staged.
      const bool pending = !a.requests.empty();
      bool received = false;
      NVG_RETURN_IF_ERROR(TestRound(&a.requests, &received));
      if (pending && received) *moved = true;
      return Status::Ok();
    }
    NVG_RETURN_IF_ERROR_CTX(PostSends(rs_comm_, peers_, me_, j.send, a.send_bytes.data(),
                                      a.send_displs.data(), !host_memory_, &a.requests),
                            what);
    uint64_t sent = 0;
    for (int p = 0; p < peers_; ++p)
      if (p != me_) sent += a.send_bytes[p];
    g_bytes_sent.fetch_add(sent, std::memory_order_relaxed);
    ++next_rs_send_post_;
    a.stage = Active::kFirst;
    *moved = true;
  }
  if (a.stage == Active::kFirst) {
    bool done = false;
    NVG_RETURN_IF_ERROR(TestRound(&a.requests, &done));
    if (!done) return Status::Ok();
    // The first round completed: `send` was read (so `result` may alias it)
    // and `recv` holds the other peers' copies, in peer order.
    a.stage = Active::kWaitFold;
    *moved = true;
  }
  if (a.stage == Active::kWaitFold) {
    if (a.kind == Active::kReduceScatterAllgather && a.ag_index != next_ag_post_) return Status::Ok();
    if (j.writable) {
      bool writable = false;
      NVG_RETURN_IF_ERROR_CTX(j.writable(&writable), "waiting for the cross-group result buffer");
      if (!writable) return Status::Ok();
    }
    const size_t mine = a.recv_bytes[me_] / j.element_size;  // the slice (allgather) or our part
    if (mine > 0)
      NVG_RETURN_IF_ERROR_CTX(j.fold(a.sources.data(), peers_,
                                     static_cast<char*>(j.result) + a.my_part_offset, mine),
                              "folding the cross-group copies");
    *moved = true;
    if (a.kind != Active::kReduceScatterAllgather) {  // one round: done after the fold
      if (j.done) NVG_RETURN_IF_ERROR_CTX(j.done(), "after the cross-group fold");
      a.stage = Active::kFinished;
      return Status::Ok();
    }
    Status posted = PostReceives(ag_comm_, peers_, me_, j.result, a.ag_recv_bytes.data(),
                                 a.ag_recv_displs.data(), !host_memory_, &a.requests);
    if (posted.ok())
      posted = PostSends(ag_comm_, peers_, me_, j.result, a.ag_send_bytes.data(), a.ag_send_displs.data(),
                         !host_memory_, &a.requests);
    NVG_RETURN_IF_ERROR_CTX(posted, "posting the cross-group allgather of the parts");
    g_bytes_sent.fetch_add(static_cast<uint64_t>(a.recv_bytes[me_]) * (peers_ - 1),
                           std::memory_order_relaxed);
    ++next_ag_post_;
    a.stage = Active::kSecond;
  }
  if (a.stage == Active::kSecond) {
    bool done = false;
    NVG_RETURN_IF_ERROR(TestRound(&a.requests, &done));
    if (!done) return Status::Ok();
    if (j.done) NVG_RETURN_IF_ERROR_CTX(j.done(), "after the cross-group allgather");
    a.stage = Active::kFinished;
    *moved = true;
  }
  return Status::Ok();
}

bool CrossExchange::ProgressOnce() {
  if (submitted_.load(std::memory_order_acquire) != taken_) {
    std::lock_guard<std::mutex> lock(mu_);
    for (; !incoming_.empty(); incoming_.pop_front(), ++taken_)
      active_.push_back(std::move(incoming_.front()));
  }
  bool moved = false;
  for (auto& a : active_) {
    if (a->stage == Active::kFinished) continue;
    Status s = Advance(*a, &moved);
    if (s.ok()) continue;
    if (a->stage == Active::kWaitReady && !a->requests.empty()) {
      // `ready`, or posting the sends, failed with the first round's
      // receives posted: the exchange fails (below), and Advance's failed
      // branch cancels them and tests them to completion (MPI may write into
      // `recv` until then).
    } else {
      // The call that failed left no request we could complete.
      a->requests.clear();
      a->stage = Active::kFinished;
    }
    moved = true;
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.ok())
      failure_ = s.WithContext("cross-group exchange (job " + std::to_string(a->ticket) + ")");
    failed_.store(true, std::memory_order_seq_cst);
  }
  bool finished_any = false;
  uint64_t below = 0;
  for (; !active_.empty() && active_.front()->stage == Active::kFinished; active_.pop_front()) {
    below = active_.front()->ticket + 1;
    finished_any = true;
  }
  // orders: everything the jobs wrote (and `done`) before a waiter's acquire of it
  if (finished_any) finished_below_.store(below, std::memory_order_seq_cst);
  return moved || finished_any;
}

// See Note [Cross exchange protocol]: progresses the jobs in flight while no
// caller waits for one, never sleeping with a job in flight; sleeps otherwise.
void CrossExchange::ProgressLoop() {
  Clock::time_point last = Clock::now();
  while (true) {
    if (waiting_callers_.load(std::memory_order_seq_cst) > 0 || !HasWork()) {
      std::unique_lock<std::mutex> lock(mu_);
      sleeping_ = true;
      work_cv_.wait(lock, [&] {
        return (stop_ && !HasWork()) || (HasWork() && waiting_callers_.load(std::memory_order_seq_cst) == 0);
      });
      sleeping_ = false;
      if (stop_ && !HasWork()) return;
      last = Clock::now();
    }
    if (TryProgress()) last = Clock::now();
    else if (SecondsSince(last) > kBackToBackPollS) std::this_thread::yield();
  }
}

Status CrossJobs::CheckFree(size_t chunk_index) const {
  const int k = static_cast<int>(chunk_index % 2);
  if (in_flight_[k])
    return Status::Internal("cross-group buffers of parity " + std::to_string(k) + " still in use");
  return Status::Ok();
}

Status CrossJobs::Start(size_t chunk_index, CrossExchange::Job job) {
  const int k = static_cast<int>(chunk_index % 2);
  NVG_RETURN_IF_ERROR(cross_->Start(std::move(job), &ticket_[k]));
  in_flight_[k] = true;
  return Status::Ok();
}

Status CrossJobs::StartReduceScatter(size_t chunk_index, CrossExchange::ScatterJob job) {
  const int k = static_cast<int>(chunk_index % 2);
  NVG_RETURN_IF_ERROR(cross_->StartReduceScatter(std::move(job), &ticket_[k]));
  in_flight_[k] = true;
  return Status::Ok();
}

Status CrossJobs::Finish(size_t chunk_index, bool* waited) {
  const int k = static_cast<int>(chunk_index % 2);
  if (waited != nullptr) *waited = in_flight_[k];
  if (!in_flight_[k]) return Status::Ok();
  in_flight_[k] = false;
  return cross_->Wait(ticket_[k]);
}

}  // namespace nvgroup
