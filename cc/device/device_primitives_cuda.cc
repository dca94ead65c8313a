#include "device/device_primitives.h"

#include <climits>
#include <string>
#include <vector>

#include "common/cuda_checks.h"
#include "cpu/host_reduce.h"
#include "kernels/reduce_scatter.h"

namespace nvgroup {

DevicePrimitives::DevicePrimitives(DeviceGroup* group, const void* in, bool in_registered,
                                   size_t registered_offset, void* out, DataType dtype, ReduceOp op,
                                   cudaStream_t stream)
    : group_(group),
      in_(in),
      in_registered_(in_registered),
      registered_offset_(registered_offset),
      out_(out),
      dtype_(dtype),
      op_(op),
      esize_(DataTypeSize(dtype)),
      stream_(stream),
      jobs_(group->cross.get()) {}

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
  else a.phases = (in_registered_ ? 0 : kPhasePushScatter) | kPhaseReduceScatter | kPhaseAllgather;
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

// The device side of the cross-step job of chunk c (k = c % 2), written once
// for the allreduce (CrossExchange::Job: `device_send` and `device_result` are
// both the chunk's slice) and the reduce-scatter (ScatterJob: `device_send` is
// row_send[k], `device_result` our part of `out`, nullptr when it is empty).
// The job sends `send_bytes` bytes from `device_send`; `result_bytes` bytes of
// its result belong at `device_result`. The caller fills in the counts.
//  * CUDA-aware MPI: the job works on device memory: send = device_send,
//    recv = device_recv[k], result = device_result; ready once
//    reduce_scattered[k] (the kernel that wrote device_send) completed; the
//    fold is the device fold kernel on fold_stream, synchronized before the
//    job goes on (allreduce: the allgather round sends the fold's result;
//    reduce-scatter: `out` is final when the job finished).
//  * Host-staged: cross_stream waits for reduce_scattered[k], copies
//    device_send into pinned host_send[k] and records staged[k]; the job
//    runs on host_send[k] / host_recv[k] / host_result[k], ready once
//    staged[k] completed and writable once returned[k] (the copy of chunk
//    c - 2 out of host_result[k]) completed, with the host fold (ReduceFold,
//    the CPU path's contract); when it is done, h2d_stream copies
//    host_result[k] into device_result and records returned[k].
template <class CrossJob>
Status StageCrossJob(DeviceGroup* g, int k, const char* device_send, size_t send_bytes, char* device_result,
                     size_t result_bytes, DataType dtype, ReduceOp op, int divisor, CrossJob* job) {
  const int device = g->device;
  if (g->cuda_aware_mpi) {
    job->send = device_send;
    job->recv = g->device_recv[k];
    job->result = device_result;
    cudaEvent_t rs = g->reduce_scattered[k];
    job->ready = [device, rs](bool* ready) {
      NVG_CUDA_CHECK(cudaSetDevice(device));
      return EventDone(rs, ready);  // what the job sends is final (the kernel that wrote it finished)
    };
    cudaStream_t fs = g->fold_stream;
    const size_t esize = DataTypeSize(dtype);
    job->fold = [device, fs, dtype, op, divisor, esize](const void* const* sources, int num, void* dst,
                                                        size_t count) {
      // Device buffers: the P copies are contiguous in device_recv[k] (our own
      // share is a message to ourselves, CrossExchangeOptions::host_memory).
      for (int p = 1; p < num; ++p)
        if (static_cast<const char*>(sources[p]) != static_cast<const char*>(sources[0]) + p * count * esize)
          return Status::Internal(
              "device fold: the cross-group copies are not contiguous in the receive buffer");
      NVG_CUDA_CHECK(cudaSetDevice(device));
      NVG_RETURN_IF_ERROR(LaunchFoldSources(sources[0], num, dst, count, dtype, op, divisor, fs));
      NVG_CUDA_CHECK(cudaStreamSynchronize(fs));  // orders: the fold's result is final before the job goes on
      return Status::Ok();
    };
    return Status::Ok();
  }
  // orders: device_send is read only after the kernel of this chunk that wrote it
  NVG_CUDA_CHECK(cudaStreamWaitEvent(g->cross_stream, g->reduce_scattered[k], 0));
  NVG_CUDA_CHECK(cudaMemcpyAsync(g->host_send[k], device_send, send_bytes, cudaMemcpyDeviceToHost,
                                 g->cross_stream));
  NVG_CUDA_CHECK(cudaEventRecord(g->staged[k], g->cross_stream));
  job->send = g->host_send[k];
  job->recv = g->host_recv[k];
  job->result = g->host_result[k];
  cudaEvent_t staged = g->staged[k], returned = g->returned[k];
  job->ready = [device, staged](bool* ready) {
    NVG_CUDA_CHECK(cudaSetDevice(device));
    return EventDone(staged, ready);  // orders: host_send[k] holds what the job sends
  };
  job->writable = [device, returned](bool* writable) {
    NVG_CUDA_CHECK(cudaSetDevice(device));
    return EventDone(returned, writable);  // orders: host_result[k] was copied out for chunk index-2
  };
  job->fold = HostFold(dtype, op, divisor);
  char* host_result = g->host_result[k];
  cudaStream_t h2d = g->h2d_stream;
  job->done = [device, device_result, host_result, result_bytes, h2d, returned]() {
    NVG_CUDA_CHECK(cudaSetDevice(device));
    if (result_bytes > 0)
      NVG_CUDA_CHECK(cudaMemcpyAsync(device_result, host_result, result_bytes, cudaMemcpyHostToDevice, h2d));
    NVG_CUDA_CHECK(cudaEventRecord(returned, h2d));
    return Status::Ok();
  };
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
    return divisor > 1 ? LaunchFoldSources(slice, 1, slice, n, dtype_, op_, divisor, stream_) : Status::Ok();
  // A group of one: the chunk goes from `in` to `out` (see the constructor).
  // It always has other groups here: with one group it would be one rank,
  // whose allreduce returns before the skeleton (AllreduceOnWork).
  const bool group_of_one = topo.group_size == 1;
  const char* send = group_of_one ? static_cast<const char*>(in_) + chunk.offset * esize_ : slice;
  char* result = group_of_one ? static_cast<char*>(out_) + chunk.offset * esize_ : slice;

  const size_t bytes = n * esize_;
  if (group_->cross == nullptr || bytes > group_->slice_capacity ||
      group_->cross->RecvBytes(n, esize_) > group_->recv_capacity)
    return Status::Internal("cross-group slice of " + std::to_string(bytes) +
                            " bytes exceeds the exchange buffers of " +
                            std::to_string(group_->slice_capacity) + " / " +
                            std::to_string(group_->recv_capacity) + " bytes");
  NVG_RETURN_IF_ERROR(jobs_.CheckFree(chunk.index));
  CrossExchange::Job job;
  job.count = n;
  job.element_size = esize_;
  NVG_RETURN_IF_ERROR(StageCrossJob(group_, static_cast<int>(chunk.index % 2), send, bytes, result, bytes,
                                    dtype_, op_, divisor, &job));
  return jobs_.Start(chunk.index, std::move(job));
}

Status DevicePrimitives::CrossFinish(const ChunkSlices& chunk) {
  bool waited = false;
  NVG_RETURN_IF_ERROR(jobs_.Finish(chunk.index, &waited));
  // orders: the allgather kernel reads the slice after the copy back landed
  // (returned[k] was recorded before the job finished; CUDA-aware: the slice
  // was written host-synchronously, nothing to wait for)
  if (waited && !group_->cuda_aware_mpi)
    NVG_CUDA_CHECK(cudaStreamWaitEvent(stream_, group_->returned[chunk.index % 2], 0));
  return Status::Ok();
}

Status DevicePrimitives::GroupAllgather(const ChunkSlices& chunk, void* out) {
  char* dst = static_cast<char*>(out) + chunk.offset * esize_;
  if (out != out_) return Status::Internal("group allgather into another output than the call's");
  // A group of one: the cross step already wrote the chunk of `out` (CrossStart).
  if (group_->topo.group_size == 1) return Status::Ok();
  P2pLaunch a = BaseLaunch(chunk.count, group_->tuning.twoshot_blocks);
  for (int p = 0; p < a.group_size; ++p) a.peers.data[p] += chunk.offset * esize_;
  a.out = dst;
  a.phases = kPhaseAllgather;
  return LaunchTwoShotAllreduce(a, stream_);
}

RowScatterLaunch RowScatterLaunchFor(const DeviceGroup& g, DataType dtype, ReduceOp op, int divisor,
                                     size_t count, int row_block_cap) {
  RowScatterLaunch l;
  P2pLaunch& a = l.base;
  const int G = g.topo.group_size;
  for (int p = 0; p < G; ++p) {
    a.peers.flags[p] = g.region->flags(p);
    a.peers.data[p] = g.region->data(p);
  }
  a.group_size = G;
  a.group_rank = g.topo.group_rank;
  a.dtype = dtype;
  a.op = op;
  a.divisor = divisor;
  a.count = count;
  // One thread per 16-byte unit of the piece, capped (the same on every member).
  const size_t units = (count * DataTypeSize(dtype) + 15) / 16;
  const size_t want = (units + kThreadsPerBlock - 1) / kThreadsPerBlock;
  const int cap = std::max(1, std::min(g.tuning.twoshot_blocks, row_block_cap));
  a.blocks = static_cast<int>(std::max<size_t>(1, std::min<size_t>(want, cap)));
  a.control = g.control_device;
  a.timeout_ns = g.timeout_ns;
  return l;
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
      stream_(stream),
      jobs_(group->cross.get()) {}

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
    // divisor 1: the fold over groups divides
    RowScatterLaunch l = RowScatterLaunchFor(*g, dtype_, op_, 1, chunk.piece_count, row_block_cap_);
    P2pLaunch& a = l.base;
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
  NVG_RETURN_IF_ERROR(jobs_.CheckFree(chunk.index));
  const size_t send_bytes = plan_.SendCount(chunk) * esize_;
  if (send_bytes == 0) return Status::Ok();  // nothing for our group rank: every peer skips
  if (g->cross == nullptr) return Status::Internal("cross-group step without a CrossExchange");
  const int k = static_cast<int>(chunk.index % 2);
  std::vector<size_t>& parts = g->row_parts[k];
  plan_.PartCounts(chunk, &parts);
  const size_t mine = parts[plan_.me()];
  char* result = mine > 0 ? out_ + plan_.MyPartOffset(chunk) * esize_ : nullptr;
  const int divisor = op_ == ReduceOp::kAverage ? g->topo.size : 1;
  CrossExchange::ScatterJob job;
  job.part_counts = parts.data();
  job.element_size = esize_;
  NVG_RETURN_IF_ERROR(StageCrossJob(g, k, g->row_send[k], send_bytes, result, mine * esize_, dtype_, op_,
                                    divisor, &job));
  return jobs_.StartReduceScatter(chunk.index, std::move(job));
}

Status DeviceScatterPrimitives::CrossFinish(const RowChunk& chunk) { return jobs_.Finish(chunk.index); }

Status DeviceScatterPrimitives::Finish() {
  // orders: the caller's later work sees every part copied into `out`
  if (!group_->cuda_aware_mpi)
    for (int k = 0; k < 2; ++k) NVG_CUDA_CHECK(cudaStreamWaitEvent(stream_, group_->returned[k], 0));
  return Status::Ok();
}

}  // namespace nvgroup
