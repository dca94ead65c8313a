#include "algorithms/cross_exchange.h"

#include <chrono>
#include <climits>
#include <string>

#include "algorithms/hierarchical_allreduce.h"
#include "common/checks.h"

namespace nvgroup {
namespace {

std::atomic<uint64_t> g_bytes_sent{0};

// The P parts of a slice of `count` elements (part p: peer p).
ChunkSlices Parts(size_t count, int peers, size_t esize) {
  ChunkSlices parts;
  parts.offset = 0;
  parts.count = count;
  parts.group_size = peers;
  parts.element_size = esize;
  return parts;
}

}  // namespace

// One job and where it stands. Stages advance in this order only.
struct CrossExchange::Active {
  enum Stage { kWaitReady, kAlltoall, kAllgather, kFinished };
  uint64_t ticket = 0;
  Job job;
  Stage stage = kWaitReady;
  bool scatter_only = false;  // StartReduceScatter: no allgatherv, result at `result` itself
  MPI_Request request = MPI_REQUEST_NULL;
  // Byte counts and displacements of the parts (MPI counts are int).
  std::vector<int> part_bytes, part_displs, recv_bytes, recv_displs;
};

uint64_t CrossExchange::BytesSent() { return g_bytes_sent.load(std::memory_order_relaxed); }

StatusOr<std::unique_ptr<CrossExchange>> CrossExchange::Create(MPI_Comm cross, bool use_thread) {
  std::unique_ptr<CrossExchange> x(new CrossExchange());
  NVG_MPI_CHECK(MPI_Comm_dup(cross, &x->rs_comm_));
  NVG_MPI_CHECK(MPI_Comm_dup(cross, &x->ag_comm_));
  NVG_MPI_CHECK(MPI_Comm_size(cross, &x->peers_));
  NVG_MPI_CHECK(MPI_Comm_rank(cross, &x->me_));
  int provided = MPI_THREAD_SINGLE;
  NVG_MPI_CHECK(MPI_Query_thread(&provided));
  // Every rank must agree on the mode only for performance, not correctness: the
  // posting order per communicator is the job order in both modes.
  x->threaded_ = use_thread && provided == MPI_THREAD_MULTIPLE && x->peers_ > 1;
  if (x->threaded_) x->thread_ = std::thread([p = x.get()] { p->ProgressLoop(); });
  return StatusOr<std::unique_ptr<CrossExchange>>(std::move(x));
}

CrossExchange::~CrossExchange() {
  if (threaded_) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;  // the loop leaves once no job is in flight (posted requests complete)
    }
    cv_.notify_all();
    thread_.join();
  } else {
    while (true) {  // complete what was posted: MPI writes into the buffers until then
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (active_.empty()) break;
      }
      ProgressOnce();
    }
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    if (rs_comm_ != MPI_COMM_NULL) (void)MPI_Comm_free(&rs_comm_);
    if (ag_comm_ != MPI_COMM_NULL) (void)MPI_Comm_free(&ag_comm_);
  }
}

size_t CrossExchange::RecvBytes(size_t count, size_t element_size) const {
  return Parts(count, peers_, element_size).SliceCount(me_) * element_size * peers_;
}

Status CrossExchange::Start(Job job, uint64_t* ticket) {
  if (job.count * job.element_size > static_cast<size_t>(INT_MAX))
    return Status::InvalidArgument("cross-group slice of " +
                                   std::to_string(job.count * job.element_size) +
                                   " bytes exceeds MPI's int counts");
  if (!job.fold) return Status::InvalidArgument("cross-group exchange without a fold");
  auto a = std::make_shared<Active>();
  a->job = std::move(job);
  const ChunkSlices parts = Parts(a->job.count, peers_, a->job.element_size);
  const size_t es = a->job.element_size;
  const int mine = static_cast<int>(parts.SliceCount(me_) * es);
  a->part_bytes.resize(peers_);
  a->part_displs.resize(peers_);
  a->recv_bytes.assign(peers_, mine);
  a->recv_displs.resize(peers_);
  for (int p = 0; p < peers_; ++p) {
    a->part_bytes[p] = static_cast<int>(parts.SliceCount(p) * es);
    a->part_displs[p] = static_cast<int>(parts.SliceOffset(p) * es);
    a->recv_displs[p] = p * mine;
  }
  return Enqueue(std::move(a), ticket);
}

