#include "cpu/host_primitives.h"

#include <cstring>
#include <string>

#include "common/checks.h"
#include "cpu/host_reduce.h"
#include "cpu/ordered_allreduce.h"

namespace nvgroup {

HostPrimitives::HostPrimitives(const Topology& topo, ShmGroup* shm, MPI_Comm cross_comm,
                               DataType dtype, ReduceOp op, size_t cross_piece_bytes,
                               std::vector<char>* cross_scratch)
    : topo_(topo),
      shm_(shm),
      cross_comm_(cross_comm),
      dtype_(dtype),
      op_(op),
      esize_(DataTypeSize(dtype)),
      cross_piece_bytes_(cross_piece_bytes),
      cross_scratch_(cross_scratch),
      final_divisor_(op == ReduceOp::kAverage ? topo.size : 1) {}

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

Status HostPrimitives::GroupAllreduce(size_t count, void* out) {
  ChunkSlices whole;
  whole.count = count;
  whole.group_size = topo_.group_size;
  whole.element_size = esize_;
  NVG_RETURN_IF_ERROR(ReduceOwnSlice(whole, final_divisor_));
  NVG_RETURN_IF_ERROR(shm_->Barrier("group allreduce: slices reduced"));
  GatherSlices(whole, out);
  return Status::Ok();
}

Status HostPrimitives::GroupReduceScatter(const ChunkSlices& chunk) {
  return ReduceOwnSlice(chunk, topo_.group_count == 1 ? final_divisor_ : 1);
}

Status HostPrimitives::CrossAllreduce(const ChunkSlices& chunk) {
  if (topo_.group_count == 1) return Status::Ok();
  const int me = topo_.group_rank;
  char* slice = shm_->buffer(me) + chunk.SliceOffset(me) * esize_;
  return OrderedAllreduce(cross_comm_, slice, slice, chunk.SliceCount(me), dtype_, op_,
                          final_divisor_, cross_piece_bytes_, cross_scratch_);
}

Status HostPrimitives::GroupAllgather(const ChunkSlices& chunk, void* out) {
  NVG_RETURN_IF_ERROR(
      shm_->Barrier(("group allgather of chunk " + std::to_string(chunk.index)).c_str()));
  GatherSlices(chunk, out);
  return Status::Ok();
}

}  // namespace nvgroup
