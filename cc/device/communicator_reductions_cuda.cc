// CudaCommunicator (cuda_communicator_impl.h): the reductions -- Allreduce
// and FusedAllreduce (the hierarchical allreduce skeleton over
// DevicePrimitives, or the one-group kernels) and ReduceScatter (the row
// reduce-scatter kernel, or the hierarchical reduce-scatter skeleton over
// DeviceScatterPrimitives) -- and the device pointer check they share.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "algorithms/hierarchical_allreduce.h"
#include "algorithms/hierarchical_reduce_scatter.h"
#include "common/collective_args.h"
#include "common/cuda_checks.h"
#include "device/cuda_communicator_impl.h"
#include "device/device_primitives.h"
#include "kernels/reduce_scatter.h"

namespace nvgroup {

Status CudaCommunicator::CheckDevicePointer(const void* p, const char* what) {
  for (const void* c : checked_)
    if (c == p) return Status::Ok();
  cudaPointerAttributes attr;
  cudaError_t err = cudaPointerGetAttributes(&attr, p);
  if (err != cudaSuccess) (void)cudaGetLastError();
  const bool ok = err == cudaSuccess &&
                  ((attr.type == cudaMemoryTypeDevice && attr.device == group_.device) ||
                   attr.type == cudaMemoryTypeManaged);
  if (!ok)
    return Status::InvalidArgument(std::string(what) +
                                   " pointer is not device memory of cuda:" + std::to_string(group_.device));
  checked_[next_checked_] = p;
  next_checked_ = (next_checked_ + 1) % kCheckedPointers;
  return Status::Ok();
}

Status CudaCommunicator::Allreduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                                   void* stream_arg) {
  NVG_RETURN_IF_ERROR(CheckHealthy());
  if (!SupportsReduction(dtype))
    return Status::InvalidArgument(std::string("allreduce: dtype ") + DataTypeName(dtype) +
                                   " cannot be reduced");
  if (static_cast<int>(op) < 0 || static_cast<int>(op) > static_cast<int>(ReduceOp::kProduct))
    return Status::InvalidArgument("allreduce: unknown reduce op " + std::to_string(static_cast<int>(op)));
  if (count == 0) return Status::Ok();
  if (in == nullptr || out == nullptr)
    return Status::InvalidArgument("allreduce: null input or output pointer with count " +
                                   std::to_string(count));
  NVG_RETURN_IF_ERROR(CheckDevicePointer(in, "allreduce: input"));
  NVG_RETURN_IF_ERROR(CheckDevicePointer(out, "allreduce: output"));
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  const cudaStream_t caller = StreamOf(stream_arg);
  NVG_RETURN_IF_ERROR(Diagnose(EnterWork(caller)));
  group_.call_started = false;  // the call's first kernel starts its deadline
  Status s = AllreduceOnWork(in, out, count, dtype, op, caller);
  Status left = LeaveWork(caller);  // also after a failure: a capture must be joined
  return Diagnose(s.ok() ? left : s);
}

Status CudaCommunicator::AllreduceOnWork(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                                         cudaStream_t caller) {
  const size_t esize = DataTypeSize(dtype);
  const size_t bytes = count * esize;

  if (group_.topo.size == 1) {  // Average over one rank is the identity
    if (in != out) NVG_CUDA_CHECK(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, work_));
    return Status::Ok();
  }
  if (group_.topo.group_count > 1 || force_hierarchy_) {
    auto capturing = Capturing(caller);
    if (!capturing.ok()) return capturing.status();
    if (capturing.value())
      return Status::InvalidArgument(
          "allreduce: the hierarchical path (several NV-groups, or "
          "NVGROUP_ALLREDUCE_ALGORITHM=hierarchical) waits for MPI between its kernels and "
          "cannot be captured in a CUDA graph");
  }

  // Inputs inside the registered buffer are used in place (the engine fuses
  // there at the same offset on every rank); see communicator.h.
  const char* reg = static_cast<const char*>(group_.region->data(group_.topo.group_rank));
  const size_t capacity = group_.region->data_bytes();
  const char* in_c = static_cast<const char*>(in);
  const char* out_c = static_cast<const char*>(out);
  const bool in_reg = in_c >= reg && in_c < reg + capacity;
  const bool out_reg = out_c + bytes > reg && out_c < reg + capacity;
  if (out_reg && out != in)
    return Status::InvalidArgument(
        "allreduce: the output overlaps the registered buffer but is not the input "
        "(only in-place use of the registered buffer is supported)");
  if (in_reg) {
    const size_t offset = in_c - reg;
    if (offset % kSliceAlignBytes != 0 || offset + bytes > capacity)
      return Status::InvalidArgument("allreduce: input at offset " + std::to_string(offset) +
                                     " of the registered buffer with " + std::to_string(bytes) +
                                     " bytes is misaligned or exceeds its " + std::to_string(capacity) +
                                     " bytes");
    return AllreducePiece(in, out, count, true, offset, dtype, op);
  }
  // Any other input: pieces of at most the registered capacity (whole units
  // per group member so every piece stays aligned).
  const size_t piece = PieceElements(capacity, esize, AlignUnitElements(esize) * group_.topo.group_size);
  for (size_t first = 0; first < count; first += piece) {
    const size_t n = std::min(piece, count - first);
    NVG_RETURN_IF_ERROR_CTX(AllreducePiece(in_c + first * esize, static_cast<char*>(out) + first * esize, n,
                                           false, 0, dtype, op),
                            "allreduce of elements " + std::to_string(first) + ".." +
                                std::to_string(first + n));
  }
  return Status::Ok();
}

