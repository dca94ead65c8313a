#include "device/device_primitives.h"

#include <climits>
#include <string>
#include <vector>

#include "common/cuda_checks.h"
#include "cpu/host_reduce.h"

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
  const size_t esize = esize_;
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
    job.fold = [dtype, op, esize, divisor](const void* src, int num, void* dst, size_t count) {
      std::vector<const void*> sources(num);
      for (int s = 0; s < num; ++s) sources[s] = static_cast<const char*>(src) + s * count * esize;
      return ReduceFold(dtype, op, sources.data(), num, dst, count, divisor);
    };
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

}  // namespace nvgroup
