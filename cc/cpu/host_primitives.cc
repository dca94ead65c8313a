#include "cpu/host_primitives.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "common/checks.h"
#include "cpu/host_reduce.h"

namespace nvgroup {

HostPrimitives::HostPrimitives(const Topology& topo, ShmGroup* shm, CrossExchange* cross, DataType dtype,
                               ReduceOp op, std::vector<char>* cross_scratch)
    : topo_(topo),
      shm_(shm),
      cross_(cross),
      dtype_(dtype),
      op_(op),
      esize_(DataTypeSize(dtype)),
      cross_scratch_(cross_scratch),
      final_divisor_(op == ReduceOp::kAverage ? topo.size : 1),
      jobs_(cross) {}

Status HostPrimitives::ReduceOwnSlice(const ChunkSlices& chunk, int average_divisor) {
  const int me = topo_.group_rank;
  const size_t n = chunk.SliceCount(me);
  if (n == 0) return Status::Ok();
  const size_t byte_offset = chunk.SliceOffset(me) * esize_;
  std::vector<const void*> sources(topo_.group_size);
  for (int m = 0; m < topo_.group_size; ++m) sources[m] = shm_->buffer(m) + byte_offset;
  return ReduceFold(dtype_, op_, sources.data(), topo_.group_size, shm_->buffer(me) + byte_offset, n,
                    average_divisor);
}

void HostPrimitives::GatherSlices(const ChunkSlices& chunk, void* out) const {
  for (int m = 0; m < topo_.group_size; ++m) {
    const size_t bytes = chunk.SliceCount(m) * esize_;
    const size_t byte_offset = chunk.SliceOffset(m) * esize_;
    char* dst = static_cast<char*>(out) + byte_offset;
    const char* src = shm_->buffer(m) + byte_offset;
    if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
  }
}

Status HostPrimitives::ReduceAndGatherMembers(const ChunkSlices& whole,
                                              const Communicator::FusedMember* members, size_t num_members,
                                              bool own_from_inputs, double postscale,
                                              const Communicator::PhaseObserver& observer) {
  using Phase = Communicator::FusedPhase;
  const int me = topo_.group_rank, group = topo_.group_size;
  const size_t s0 = whole.SliceOffset(me), s1 = s0 + whole.SliceCount(me);
  char* reg = shm_->buffer(me);
  std::vector<const void*> sources(group);
  for (size_t k = 0; k < num_members; ++k) {
    const Communicator::FusedMember& m = members[k];
    const size_t a = m.offset / esize_, b = a + m.count;
    const size_t lo = std::max(a, s0), hi = std::min(b, s1);
    if (lo >= hi) continue;
    for (int g = 0; g < group; ++g) sources[g] = shm_->buffer(g) + lo * esize_;
    if (own_from_inputs) sources[me] = static_cast<const char*>(m.input) + (lo - a) * esize_;
    NVG_RETURN_IF_ERROR(ReduceFold(dtype_, op_, sources.data(), group, reg + lo * esize_, hi - lo,
                                   final_divisor_));
  }
  NVG_RETURN_IF_ERROR(shm_->Barrier("group allreduce: slices reduced"));
  observer(Phase::kReduce, false);

  observer(Phase::kCopyOut, true);
  for (size_t k = 0; k < num_members; ++k) {
    const Communicator::FusedMember& m = members[k];
    const size_t a = m.offset / esize_, b = a + m.count;
    for (int g = 0; g < group; ++g) {
      const size_t lo = std::max(a, whole.SliceOffset(g)),
                   hi = std::min(b, whole.SliceOffset(g) + whole.SliceCount(g));
      if (lo >= hi) continue;
      NVG_RETURN_IF_ERROR(ScaledCopy(dtype_, shm_->buffer(g) + lo * esize_,
                                     static_cast<char*>(m.output) + (lo - a) * esize_, hi - lo, postscale));
    }
  }
  return Status::Ok();
}

Status HostPrimitives::GroupAllreduce(size_t count, void* out) {
  ChunkSlices whole;
  whole.count = count;
  whole.group_size = topo_.group_size;
  whole.element_size = esize_;
  // The message as one member: in our registered buffer, `out` its output.
  const Communicator::FusedMember message{shm_->buffer(topo_.group_rank), out, count, 0};
  return ReduceAndGatherMembers(whole, &message, 1, false, 1.0, Communicator::PhaseObserver());
}

// See Note [Fused bucket on one group].
Status HostPrimitives::GroupAllreduceMembers(const Communicator::FusedMember* members, size_t num_members,
                                             size_t count, double prescale, double postscale,
                                             const Communicator::PhaseObserver& observer) {
  using Phase = Communicator::FusedPhase;
  const int me = topo_.group_rank;
  char* reg = shm_->buffer(me);
  ChunkSlices whole;
  whole.count = count;
  whole.group_size = topo_.group_size;
  whole.element_size = esize_;
  const size_t s0 = whole.SliceOffset(me), s1 = s0 + whole.SliceCount(me);
  const bool direct = prescale == 1.0;  // our slice read from the inputs themselves
  auto copy_in = [&](const Communicator::FusedMember& m, size_t a, size_t lo, size_t hi) -> Status {
    if (lo >= hi) return Status::Ok();
    return ScaledCopy(dtype_, static_cast<const char*>(m.input) + (lo - a) * esize_, reg + lo * esize_,
                      hi - lo, prescale);
  };
  observer(Phase::kCopyIn, true);
  for (size_t k = 0; k < num_members; ++k) {
    const Communicator::FusedMember& m = members[k];
    const size_t a = m.offset / esize_, b = a + m.count;
    if (!direct) {
      NVG_RETURN_IF_ERROR(copy_in(m, a, a, b));
      continue;
    }
    NVG_RETURN_IF_ERROR(copy_in(m, a, a, std::min(b, s0)));
    NVG_RETURN_IF_ERROR(copy_in(m, a, std::max(a, s1), b));
  }
  observer(Phase::kCopyIn, false);

  observer(Phase::kReduce, true);
  NVG_RETURN_IF_ERROR(shm_->Barrier("allreduce: inputs in place"));
  NVG_RETURN_IF_ERROR(ReduceAndGatherMembers(whole, members, num_members, direct, postscale, observer));
  NVG_RETURN_IF_ERROR(shm_->Barrier("allreduce: reads done"));
  observer(Phase::kCopyOut, false);
  return Status::Ok();
}

Status HostPrimitives::GroupReduceScatter(const ChunkSlices& chunk) {
  return ReduceOwnSlice(chunk, topo_.group_count == 1 ? final_divisor_ : 1);
}

Status HostPrimitives::CrossStart(const ChunkSlices& chunk) {
  if (topo_.group_count == 1) return Status::Ok();
  const int me = topo_.group_rank;
  const size_t n = chunk.SliceCount(me);
  if (n == 0) return Status::Ok();  // the same on every peer (same slice geometry)
  if (cross_ == nullptr) return Status::Internal("cross-group step without a CrossExchange");
  NVG_RETURN_IF_ERROR(jobs_.CheckFree(chunk.index));
  std::vector<char>& scratch = cross_scratch_[chunk.index % 2];
  scratch.resize(std::max(scratch.size(), cross_->RecvBytes(n, esize_)));
  char* slice = shm_->buffer(me) + chunk.SliceOffset(me) * esize_;
  CrossExchange::Job job;
  job.send = slice;
  job.recv = scratch.data();
  job.result = slice;
  job.count = n;
  job.element_size = esize_;
  job.fold = HostFold(dtype_, op_, final_divisor_);
  return jobs_.Start(chunk.index, std::move(job));
}

Status HostPrimitives::CrossFinish(const ChunkSlices& chunk) { return jobs_.Finish(chunk.index); }

Status HostPrimitives::GroupAllgather(const ChunkSlices& chunk, void* out) {
  NVG_RETURN_IF_ERROR(shm_->Barrier(("group allgather of chunk " + std::to_string(chunk.index)).c_str()));
  GatherSlices(chunk, out);
  return Status::Ok();
}

HostScatterPrimitives::HostScatterPrimitives(const Topology& topo, ShmGroup* shm, CrossExchange* cross,
                                             const RowScatterPlan& plan, const void* in, bool in_registered,
                                             void* out, DataType dtype, ReduceOp op,
                                             HostScatterBuffers* buffers)
    : topo_(topo),
      shm_(shm),
      cross_(cross),
      plan_(plan),
      in_(static_cast<const char*>(in)),
      in_registered_(in_registered),
      out_(static_cast<char*>(out)),
      dtype_(dtype),
      op_(op),
      esize_(DataTypeSize(dtype)),
      buf_(buffers),
      jobs_(cross) {
  buf_->sources.resize(topo.group_size);
}

Status HostScatterPrimitives::GroupFold(const RowChunk& chunk) {
  const int G = topo_.group_size;
  if (G > 1 && chunk.first_of_piece()) {
    if (chunk.index > 0) NVG_RETURN_IF_ERROR(shm_->Barrier("reducescatter: reads done"));
    if (!in_registered_)
      std::memcpy(shm_->buffer(topo_.group_rank), in_ + chunk.piece_begin * esize_,
                  chunk.piece_count * esize_);
    NVG_RETURN_IF_ERROR(shm_->Barrier("reducescatter: inputs in place"));
  }
  const int k = static_cast<int>(chunk.index % 2);
  std::vector<char>& send = buf_->send[k];
  send.resize(std::max(send.size(), plan_.SendCount(chunk) * esize_));
  char* dst = send.data();
  for (int j = 0; j < plan_.peers(); ++j) {
    const size_t n = plan_.PartCount(chunk, j);
    if (n == 0) continue;
    const size_t b = plan_.PartBegin(chunk, j);
    if (G == 1) {
      std::memcpy(dst, in_ + b * esize_, n * esize_);
    } else {
      for (int m = 0; m < G; ++m) buf_->sources[m] = shm_->buffer(m) + (b - chunk.piece_begin) * esize_;
      NVG_RETURN_IF_ERROR(ReduceFold(dtype_, op_, buf_->sources.data(), G, dst, n, 1));
    }
    dst += n * esize_;
  }
  return Status::Ok();
}

Status HostScatterPrimitives::CrossStart(const RowChunk& chunk) {
  NVG_RETURN_IF_ERROR(jobs_.CheckFree(chunk.index));
  if (plan_.SendCount(chunk) == 0) return Status::Ok();  // nothing for our group rank: every peer skips
  if (cross_ == nullptr) return Status::Internal("cross-group step without a CrossExchange");
  const int k = static_cast<int>(chunk.index % 2);
  std::vector<size_t>& parts = buf_->parts[k];
  plan_.PartCounts(chunk, &parts);
  const size_t mine = parts[plan_.me()];
  std::vector<char>& recv = buf_->recv[k];
  recv.resize(std::max(recv.size(), std::max<size_t>(1, mine * plan_.peers() * esize_)));
  CrossExchange::ScatterJob job;
  job.send = buf_->send[k].data();
  job.part_counts = parts.data();
  job.recv = recv.data();
  job.result = mine > 0 ? out_ + plan_.MyPartOffset(chunk) * esize_ : nullptr;
  job.element_size = esize_;
  job.fold = HostFold(dtype_, op_, op_ == ReduceOp::kAverage ? topo_.size : 1);
  return jobs_.StartReduceScatter(chunk.index, std::move(job));
}

Status HostScatterPrimitives::CrossFinish(const RowChunk& chunk) { return jobs_.Finish(chunk.index); }

Status HostScatterPrimitives::Finish() {
  if (topo_.group_size > 1) NVG_RETURN_IF_ERROR(shm_->Barrier("reducescatter: reads done"));
  return Status::Ok();
}

}  // namespace nvgroup
