#include "device/device_primitives.h"

#include <climits>
#include <string>

#include "common/cuda_checks.h"

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

Status DevicePrimitives::CrossAllreduce(const ChunkSlices& chunk) {
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
  if (bytes > group_->slice_capacity || bytes > static_cast<size_t>(INT_MAX))
    return Status::Internal("cross-group slice of " + std::to_string(bytes) +
                            " bytes exceeds the exchange buffer of " +
                            std::to_string(group_->slice_capacity));
  const int k = static_cast<int>(chunk.index % 2);
  const int count = static_cast<int>(bytes);
  char* recv = group_->device_recv[k];
  // orders: the slice is read only after this chunk's reduce-scatter kernel
  NVG_CUDA_CHECK(cudaStreamWaitEvent(group_->cross_stream, group_->reduce_scattered[k], 0));
  if (group_->cuda_aware_mpi) {
    // orders: recv[k] is free (fold of chunk index-2 done) and the slice is final
    NVG_CUDA_CHECK(cudaEventSynchronize(group_->folded[k]));
    NVG_CUDA_CHECK(cudaStreamSynchronize(group_->cross_stream));
    NVG_MPI_CHECK(MPI_Allgather(slice, count, MPI_BYTE, recv, count, MPI_BYTE, group_->comms.cross));
  } else {
    NVG_CUDA_CHECK(cudaMemcpyAsync(group_->host_send, slice, bytes, cudaMemcpyDeviceToHost,
                                   group_->cross_stream));
    NVG_CUDA_CHECK(cudaStreamSynchronize(group_->cross_stream));  // host_send is filled
    NVG_MPI_CHECK(MPI_Allgather(group_->host_send, count, MPI_BYTE, group_->host_recv, count,
                                MPI_BYTE, group_->comms.cross));
    // orders: recv[k] is overwritten only after the fold of chunk index-2 read it
    NVG_CUDA_CHECK(cudaStreamWaitEvent(group_->cross_stream, group_->folded[k], 0));
    NVG_CUDA_CHECK(cudaMemcpyAsync(recv, group_->host_recv, bytes * topo.group_count,
                                   cudaMemcpyHostToDevice, group_->cross_stream));
    NVG_CUDA_CHECK(cudaEventRecord(group_->received, group_->cross_stream));
    // orders: the fold below reads recv only after the copy landed
    NVG_CUDA_CHECK(cudaStreamWaitEvent(stream_, group_->received, 0));
    // host_recv is reused by the next chunk as soon as this returns
    NVG_CUDA_CHECK(cudaStreamSynchronize(group_->cross_stream));
  }
  // Fold in group_index order (the cross communicator's rank order).
  NVG_RETURN_IF_ERROR(
      LaunchFoldSources(recv, topo.group_count, slice, n, dtype_, op_, divisor, stream_));
  NVG_CUDA_CHECK(cudaEventRecord(group_->folded[k], stream_));
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
