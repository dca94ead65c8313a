#include "device/device_primitives.h"

#include <climits>
#include <string>
#include <vector>

#include "common/cuda_checks.h"
#include "cpu/host_reduce.h"
#include "kernels/reduce_scatter.h"

namespace nvgroup {

DevicePrimitives::DevicePrimitives(DeviceGroup* group, const void* in, bool in_registered,
                                   size_t registered_offset, DataType dtype, ReduceOp op,
                                   cudaStream_t stream)
    : group_(group),
      in_(in),
      in_registered_(in_registered),
      registered_offset_(registered_offset),
      dtype_(dtype),
      op_(op),
      esize_(DataTypeSize(dtype)),
      stream_(stream) {}

char* DevicePrimitives::Registered(int member) const {
  return group_->region->data(member) + registered_offset_;
}

P2pLaunch DevicePrimitives::BaseLaunch(size_t count, int max_blocks) {
  P2pLaunch a;
  const int g = group_->topo.group_size;
  for (int p = 0; p < g; ++p) {
    a.peers.flags[p] = group_->region->flags(p);
    a.peers.data[p] = Registered(p);
  }
  a.group_size = g;
  a.group_rank = group_->topo.group_rank;
  a.dtype = dtype_;
  a.op = op_;
  a.count = count;
  // One thread per 16-byte unit of a slice is plenty; small messages use few
  // blocks (fewer flags to exchange), large ones the measured cap.
  const size_t units = (count * esize_ + 15) / 16;
  const size_t want = (units + kThreadsPerBlock - 1) / kThreadsPerBlock;
  const int cap = std::min(max_blocks, group_->block_cap);
  a.blocks = static_cast<int>(std::max<size_t>(1, std::min<size_t>(want, cap)));
  a.control = group_->control_device;
  a.timeout_ns = group_->timeout_ns;
  a.starts_call = !group_->call_started;
  group_->call_started = true;
  return a;
}

Status DevicePrimitives::GroupAllreduce(size_t count, void* out) {
  const int divisor = op_ == ReduceOp::kAverage ? group_->topo.size : 1;
  if (count * esize_ <= group_->tuning.oneshot_max_bytes) {
    P2pLaunch a = BaseLaunch(count, group_->tuning.oneshot_blocks);
    // the kernel picks the half (Note [One-shot staging epoch])
    for (int p = 0; p < a.group_size; ++p) a.peers.data[p] = group_->region->staging(p, 0);
    a.staging_half_bytes = group_->region->staging_bytes();
    a.in = in_;
    a.out = out;
    a.divisor = divisor;
    return LaunchOneShotAllreduce(a, stream_);
  }
  P2pLaunch a = BaseLaunch(count, group_->tuning.twoshot_blocks);
  a.in = in_;
  a.out = out;
  a.divisor = divisor;
  if (in_registered_ && out == in_)  // in place on the registered buffer: no allgather phase
    a.phases = kPhaseReduceScatter | kPhasePushResult;
  else
    a.phases = (in_registered_ ? 0 : kPhasePushScatter) | kPhaseReduceScatter | kPhaseAllgather;
  if (a.phases == (kPhasePushScatter | kPhaseReduceScatter | kPhaseAllgather))
    a.chunk_units = (group_->tuning.twoshot_chunk_bytes + 15) / 16;
  return LaunchTwoShotAllreduce(a, stream_);
}

Status DevicePrimitives::GroupReduceScatter(const ChunkSlices& chunk) {
  if (group_->topo.group_size > 1) {
    P2pLaunch a = BaseLaunch(chunk.count, group_->tuning.twoshot_blocks);
    for (int p = 0; p < a.group_size; ++p) a.peers.data[p] += chunk.offset * esize_;
    a.phases = kPhaseReduceScatter;  // sums only: the fold over groups divides
    NVG_RETURN_IF_ERROR(LaunchTwoShotAllreduce(a, stream_));
  }
  // orders: CrossAllreduce of this chunk reads the slice only after this point
  NVG_CUDA_CHECK(cudaEventRecord(group_->reduce_scattered[chunk.index % 2], stream_));
  return Status::Ok();
}

namespace {

// *done = whether `e` completed; a CUDA error is a Status.
Status EventDone(cudaEvent_t e, bool* done) {
  cudaError_t q = cudaEventQuery(e);
  if (q == cudaErrorNotReady) {
    *done = false;
    return Status::Ok();
  }
  NVG_CUDA_CHECK(q);
  *done = true;
  return Status::Ok();
}

}  // namespace

Status DevicePrimitives::CrossStart(const ChunkSlices& chunk) {
  const Topology& topo = group_->topo;
  const size_t n = chunk.SliceCount(topo.group_rank);
  if (n == 0) return Status::Ok();  // same slice geometry on every peer: all skip
  char* slice = group_->region->data(topo.group_rank) + registered_offset_ +
                chunk.SliceOffset(topo.group_rank) * esize_;
  const int divisor = op_ == ReduceOp::kAverage ? topo.size : 1;
  if (topo.group_count == 1)  // forced hierarchy on one group: only the division is left
    return divisor > 1
               ? LaunchFoldSources(slice, 1, slice, n, dtype_, op_, divisor, stream_)
               : Status::Ok();

  const size_t bytes = n * esize_;
  if (bytes > group_->slice_capacity || group_->cross == nullptr)
    return Status::Internal("cross-group slice of " + std::to_string(bytes) +
                            " bytes exceeds the exchange buffer of " +
                            std::to_string(group_->slice_capacity));
  const int k = static_cast<int>(chunk.index % 2);
  if (in_flight_[k])
    return Status::Internal("cross-group buffers of parity " + std::to_string(k) + " still in use");
  DeviceGroup* g = group_;
  const int device = g->device;
  const DataType dtype = dtype_;
  const ReduceOp op = op_;
  CrossExchange::Job job;
  job.count = n;
  job.element_size = esize_;
  if (g->cuda_aware_mpi) {
    job.send = slice;
    job.recv = g->device_recv[k];
    job.result = slice;
    cudaEvent_t rs = g->reduce_scattered[k];
    job.ready = [device, rs](bool* ready) {
      NVG_CUDA_CHECK(cudaSetDevice(device));
      return EventDone(rs, ready);  // the slice is final (its RS kernel finished)
    };
    cudaStream_t fs = g->fold_stream;
    job.fold = [device, fs, dtype, op, divisor](const void* src, int num, void* dst, size_t count) {
      NVG_CUDA_CHECK(cudaSetDevice(device));
      NVG_RETURN_IF_ERROR(LaunchFoldSources(src, num, dst, count, dtype, op, divisor, fs));
      NVG_CUDA_CHECK(cudaStreamSynchronize(fs));  // orders: the allgatherv reads the fold's result
      return Status::Ok();
    };
  } else {
    // orders: the slice is read only after this chunk's reduce-scatter kernel
    NVG_CUDA_CHECK(cudaStreamWaitEvent(g->cross_stream, g->reduce_scattered[k], 0));
    NVG_CUDA_CHECK(cudaMemcpyAsync(g->host_send[k], slice, bytes, cudaMemcpyDeviceToHost,
                                   g->cross_stream));
    NVG_CUDA_CHECK(cudaEventRecord(g->staged[k], g->cross_stream));
    job.send = g->host_send[k];
    job.recv = g->host_recv[k];
    job.result = g->host_result[k];
    cudaEvent_t staged = g->staged[k], returned = g->returned[k];
    job.ready = [device, staged, returned](bool* ready) {
      NVG_CUDA_CHECK(cudaSetDevice(device));
      // orders: send[k] holds the slice, and result[k] (written by this job's
      // fold and allgatherv) was copied back for chunk index-2
      NVG_RETURN_IF_ERROR(EventDone(staged, ready));
      if (*ready) NVG_RETURN_IF_ERROR(EventDone(returned, ready));
      return Status::Ok();
    };
    job.fold = ContiguousHostFold(dtype, op, divisor);
    char* result = g->host_result[k];
    cudaStream_t h2d = g->h2d_stream;
    job.done = [device, slice, result, bytes, h2d, returned]() {
      NVG_CUDA_CHECK(cudaSetDevice(device));
      NVG_CUDA_CHECK(cudaMemcpyAsync(slice, result, bytes, cudaMemcpyHostToDevice, h2d));
      NVG_CUDA_CHECK(cudaEventRecord(returned, h2d));
      return Status::Ok();
    };
  }
  NVG_RETURN_IF_ERROR(g->cross->Start(std::move(job), &ticket_[k]));
  in_flight_[k] = true;
  return Status::Ok();
}

Status DevicePrimitives::CrossFinish(const ChunkSlices& chunk) {
  const int k = static_cast<int>(chunk.index % 2);
  if (!in_flight_[k]) return Status::Ok();
  in_flight_[k] = false;
  NVG_RETURN_IF_ERROR(group_->cross->Wait(ticket_[k]));
  // orders: the allgather kernel reads the slice after the copy back landed
  // (returned[k] was recorded before the job finished; CUDA-aware: the slice
  // was written host-synchronously, nothing to wait for)
  if (!group_->cuda_aware_mpi)
    NVG_CUDA_CHECK(cudaStreamWaitEvent(stream_, group_->returned[k], 0));
  return Status::Ok();
}

Status DevicePrimitives::GroupAllgather(const ChunkSlices& chunk, void* out) {
  char* dst = static_cast<char*>(out) + chunk.offset * esize_;
  if (group_->topo.group_size == 1) {
    const char* src = Registered(0) + chunk.offset * esize_;
    if (src != dst)
      NVG_CUDA_CHECK(cudaMemcpyAsync(dst, src, chunk.count * esize_, cudaMemcpyDeviceToDevice,
                                     stream_));
    return Status::Ok();
  }
  P2pLaunch a = BaseLaunch(chunk.count, group_->tuning.twoshot_blocks);
  for (int p = 0; p < a.group_size; ++p) a.peers.data[p] += chunk.offset * esize_;
  a.out = dst;
  a.phases = kPhaseAllgather;
  return LaunchTwoShotAllreduce(a, stream_);
}

DeviceScatterPrimitives::DeviceScatterPrimitives(DeviceGroup* group, const void* in, bool in_registered,
                                                 void* out, DataType dtype, ReduceOp op, int row_block_cap,
                                                 cudaStream_t stream)
    : group_(group),
      plan_(group->row_plan),
      in_(static_cast<const char*>(in)),
      in_registered_(in_registered),
      out_(static_cast<char*>(out)),
      dtype_(dtype),
      op_(op),
      esize_(DataTypeSize(dtype)),
      row_block_cap_(row_block_cap),
      stream_(stream) {}

Status DeviceScatterPrimitives::GroupFold(const RowChunk& chunk) {
  DeviceGroup* g = group_;
  const Topology& topo = g->topo;
  const int k = static_cast<int>(chunk.index % 2);
  const int P = plan_.peers();
  if (plan_.SendCount(chunk) * esize_ > g->slice_capacity)
    return Status::Internal("reducescatter chunk of " + std::to_string(plan_.SendCount(chunk) * esize_) +
                            " bytes exceeds the cross-step buffer of " + std::to_string(g->slice_capacity));
  // orders: the copy of chunk index-2 out of row_send[k] was read before we overwrite it
  NVG_CUDA_CHECK(cudaStreamWaitEvent(stream_, g->staged[k], 0));
  char* send = g->row_send[k];
  if (topo.group_size == 1) {
    for (int j = 0; j < P; ++j) {
      const size_t n = plan_.PartCount(chunk, j);
      if (n > 0)
        NVG_CUDA_CHECK(cudaMemcpyAsync(send, in_ + plan_.PartBegin(chunk, j) * esize_, n * esize_,
                                       cudaMemcpyDeviceToDevice, stream_));
      send += n * esize_;
    }
  } else {
    const int G = topo.group_size;
    RowScatterLaunch l;
    P2pLaunch& a = l.base;
    for (int p = 0; p < G; ++p) {
      a.peers.flags[p] = g->region->flags(p);
      a.peers.data[p] = g->region->data(p);
    }
    a.group_size = G;
    a.group_rank = topo.group_rank;
    a.dtype = dtype_;
    a.op = op_;
    a.divisor = 1;  // the fold over groups divides
    a.count = chunk.piece_count;
    // One thread per 16-byte unit of the piece, capped (the same on every member).
    const size_t units = (chunk.piece_count * esize_ + 15) / 16;
    const size_t want = (units + kThreadsPerBlock - 1) / kThreadsPerBlock;
    const int cap = std::max(1, std::min(g->tuning.twoshot_blocks, row_block_cap_));
    a.blocks = static_cast<int>(std::max<size_t>(1, std::min<size_t>(want, cap)));
    a.control = g->control_device;
    a.timeout_ns = g->timeout_ns;
    for (int j0 = 0; j0 < P; j0 += kMaxRowRanges) {
      const bool copy_in = chunk.first_of_piece() && j0 == 0 && !in_registered_;
      a.in = copy_in ? in_ + chunk.piece_begin * esize_ : nullptr;
      a.starts_call = !g->call_started;
      g->call_started = true;
      l.num_ranges = std::min(kMaxRowRanges, P - j0);
      for (int r = 0; r < l.num_ranges; ++r) {
        const size_t n = plan_.PartCount(chunk, j0 + r);
        RowRange& range = l.ranges[r];
        range.lo = n > 0 ? plan_.PartBegin(chunk, j0 + r) - chunk.piece_begin : 0;
        range.hi = range.lo + n;
        range.out = send;
        send += n * esize_;
      }
      NVG_RETURN_IF_ERROR(LaunchRowReduceScatter(l, stream_));
    }
  }
  // orders: the cross step reads row_send[k] only after this point
  NVG_CUDA_CHECK(cudaEventRecord(g->reduce_scattered[k], stream_));
  return Status::Ok();
}

Status DeviceScatterPrimitives::CrossStart(const RowChunk& chunk) {
  DeviceGroup* g = group_;
  const int k = static_cast<int>(chunk.index % 2);
  if (in_flight_[k])
    return Status::Internal("cross-group buffers of parity " + std::to_string(k) + " still in use");
  const size_t send_bytes = plan_.SendCount(chunk) * esize_;
  if (send_bytes == 0) return Status::Ok();  // nothing for our group rank: every peer skips
  if (g->cross == nullptr) return Status::Internal("cross-group step without a CrossExchange");
  const int P = plan_.peers();
  std::vector<size_t>& parts = g->row_parts[k];
  parts.resize(P);
  for (int j = 0; j < P; ++j) parts[j] = plan_.PartCount(chunk, j);
  const size_t mine = parts[plan_.me()];
  const size_t mine_bytes = mine * esize_;
  char* result = mine > 0 ? out_ + (plan_.PartBegin(chunk, plan_.me()) - plan_.my_offset()) * esize_ : nullptr;
  const int device = g->device;
  const DataType dtype = dtype_;
  const ReduceOp op = op_;
  const int divisor = op_ == ReduceOp::kAverage ? g->topo.size : 1;
  CrossExchange::ScatterJob job;
  job.part_counts = parts.data();
  job.element_size = esize_;
  if (g->cuda_aware_mpi) {
    job.send = g->row_send[k];
    job.recv = g->device_recv[k];
    job.result = result;
    cudaEvent_t rs = g->reduce_scattered[k];
    job.ready = [device, rs](bool* ready) {
      NVG_CUDA_CHECK(cudaSetDevice(device));
      return EventDone(rs, ready);  // the parts are final (their fold finished)
    };
    cudaStream_t fs = g->fold_stream;
    job.fold = [device, fs, dtype, op, divisor](const void* src, int num, void* dst, size_t count) {
      NVG_CUDA_CHECK(cudaSetDevice(device));
      NVG_RETURN_IF_ERROR(LaunchFoldSources(src, num, dst, count, dtype, op, divisor, fs));
      NVG_CUDA_CHECK(cudaStreamSynchronize(fs));  // orders: `out` is final when the job finished
      return Status::Ok();
    };
  } else {
    // orders: the parts are read only after their fold kernel
    NVG_CUDA_CHECK(cudaStreamWaitEvent(g->cross_stream, g->reduce_scattered[k], 0));
    NVG_CUDA_CHECK(cudaMemcpyAsync(g->host_send[k], g->row_send[k], send_bytes, cudaMemcpyDeviceToHost,
                                   g->cross_stream));
    NVG_CUDA_CHECK(cudaEventRecord(g->staged[k], g->cross_stream));
    job.send = g->host_send[k];
    job.recv = g->host_recv[k];
    job.result = g->host_result[k];
    cudaEvent_t staged = g->staged[k], returned = g->returned[k];
    job.ready = [device, staged, returned](bool* ready) {
      NVG_CUDA_CHECK(cudaSetDevice(device));
      // orders: host_send[k] holds the parts, and host_result[k] (written by
      // this job's fold) was copied out for chunk index-2
      NVG_RETURN_IF_ERROR(EventDone(staged, ready));
      if (*ready) NVG_RETURN_IF_ERROR(EventDone(returned, ready));
      return Status::Ok();
    };
    job.fold = ContiguousHostFold(dtype, op, divisor);
    char* host_result = g->host_result[k];
    cudaStream_t h2d = g->h2d_stream;
    job.done = [device, result, host_result, mine_bytes, h2d, returned]() {
      NVG_CUDA_CHECK(cudaSetDevice(device));
      if (mine_bytes > 0)
        NVG_CUDA_CHECK(cudaMemcpyAsync(result, host_result, mine_bytes, cudaMemcpyHostToDevice, h2d));
      NVG_CUDA_CHECK(cudaEventRecord(returned, h2d));
      return Status::Ok();
    };
  }
  NVG_RETURN_IF_ERROR(g->cross->StartReduceScatter(std::move(job), &ticket_[k]));
  in_flight_[k] = true;
  return Status::Ok();
}

Status DeviceScatterPrimitives::CrossFinish(const RowChunk& chunk) {
  const int k = static_cast<int>(chunk.index % 2);
  if (!in_flight_[k]) return Status::Ok();
  in_flight_[k] = false;
  return group_->cross->Wait(ticket_[k]);
}

Status DeviceScatterPrimitives::Finish() {
  // orders: the caller's later work sees every part copied into `out`
  if (!group_->cuda_aware_mpi)
    for (int k = 0; k < 2; ++k) NVG_CUDA_CHECK(cudaStreamWaitEvent(stream_, group_->returned[k], 0));
  return Status::Ok();
}

}  // namespace nvgroup