Status CrossExchange::StartReduceScatter(ScatterJob sj, uint64_t* ticket) {
  if (!sj.fold) return Status::InvalidArgument("cross-group reduce-scatter without a fold");
  if (sj.part_counts == nullptr) return Status::InvalidArgument("cross-group reduce-scatter without part counts");
  const size_t es = sj.element_size;
  size_t send_elems = 0;
  for (int p = 0; p < peers_; ++p) send_elems += sj.part_counts[p];
  const size_t mine = sj.part_counts[me_];
  if (send_elems * es > static_cast<size_t>(INT_MAX) || mine * es * peers_ > static_cast<size_t>(INT_MAX))
    return Status::InvalidArgument("cross-group reduce-scatter chunk of " + std::to_string(send_elems * es) +
                                   " bytes exceeds MPI's int counts");
  auto a = std::make_shared<Active>();
  a->scatter_only = true;
  a->job.send = sj.send;
  a->job.recv = sj.recv;
  a->job.result = sj.result;
  a->job.count = mine;
  a->job.element_size = es;
  a->job.fold = std::move(sj.fold);
  a->job.ready = std::move(sj.ready);
  a->job.done = std::move(sj.done);
  a->part_bytes.resize(peers_);
  a->part_displs.resize(peers_);
  a->recv_bytes.assign(peers_, static_cast<int>(mine * es));
  a->recv_displs.resize(peers_);
  size_t displ = 0;
  for (int p = 0; p < peers_; ++p) {
    a->part_bytes[p] = static_cast<int>(sj.part_counts[p] * es);
    a->part_displs[p] = static_cast<int>(displ);
    displ += sj.part_counts[p] * es;
    a->recv_displs[p] = static_cast<int>(p * mine * es);
  }
  return Enqueue(std::move(a), ticket);
}

Status CrossExchange::Enqueue(std::shared_ptr<Active> a, uint64_t* ticket) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.ok()) return failure_;
    a->ticket = next_ticket_++;
    *ticket = a->ticket;
    active_.push_back(std::move(a));
  }
  cv_.notify_all();
  if (!threaded_) ProgressOnce();  // post what can be posted now
  return Status::Ok();
}

Status CrossExchange::Wait(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  while (finished_below_ <= ticket && failure_.ok()) {
    if (threaded_) {
      cv_.wait(lock);
    } else {
      lock.unlock();
      if (!ProgressOnce()) std::this_thread::yield();
      lock.lock();
    }
  }
  return failure_;
}