Status CudaCommunicator::AllreducePiece(const void* in, void* out, size_t count, bool in_registered,
                                        size_t offset, DataType dtype, ReduceOp op) {
  const bool flat = group_.topo.group_count == 1 && !force_hierarchy_;
  // The skeleton of a group of several GPUs starts from the registered buffer
  // (its peers read it); a group of one reads `in` itself (DevicePrimitives).
  if (!flat && !in_registered && group_.topo.group_size > 1) {
    NVG_CUDA_CHECK(cudaMemcpyAsync(registered_buffer(), in, count * DataTypeSize(dtype),
                                   cudaMemcpyDeviceToDevice, work_));
    in = registered_buffer();
    in_registered = true;
  }
  DevicePrimitives prims(&group_, in, in_registered, offset, out, dtype, op, work_);
  NVG_RETURN_IF_ERROR(RunHierarchicalAllreduce(prims, count, out, chunking_, force_hierarchy_));
  return Status::Ok();
}

// ReduceScatter on the device. All ranks in one NV-group of several GPUs: the
// group reduce-scatter phase itself with the caller's row split
// (GroupRowReduceScatter: the row reduce-scatter kernel, protocol in
// cc/kernels/reduce_scatter.cu): each GPU folds only its own elements over the
// members' registered buffers and writes them straight into `out`. Several
// groups: the hierarchical reduce-scatter (HierarchicalReduceScatter; the
// skeleton of cc/algorithms/hierarchical_reduce_scatter.h over
// DeviceScatterPrimitives): the same kernel folds, for this group rank, the
// rows of every group's rank of that group rank, and the cross step
// reduce-scatters them among the peers through pinned host memory. Either
// way nothing is allocated per call and every element gets the allreduce's
// bits (the same fold order).
Status CudaCommunicator::ReduceScatter(const void* in, void* out, const std::vector<size_t>& counts,
                                       DataType dtype, ReduceOp op, void* stream_arg) {
  NVG_RETURN_IF_ERROR(CheckHealthy());
  if (!SupportsReduction(dtype))
    return Status::InvalidArgument(std::string("reducescatter: dtype ") + DataTypeName(dtype) +
                                   " cannot be reduced");
  if (static_cast<int>(op) < 0 || static_cast<int>(op) > static_cast<int>(ReduceOp::kProduct))
    return Status::InvalidArgument("reducescatter: unknown reduce op " +
                                   std::to_string(static_cast<int>(op)));
  const int size = group_.topo.size;
  const size_t esize = DataTypeSize(dtype);
  ReduceScatterSplit split;
  NVG_RETURN_IF_ERROR(CheckReduceScatter(in, out, counts, esize, group_.topo.rank, size, registered_buffer(),
                                         registered_capacity(), &split));
  const size_t total = split.total, my_offset = split.offset, mine = split.mine;
  const bool in_registered = split.in_registered;
  if (total == 0) return Status::Ok();
  NVG_RETURN_IF_ERROR(CheckDevicePointer(in, "reducescatter: input"));
  if (mine > 0) NVG_RETURN_IF_ERROR(CheckDevicePointer(out, "reducescatter: output"));
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  const cudaStream_t caller = StreamOf(stream_arg);
  const bool one_group = group_.topo.group_count == 1 && group_.topo.group_size > 1;
  if (!one_group && size > 1) {
    auto capturing = Capturing(caller);
    if (!capturing.ok()) return capturing.status();
    if (capturing.value())
      return Status::InvalidArgument(
          "reducescatter over several NV-groups waits for MPI between its kernels and cannot be "
          "captured in a CUDA graph");
  }
  NVG_RETURN_IF_ERROR(Diagnose(EnterWork(caller)));
  group_.call_started = false;  // the call's first kernel starts its deadline
  Status s;
  if (size == 1) {  // every op over one rank is the identity
    cudaError_t e = cudaMemcpyAsync(out, in, total * esize, cudaMemcpyDeviceToDevice, work_);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      s = Status::Internal(std::string("cudaMemcpyAsync (reducescatter on one rank) failed: ") +
                           cudaGetErrorString(e));
    }
  } else if (one_group) {
    s = GroupRowReduceScatter(in, out, total, my_offset, mine, in_registered, dtype, op);
  } else {
    s = HierarchicalReduceScatter(in, out, counts, in_registered, dtype, op);
  }
  Status left = LeaveWork(caller);  // also after a failure: a capture must be joined
  return Diagnose(s.ok() ? left : s);
}

