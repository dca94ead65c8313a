// Execution (execution.h): runs the cycle's agreed responses through a
// Communicator, one function per collective type (Execution::Run* below),
// after negotiation agreed on every parameter (coordinator.cc). Also the
// communicators' creation (GetCommunicator) and how a failed bucket fails its
// requests.
//
// How each type runs:
//  * allreduce: fusion buckets (fusion.h) through Communicator::FusedAllreduce
//    (prescale on the copy in, postscale and an Average's division on the copy
//    out, averaging.h); a bucket larger than the registered buffer runs one
//    tensor at a time with the same arithmetic, so the bits are the same;
//  * allgather, broadcast: a bucket of their own, Allgatherv / Broadcast;
//  * reducescatter: Communicator::ReduceScatter with Horovod's row split (ranks
//    below dim0 % size get one more row), scale factors applied as allreduce
//    applies them (prescale into a scratch copy of the input, postscale on the
//    output), so every row holds the bits the allreduce would give it;
//  * alltoall: the negotiated size x size splits matrix gives this rank's send
//    and receive byte counts; Communicator::Alltoallv moves the rows;
//  * join: writes the last rank to join (the coordinator's answer) and clears
//    this rank's joined state (the loop ends it, Negotiation::EndJoin, as it
//    hands the join's bucket here). While joined, the rank stands in for the
//    allreduces/reducescatters of the others with a zero input
//    (Negotiation::MakeJoinStandIn), both for negotiated and cached responses.
// Every function completes its requests through Completion (completion.h: at
// once on the host, after the stream on CUDA).
#include <algorithm>
#include <atomic>
#include <cstring>

#include "common/checks.h"
#include "common/logging.h"
#include "engine/averaging.h"
#include "engine/execution.h"