// Posts and tests; never blocks in MPI. The alltoallv of job k is posted only
// after that of job k-1 (next_rs_post_), the allgatherv likewise. Once the
// exchange failed nothing new is posted: requests already posted are tested
// to completion (MPI keeps writing into their buffers until then).
Status CrossExchange::Advance(Active& a, bool failed, bool* moved) {
  Job& j = a.job;
  if (failed) {
    int flag = 1;
    if (a.request != MPI_REQUEST_NULL) NVG_MPI_CHECK(MPI_Test(&a.request, &flag, MPI_STATUS_IGNORE));
    if (flag) {
      a.stage = Active::kFinished;
      *moved = true;
    }
    return Status::Ok();
  }
  if (a.stage == Active::kWaitReady) {
    if (a.ticket != next_rs_post_) return Status::Ok();
    if (j.ready) {
      bool ready = false;
      NVG_RETURN_IF_ERROR_CTX(j.ready(&ready), "waiting for the cross-group slice");
      if (!ready) return Status::Ok();
    }
    NVG_MPI_CHECK(MPI_Ialltoallv(j.send, a.part_bytes.data(), a.part_displs.data(), MPI_BYTE, j.recv,
                                 a.recv_bytes.data(), a.recv_displs.data(), MPI_BYTE, rs_comm_,
                                 &a.request));
    uint64_t sent = 0;
    for (int p = 0; p < peers_; ++p)
      if (p != me_) sent += a.part_bytes[p];
    g_bytes_sent.fetch_add(sent, std::memory_order_relaxed);
    ++next_rs_post_;
    a.stage = Active::kAlltoall;
    *moved = true;
  }
  if (a.stage == Active::kAlltoall) {
    int flag = 0;
    NVG_MPI_CHECK(MPI_Test(&a.request, &flag, MPI_STATUS_IGNORE));  // a null request: flag 1
    if (!flag || a.ticket != next_ag_post_) return Status::Ok();
    // The alltoallv completed: our parts of `send` are sent (so `result` may
    // alias it) and the P copies of our part are in `recv`, in peer order.
    const size_t mine = a.recv_bytes[me_] / j.element_size;
    if (mine > 0)
      NVG_RETURN_IF_ERROR_CTX(
          j.fold(j.recv, peers_, static_cast<char*>(j.result) + (a.scatter_only ? 0 : a.part_displs[me_]), mine),
          "folding the cross-group parts");
    if (a.scatter_only) {  // the reduce-scatter half only: done after the fold
      ++next_ag_post_;     // keeps the allgatherv order of the jobs after this one
      if (j.done) NVG_RETURN_IF_ERROR_CTX(j.done(), "after the cross-group reduce-scatter");
      a.stage = Active::kFinished;
      *moved = true;
      return Status::Ok();
    }
    NVG_MPI_CHECK(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, j.result, a.part_bytes.data(),
                                  a.part_displs.data(), MPI_BYTE, ag_comm_, &a.request));
    g_bytes_sent.fetch_add(static_cast<uint64_t>(a.recv_bytes[me_]) * (peers_ - 1),
                           std::memory_order_relaxed);
    ++next_ag_post_;
    a.stage = Active::kAllgather;
    *moved = true;
  }
  if (a.stage == Active::kAllgather) {
    int flag = 0;
    NVG_MPI_CHECK(MPI_Test(&a.request, &flag, MPI_STATUS_IGNORE));
    if (!flag) return Status::Ok();
    if (j.done) NVG_RETURN_IF_ERROR_CTX(j.done(), "after the cross-group allgather");
    a.stage = Active::kFinished;
    *moved = true;
  }
  return Status::Ok();
}

bool CrossExchange::ProgressOnce() {
  std::vector<std::shared_ptr<Active>> jobs;
  bool failed = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs.assign(active_.begin(), active_.end());
    failed = !failure_.ok();
  }
  bool moved = false;
  for (auto& a : jobs) {
    Status s = Advance(*a, failed, &moved);
    if (!s.ok()) {
      // The call that failed left no request we could complete.
      a->request = MPI_REQUEST_NULL;
      a->stage = Active::kFinished;
      moved = true;
      std::lock_guard<std::mutex> lock(mu_);
      if (failure_.ok())
        failure_ = s.WithContext("cross-group exchange (job " + std::to_string(a->ticket) + ")");
      failed = true;
    }
  }
  bool finished_any = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (!active_.empty() && active_.front()->stage == Active::kFinished) {
      finished_below_ = active_.front()->ticket + 1;
      active_.pop_front();
      finished_any = true;
    }
  }
  if (finished_any || moved) cv_.notify_all();
  return moved || finished_any;
}

void CrossExchange::ProgressLoop() {
  int idle = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !active_.empty(); });
      if (active_.empty() && stop_) return;
    }
    if (ProgressOnce()) {
      idle = 0;
    } else if (++idle < 64) {
      std::this_thread::yield();
    } else {
      // Nothing moved for a while (a slow peer or a long transfer): poll less
      // often so the progress thread does not take a core from the compute.
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
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