// One launch of the row reduce-scatter kernel per piece of at most the
// registered capacity (whole 16-byte units, so each piece starts aligned);
// every member launches the same pieces with the same grid.
Status CudaCommunicator::GroupRowReduceScatter(const void* in, void* out, size_t total, size_t my_offset,
                                               size_t mine, bool in_registered, DataType dtype, ReduceOp op) {
  const size_t esize = DataTypeSize(dtype);
  const size_t piece = in_registered ? total
                                     : PieceElements(registered_capacity(), esize, AlignUnitElements(esize));
  const int divisor = op == ReduceOp::kAverage ? group_.topo.size : 1;
  for (size_t p0 = 0; p0 < total; p0 += piece) {
    const size_t n = std::min(piece, total - p0);
    RowScatterLaunch l = RowScatterLaunchFor(group_, dtype, op, divisor, n, row_scatter_block_cap_);
    P2pLaunch& a = l.base;
    a.in = in_registered ? nullptr : static_cast<const char*>(in) + p0 * esize;
    a.starts_call = !group_.call_started;
    group_.call_started = true;
    const size_t lo = std::max(p0, my_offset), hi = std::min(p0 + n, my_offset + mine);
    l.num_ranges = 1;
    if (lo < hi) {
      l.ranges[0].lo = lo - p0;
      l.ranges[0].hi = hi - p0;
      l.ranges[0].out = static_cast<char*>(out) + (lo - my_offset) * esize;
    }
    NVG_RETURN_IF_ERROR_CTX(LaunchRowReduceScatter(l, work_), "row reduce-scatter of elements " +
                                                                  std::to_string(p0) + ".." +
                                                                  std::to_string(p0 + n));
  }
  return Status::Ok();
}

// Several groups: pieces of the registered capacity (whole 16-byte units, so
// each piece starts aligned) when G > 1, the whole message with groups of one
// GPU (nothing is read from a peer); a rank's parts of one chunk fit the
// cross step's buffers (slice_capacity bytes; the receive buffer P copies of
// one part). The plan is the same on every rank (same counts, owner table,
// pieces and capacities).
Status CudaCommunicator::HierarchicalReduceScatter(const void* in, void* out,
                                                   const std::vector<size_t>& counts, bool in_registered,
                                                   DataType dtype, ReduceOp op) {
  const Topology& topo = group_.topo;
  const size_t esize = DataTypeSize(dtype);
  size_t total = 0;
  for (size_t c : counts) total += c;
  const size_t piece = topo.group_size == 1 || in_registered
                           ? total
                           : PieceElements(registered_capacity(), esize, AlignUnitElements(esize));
  const size_t send_capacity = group_.slice_capacity / esize;
  const size_t recv_capacity =
      (group_.slice_capacity + kSliceAlignBytes * static_cast<size_t>(topo.group_count)) / esize;
  NVG_RETURN_IF_ERROR(group_.row_plan.Build(counts, group_.row_owners, topo.group_rank, topo.group_index,
                                            piece, send_capacity, recv_capacity));
  DeviceScatterPrimitives prims(&group_, in, in_registered, out, dtype, op, row_scatter_block_cap_, work_);
  return RunHierarchicalReduceScatter(prims, group_.row_plan);
}

// The engine's fused bucket (communicator.h; protocol in cc/kernels/batched_copy.cu,
// "Fused buckets"). One rank: no registered buffer, the members' scaled copy
// input -> output is one batched launch (none when every member is in place
// with unit scales). Several ranks: the members' copy into the registered
// buffer stays (the group's kernels read it over CUDA IPC), then the in-place
// allreduce, then one batched launch out of the buffer into the outputs.
Status CudaCommunicator::FusedAllreduce(const FusedMember* members, size_t num_members, size_t bytes,
                                        DataType dtype, ReduceOp op, double prescale, double postscale,
                                        void* stream, const PhaseObserver& observer) {
  NVG_RETURN_IF_ERROR(CheckHealthy());
  if (!SupportsReduction(dtype))
    return Status::InvalidArgument(std::string("allreduce: dtype ") + DataTypeName(dtype) +
                                   " cannot be reduced");
  if (static_cast<int>(op) < 0 || static_cast<int>(op) > static_cast<int>(ReduceOp::kProduct))
    return Status::InvalidArgument("allreduce: unknown reduce op " + std::to_string(static_cast<int>(op)));
  if (bytes > registered_capacity())
    return Status::InvalidArgument("fused allreduce of " + std::to_string(bytes) +
                                   " bytes exceeds the registered buffer (" +
                                   std::to_string(registered_capacity()) + " bytes)");
  if (group_.topo.size == 1)
    return FusedAllreduceOneRank(members, num_members, dtype, prescale, postscale, stream, observer);
  return FusedAllreduceThroughBuffer(members, num_members, bytes, dtype, op, prescale, postscale, stream,
                                     observer);
}

}  // namespace nvgroup