namespace nvgroup {

int64_t ReducescatterRows(int64_t dim0, int rank, int size) {
  return dim0 / size + (rank < dim0 % size ? 1 : 0);
}

namespace {

std::vector<int64_t> Tail(const std::vector<int64_t>& shape) {
  return std::vector<int64_t>(shape.begin() + (shape.empty() ? 0 : 1), shape.end());
}

std::atomic<double> bucket_delay_us{0.0};
std::atomic<int64_t> delayed_buckets{0};
std::atomic<bool> host_completion_events{false};  // SetHostCompletionEventsForTesting

// The simulated link (NVGROUP_TEST_BUCKET_DELAY_US): after the bucket's work,
// before its completion is recorded.
Status DelayBucket(Communicator* comm) {
  const double us = bucket_delay_us.load(std::memory_order_relaxed);
  if (us <= 0) return Status::Ok();
  delayed_buckets.fetch_add(1, std::memory_order_relaxed);
  return comm->DelayStream(us, nullptr);
}

}  // namespace

void SetBucketDelayForTesting(double microseconds) {
  bucket_delay_us.store(microseconds > 0 ? microseconds : 0.0, std::memory_order_relaxed);
}
double BucketDelayForTesting() { return bucket_delay_us.load(std::memory_order_relaxed); }
int64_t DelayedBucketsForTesting() { return delayed_buckets.load(std::memory_order_relaxed); }
void SetHostCompletionEventsForTesting(bool on) {
  host_completion_events.store(on, std::memory_order_relaxed);
}

Execution::Execution(const Knobs& knobs, MPI_Comm comm, int rank, int size, std::unique_ptr<Communicator> cpu,
                     std::unique_ptr<Communicator> cuda, TensorQueue* queue, AbortSignal* abort,
                     EngineCounters* counters, Timeline* timeline)
    : knobs_(knobs),
      comm_(comm),
      rank_(rank),
      size_(size),
      abort_(abort),
      counters_(counters),
      timeline_(timeline),
      completion_(queue, abort, counters),
      cpu_comm_(std::move(cpu)) {
  abort_->WatchCpu(cpu_comm_.get());
  if (host_completion_events.load(std::memory_order_relaxed)) completion_.StartHostEvents();
  if (cuda != nullptr) {  // created by Init (EngineOptions::cuda_at_init)
    cuda_comm_ = std::move(cuda);
    abort_->WatchCuda(cuda_comm_.get());
    cuda_ordinal_ = cuda_comm_->device().ordinal;
    completion_.StartCuda(cuda_ordinal_);
  }
}

void Execution::Stop() {
  completion_.Stop();  // runs the remaining CUDA completions
  abort_->Close();     // no Raise inside a communicator being freed
  cuda_comm_.reset();
  cpu_comm_.reset();
}

StatusOr<Communicator*> Execution::GetCommunicator(const Device& device) {
  if (device.kind == DeviceKind::kCpu) return cpu_comm_.get();
  if (cuda_comm_ == nullptr) {
    // Collective: every rank reaches this through the same response.
    StatusOr<std::unique_ptr<Communicator>> c = CreateCommunicator(MPI_Comm_c2f(comm_), device,
                                                                   knobs_);  // agreed across ranks at Init
    if (!c.ok()) return c.status().WithContext("creating the communicator for " + device.ToString());
    cuda_comm_ = c.consume();
    abort_->WatchCuda(cuda_comm_.get());
    cuda_ordinal_ = device.ordinal;
    completion_.StartCuda(device.ordinal);
  }
  if (device.ordinal != cuda_ordinal_)
    return Status::Unimplemented("nvgroup_tf drives one CUDA device per process: this rank uses " +
                                 Device::Cuda(cuda_ordinal_).ToString() + ", not " + device.ToString());
  return cuda_comm_.get();
}

Status Execution::RunBucket(const FusionBucket& bucket, std::vector<Work>* work) {
  Work& first = (*work)[bucket.responses[0]];
  if (!first.response->ok()) {  // error responses are buckets of their own
    if (first.pending)
      Complete(first.pending.get(), Status(first.response->error_code, first.response->error_message));
    return Status::Ok();
  }
  Status s;
  switch (first.response->type) {
    case CollectiveType::kAllreduce: {
      bucket_members_.clear();
      for (size_t i : bucket.responses)
        bucket_members_.push_back({(*work)[i].response, &(*work)[i].pending->entry});
      return RunMembers(bucket, bucket_members_.data());
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

Status Execution::RunMembers(const FusionBucket& bucket, const BucketMember* members) {
  Status s = RunAllreduceBucket(bucket, members);
  if (s.ok()) return s;
  std::vector<TensorEntry*> entries;
  for (size_t k = 0; k < bucket.offsets.size(); ++k) entries.push_back(members[k].entry);
  return FailEntries(s, entries.data(), entries.size());
}

Status Execution::FailEntries(const Status& status, TensorEntry* const* entries, size_t n) {
  if (status.ok()) return status;
  const Status s = abort_->Cause(status);
  // The same call failed on every rank (same arguments, same order); fail the
  // bucket's requests. A lost or aborted peer ends the loop.
  for (size_t i = 0; i < n; ++i)
    if (entries[i]->request.done) Complete(entries[i], s);
  if (s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kAborted) return s;
  return Status::Ok();
}

Status Execution::RunAllreduceBucket(const FusionBucket& bucket, const BucketMember* members) {
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
  const auto [op, postscale] = ReductionFor(first, size_);  // averaging.h
  EngineCounters::Add(counters_->buckets);
  EngineCounters::Add(counters_->bucket_tensors, n);
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
    if (e != nullptr && std::find(b.events.begin(), b.events.end(), e) == b.events.end())
      b.events.push_back(e);
  }
  // Orders the copy-in after the framework produced the inputs (GPU-side
  // waits, one per distinct event).
  for (void* e : b.events) NVG_RETURN_IF_ERROR(comm->WaitEvent(e, nullptr));
  EngineCounters::Add(counters_->ready_event_waits, b.events.size());
  // The timeline's per-tensor phases, from the communicator's phase reports.
  struct Marker {
    Timeline* timeline;
    const std::vector<TensorEntry*>* done;
  } marker{timeline_, &b.done};
  Communicator::PhaseObserver observer;
  if (timeline_->enabled()) {
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
    NVG_RETURN_IF_ERROR(comm->FusedAllreduce(b.members.data(), b.members.size(), bucket.bytes, first.dtype,
                                             op, first.prescale_factor, postscale, nullptr, observer));
  NVG_RETURN_IF_ERROR(DelayBucket(comm));
  completion_.CompleteAfterStream(comm, b.done);
  return Status::Ok();
}

Status Execution::RunAllreduceAlone(const BucketMember& m) {
  const ResponseMessage& r = *m.response;
  const CollectiveRequest& q = m.entry->request;
  StatusOr<Communicator*> comm_or = GetCommunicator(q.device);
  if (!comm_or.ok()) return comm_or.status();
  Communicator* comm = comm_or.value();
  const size_t count = static_cast<size_t>(NumElements(r.shape));
  const auto [op, postscale] = ReductionFor(r, size_);  // averaging.h
  EngineCounters::Add(counters_->buckets);
  EngineCounters::Add(counters_->bucket_tensors);
  NVG_RETURN_IF_ERROR(comm->WaitEvent(q.ready_event, nullptr));
  if (timeline_->enabled()) timeline_->Begin(q.name, "ALLREDUCE", MonotonicSeconds());
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
  if (timeline_->enabled()) timeline_->End(q.name, "ALLREDUCE", MonotonicSeconds());
  NVG_RETURN_IF_ERROR(DelayBucket(comm));
  completion_.CompleteAfterStream(comm, {m.entry});
  return Status::Ok();
}

// Note [Outputs sized by negotiation]
// Allgather, reducescatter and alltoall learn their output's shape from the
// response and ask the adapter for the memory (allocate_output). The other
// ranks are already inside the collective by then, so a failure on this rank
// must not keep it out: a CPU request takes part with host scratch memory of
// the output's size and fails with the allocation's error after the
// collective (the other ranks' results are unaffected); a CUDA request has
// no host stand-in and returns the error before its collective, as a failed
// communicator call would (RunBucket fails the request with it).
Status Execution::AllocateOutput(const CollectiveRequest& q, const std::vector<int64_t>& shape, size_t bytes,
                                 const char* collective, NegotiatedOutput* out) {
  Status alloc = q.allocate_output(shape, &out->data);
  if (alloc.ok() && (out->data != nullptr || bytes == 0)) return Status::Ok();
  if (alloc.ok()) alloc = Status::Internal("allocate_output returned no buffer");
  alloc = alloc.WithContext(std::string("allocating the ") + collective + " output");
  if (q.device.kind != DeviceKind::kCpu) return alloc;
  out->scratch.resize(std::max<size_t>(bytes, 1));
  out->data = out->scratch.data();
  out->failure = alloc;
  return Status::Ok();
}

Status Execution::BeginSingle(Communicator* comm, const CollectiveRequest& q, const char* phase) {
  NVG_RETURN_IF_ERROR(comm->WaitEvent(q.ready_event, nullptr));
  if (timeline_->enabled()) timeline_->Begin(q.name, phase, MonotonicSeconds());
  return Status::Ok();
}

void Execution::FinishSingle(Communicator* comm, Work* w, const char* phase, const Status& failure) {
  if (timeline_->enabled()) timeline_->End(w->pending->entry.request.name, phase, MonotonicSeconds());
  if (!failure.ok()) {
    Complete(w->pending.get(), failure);
    return;
  }
  completion_.CompleteAfterStream(comm, {&w->pending->entry});
}

Status Execution::RunAllgather(Work* w) {
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
  NegotiatedOutput out;
  NVG_RETURN_IF_ERROR(AllocateOutput(q, out_shape,
                                     static_cast<size_t>(NumElements(out_shape)) * DataTypeSize(r.dtype),
                                     "allgather", &out));
  NVG_RETURN_IF_ERROR(BeginSingle(comm, q, "ALLGATHER"));
  NVG_RETURN_IF_ERROR(comm->Allgatherv(q.input, out.data, bytes_per_rank, nullptr));
  FinishSingle(comm, w, "ALLGATHER", out.failure);
  return Status::Ok();
}

Status Execution::RunBroadcast(Work* w) {
  const ResponseMessage& r = *w->response;
  const CollectiveRequest& q = w->pending->entry.request;
  StatusOr<Communicator*> comm_or = GetCommunicator(q.device);
  if (!comm_or.ok()) return comm_or.status();
  Communicator* comm = comm_or.value();
  const size_t bytes = static_cast<size_t>(NumElements(r.shape)) * DataTypeSize(r.dtype);
  NVG_RETURN_IF_ERROR(BeginSingle(comm, q, "BROADCAST"));
  if (rank_ == r.root_rank && q.input != q.output && bytes > 0) {
    Communicator::CopySpec copy{q.input, q.output, bytes};
    NVG_RETURN_IF_ERROR(comm->BatchedScaledCopy(&copy, 1, DataType::kUint8, 1.0, nullptr));
  }
  if (bytes > 0) NVG_RETURN_IF_ERROR(comm->Broadcast(q.output, bytes, r.root_rank, nullptr));
  FinishSingle(comm, w, "BROADCAST", Status::Ok());
  return Status::Ok();
}

Status Execution::RunReducescatter(Work* w) {
  const ResponseMessage& r = *w->response;
  const CollectiveRequest& q = w->pending->entry.request;
  StatusOr<Communicator*> comm_or = GetCommunicator(q.device);
  if (!comm_or.ok()) return comm_or.status();
  Communicator* comm = comm_or.value();
  const size_t esize = DataTypeSize(r.dtype);
  const size_t row_elems = static_cast<size_t>(NumElements(Tail(r.shape)));
  std::vector<size_t> counts(size_);
  for (int k = 0; k < size_; ++k)
    counts[k] = static_cast<size_t>(ReducescatterRows(r.shape[0], k, size_)) * row_elems;
  const size_t total = static_cast<size_t>(NumElements(r.shape));
  std::vector<int64_t> out_shape = r.shape;
  out_shape[0] = ReducescatterRows(r.shape[0], rank_, size_);
  const size_t mine = counts[rank_];

  NegotiatedOutput out;
  NVG_RETURN_IF_ERROR(AllocateOutput(q, out_shape, mine * esize, "reducescatter", &out));
  const auto [op, postscale] = ReductionFor(r, size_);  // averaging.h
  NVG_RETURN_IF_ERROR(BeginSingle(comm, q, "REDUCESCATTER"));
  const void* source = q.input;
  std::vector<char> in_scratch;
  if (r.prescale_factor != 1.0 && total > 0) {
    // The scaled input goes into the registered buffer (where the reduction
    // reads it anyway) when it fits, else (host only) into scratch memory.
    void* scaled = nullptr;
    if (total * esize <= comm->registered_capacity()) {
      scaled = comm->registered_buffer();
    } else if (q.device.kind == DeviceKind::kCpu) {
      in_scratch.resize(total * esize);
      scaled = in_scratch.data();
    } else {
      return Status::Unimplemented("reducescatter of '" + q.name +
                                   "' with a prescale factor on CUDA needs the "
                                   "tensor to fit the registered buffer (" +
                                   std::to_string(comm->registered_capacity()) + " bytes)");
    }
    Communicator::CopySpec pre{q.input, scaled, total};
    NVG_RETURN_IF_ERROR(comm->BatchedScaledCopy(&pre, 1, r.dtype, r.prescale_factor, nullptr));
    source = scaled;
  }
  NVG_RETURN_IF_ERROR(comm->ReduceScatter(source, out.data, counts, r.dtype, op, nullptr));
  if (postscale != 1.0 && mine > 0) {
    Communicator::CopySpec post{out.data, out.data, mine};
    NVG_RETURN_IF_ERROR(comm->BatchedScaledCopy(&post, 1, r.dtype, postscale, nullptr));
  }
  FinishSingle(comm, w, "REDUCESCATTER", out.failure);
  return Status::Ok();
}

Status Execution::RunAlltoall(Work* w) {
  const ResponseMessage& r = *w->response;
  const CollectiveRequest& q = w->pending->entry.request;
  StatusOr<Communicator*> comm_or = GetCommunicator(q.device);
  if (!comm_or.ok()) return comm_or.status();
  Communicator* comm = comm_or.value();
  const size_t n = static_cast<size_t>(size_);
  if (r.first_dims.size() != n * n)
    return Status::Internal("alltoall '" + q.name + "': the negotiated splits matrix has " +
                            std::to_string(r.first_dims.size()) + " entries for " + std::to_string(n) +
                            " ranks");
  const size_t row_bytes = static_cast<size_t>(NumElements(Tail(q.shape))) * DataTypeSize(r.dtype);
  std::vector<int64_t> received(n);
  std::vector<size_t> send_bytes(n), recv_bytes(n);
  int64_t rows = 0;
  for (size_t k = 0; k < n; ++k) {
    send_bytes[k] = static_cast<size_t>(r.first_dims[rank_ * n + k]) * row_bytes;
    received[k] = r.first_dims[k * n + rank_];
    recv_bytes[k] = static_cast<size_t>(received[k]) * row_bytes;
    rows += received[k];
  }
  std::vector<int64_t> out_shape = q.shape;
  out_shape[0] = rows;
  if (q.received_splits != nullptr) *q.received_splits = received;
  NegotiatedOutput out;
  NVG_RETURN_IF_ERROR(AllocateOutput(q, out_shape, static_cast<size_t>(rows) * row_bytes, "alltoall", &out));
  NVG_RETURN_IF_ERROR(BeginSingle(comm, q, "ALLTOALL"));
  NVG_RETURN_IF_ERROR(comm->Alltoallv(q.input, send_bytes, out.data, recv_bytes, nullptr));
  FinishSingle(comm, w, "ALLTOALL", out.failure);
  return Status::Ok();
}

Status Execution::RunJoin(Work* w) {
  const CollectiveRequest& q = w->pending->entry.request;
  const int32_t last = w->response->root_rank;
  std::memcpy(q.output, &last, sizeof(last));
  Complete(w->pending.get(), Status::Ok());
  return Status::Ok();
}

}  // namespace nvgroup
