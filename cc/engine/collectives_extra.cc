#include "engine/collectives_extra.h"

#include <algorithm>
#include <cstring>

#include "common/checks.h"
#include "common/logging.h"
#include "engine/background_loop.h"

namespace nvgroup {

bool AverageByPostscale(const ResponseMessage& r) {
  return IsFloatingPoint(r.dtype) || r.prescale_factor != 1.0 || r.postscale_factor != 1.0;
}

int64_t ReducescatterRows(int64_t dim0, int rank, int size) {
  return dim0 / size + (rank < dim0 % size ? 1 : 0);
}

namespace {

std::vector<int64_t> Tail(const std::vector<int64_t>& shape) {
  return std::vector<int64_t>(shape.begin() + (shape.empty() ? 0 : 1), shape.end());
}

bool StandInPossible(const ResponseMessage& r) {
  return r.ok() && r.device_kind == DeviceKind::kCpu &&
         (r.type == CollectiveType::kAllreduce || r.type == CollectiveType::kReducescatter);
}

}  // namespace

Status Engine::RunReducescatter(Work* w) {
  const ResponseMessage& r = *w->response;
  const CollectiveRequest& q = w->pending->entry.request;
  StatusOr<Communicator*> comm_or = GetCommunicator(q.device);
  if (!comm_or.ok()) return comm_or.status();
  Communicator* comm = comm_or.value();
  const size_t esize = DataTypeSize(r.dtype);
  const size_t row_elems = static_cast<size_t>(NumElements(Tail(r.shape)));
  std::vector<size_t> counts(size_);
  for (int k = 0; k < size_; ++k) counts[k] = static_cast<size_t>(ReducescatterRows(r.shape[0], k, size_)) * row_elems;
  const size_t total = static_cast<size_t>(NumElements(r.shape));
  std::vector<int64_t> out_shape = r.shape;
  out_shape[0] = ReducescatterRows(r.shape[0], rank_, size_);
  const size_t mine = counts[rank_];

  void* out = nullptr;
  Status alloc = q.allocate_output(out_shape, &out);
  // As in RunAllgather: a host allocation failure takes part with scratch
  // memory (the others are already in the collective), then reports.
  std::vector<char> out_scratch;
  if (!alloc.ok() || (out == nullptr && mine > 0)) {
    if (alloc.ok()) alloc = Status::Internal("allocate_output returned no buffer");
    if (q.device.kind != DeviceKind::kCpu) return alloc.WithContext("allocating the reducescatter output");
    out_scratch.resize(std::max<size_t>(mine * esize, 1));
    out = out_scratch.data();
  }
  ReduceOp op = r.op;
  double postscale = r.postscale_factor;
  if (op == ReduceOp::kAverage && AverageByPostscale(r)) {
    op = ReduceOp::kSum;
    postscale /= size_;
  }
  NVG_RETURN_IF_ERROR(comm->WaitEvent(q.ready_event, nullptr));
  if (timeline_.enabled()) timeline_.Begin(q.name, "REDUCESCATTER", MonotonicSeconds());
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
      return Status::Unimplemented("reducescatter of '" + q.name + "' with a prescale factor on CUDA needs the "
                                   "tensor to fit the registered buffer (" +
                                   std::to_string(comm->registered_capacity()) + " bytes)");
    }
    Communicator::CopySpec pre{q.input, scaled, total};
    NVG_RETURN_IF_ERROR(comm->BatchedScaledCopy(&pre, 1, r.dtype, r.prescale_factor, nullptr));
    source = scaled;
  }
  NVG_RETURN_IF_ERROR(comm->ReduceScatter(source, out, counts, r.dtype, op, nullptr));
  if (postscale != 1.0 && mine > 0) {
    Communicator::CopySpec post{out, out, mine};
    NVG_RETURN_IF_ERROR(comm->BatchedScaledCopy(&post, 1, r.dtype, postscale, nullptr));
  }
  if (timeline_.enabled()) timeline_.End(q.name, "REDUCESCATTER", MonotonicSeconds());
  if (!out_scratch.empty() || !alloc.ok()) {
    Complete(w->pending.get(), alloc.WithContext("allocating the reducescatter output"));
    return Status::Ok();
  }
  CompleteAfterStream(comm, {&w->pending->entry});
  return Status::Ok();
}

Status Engine::RunAlltoall(Work* w) {
  const ResponseMessage& r = *w->response;
  const CollectiveRequest& q = w->pending->entry.request;
  StatusOr<Communicator*> comm_or = GetCommunicator(q.device);
  if (!comm_or.ok()) return comm_or.status();
  Communicator* comm = comm_or.value();
  const size_t n = static_cast<size_t>(size_);
  if (r.first_dims.size() != n * n)
    return Status::Internal("alltoall '" + q.name + "': the negotiated splits matrix has " +
                            std::to_string(r.first_dims.size()) + " entries for " + std::to_string(n) + " ranks");
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
  void* out = nullptr;
  Status alloc = q.allocate_output(out_shape, &out);
  std::vector<char> scratch;
  if (!alloc.ok() || (out == nullptr && rows > 0 && row_bytes > 0)) {
    if (alloc.ok()) alloc = Status::Internal("allocate_output returned no buffer");
    if (q.device.kind != DeviceKind::kCpu) return alloc.WithContext("allocating the alltoall output");
    scratch.resize(std::max<size_t>(static_cast<size_t>(rows) * row_bytes, 1));
    out = scratch.data();
  }
  NVG_RETURN_IF_ERROR(comm->WaitEvent(q.ready_event, nullptr));
  if (timeline_.enabled()) timeline_.Begin(q.name, "ALLTOALL", MonotonicSeconds());
  NVG_RETURN_IF_ERROR(comm->Alltoallv(q.input, send_bytes, out, recv_bytes, nullptr));
  if (timeline_.enabled()) timeline_.End(q.name, "ALLTOALL", MonotonicSeconds());
  if (!scratch.empty() || !alloc.ok()) {
    Complete(w->pending.get(), alloc.WithContext("allocating the alltoall output"));
    return Status::Ok();
  }
  CompleteAfterStream(comm, {&w->pending->entry});
  return Status::Ok();
}

Status Engine::RunJoin(Work* w) {
  joined_ = false;
  const CollectiveRequest& q = w->pending->entry.request;
  const int32_t last = w->response->root_rank;
  std::memcpy(q.output, &last, sizeof(last));
  Complete(w->pending.get(), Status::Ok());
  return Status::Ok();
}

std::unique_ptr<Engine::Pending> Engine::MakeJoinStandIn(const ResponseMessage& r) {
  if (!joined_ || !StandInPossible(r)) return nullptr;
  const size_t bytes = static_cast<size_t>(NumElements(r.shape)) * DataTypeSize(r.dtype);
  // Zeros in; the output (allreduce: in place; reducescatter: its own buffer)
  // is discarded. The buffers live as long as the request's callbacks.
  auto zeros = std::make_shared<std::vector<char>>(std::max<size_t>(bytes, 1), 0);
  auto p = std::make_unique<Pending>();
  p->reported = true;
  p->since = MonotonicSeconds();
  CollectiveRequest& q = p->entry.request;
  q.name = r.name;
  q.type = r.type;
  q.dtype = r.dtype;
  q.device = Device::Cpu();
  q.shape = r.shape;
  q.input = zeros->data();
  q.output = zeros->data();
  q.op = r.op;
  q.prescale_factor = r.prescale_factor;
  q.postscale_factor = r.postscale_factor;
  if (r.type == CollectiveType::kReducescatter) {
    auto out = std::make_shared<std::vector<char>>();
    const size_t esize = DataTypeSize(r.dtype);
    q.allocate_output = [out, esize](const std::vector<int64_t>& shape, void** ptr) -> Status {
      out->assign(std::max<size_t>(static_cast<size_t>(NumElements(shape)) * esize, 1), 0);
      *ptr = out->data();
      return Status::Ok();
    };
  }
  q.done = [zeros](const Status&) {};
  p->entry.message.type = r.type;
  return p;
}

void Engine::SetJoinedCacheBits(std::vector<uint64_t>* bits) {
  for (int slot = 0; slot < cache_.capacity(); ++slot) {
    const ResponseMessage& c = cache_.Get(slot);
    if (c.name.empty() || !StandInPossible(c) || pending_.count(c.name)) continue;
    (*bits)[1 + slot / 64] |= uint64_t{1} << (slot % 64);
  }
}

}  // namespace nvgroup
