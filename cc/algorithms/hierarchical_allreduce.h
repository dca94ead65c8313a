// The NV-group hierarchical allreduce, written once for every device.
//
// How it works. The ranks form groups of G members (see communicator.h). The
// message (the `count` elements of one Allreduce call, already in this rank's
// registered buffer) is cut into *chunks* of at most `chunk_bytes`; each chunk is
// cut into G *slices*, slice r owned by group rank r. Every chunk goes through
// three *steps*:
//
//   1. GroupReduceScatter(chunk): group rank r reduces slice r of the chunk over
//      all G members' registered buffers (direct loads: NVLink peer reads via
//      CUDA IPC, or POSIX shared memory), in group_rank order, and leaves the
//      result in slice r of its own registered buffer.
//   2. CrossAllreduce(chunk): slice r is allreduced with the rank of group rank
//      r in every other group (the *peers*), in group_index order (MPI; through
//      pinned host memory when MPI is not CUDA-aware). Each rank sends 1/G of
//      the chunk, so every GPU and every link carries 1/G of the traffic.
//   3. GroupAllgather(chunk, out): every member copies all G reduced slices of
//      the chunk into `out`.
//
// Pipelining: step 1 of chunk c+1 is issued before step 2 of chunk c, so on a
// GPU the NVLink kernel of the next chunk runs while this chunk crosses groups
// (the primitives' steps 1 and 3 are asynchronous on the device stream, step 2
// waits for step 1 of its own chunk only). On the CPU the steps run in order.
//
// With one group (G == size) there is nothing to cross: the primitives' whole-
// message GroupAllreduce runs instead (one-shot or two-shot, by size).
//
// Determinism: each element is reduced in one fixed order (members by
// group_rank inside step 1, groups by group_index in step 2) regardless of which
// rank computes it, so all ranks hold bitwise identical results.
//
// The primitives type P (HostPrimitives in cc/cpu, DevicePrimitives in
// cc/device) provides, for the call being run:
//   const Topology& topology() const;
//   size_t element_size() const;              // bytes per element of the call's dtype
//   Status GroupAllreduce(size_t count, void* out);
//   Status GroupReduceScatter(const ChunkSlices& chunk);
//   Status CrossAllreduce(const ChunkSlices& chunk);
//   Status GroupAllgather(const ChunkSlices& chunk, void* out);
// Offsets and counts are in elements of the registered buffer / of `out`.
#pragma once

#include <algorithm>
#include <cstddef>

#include "common/checks.h"
#include "nvgroup/communicator.h"
#include "nvgroup/status.h"

namespace nvgroup {

// One chunk and its G slices. Slices are contiguous, in group_rank order,
// cover the chunk exactly, and all but the last start on a multiple of
// `kSliceAlignBytes` so 16-byte vector loads stay aligned.
struct ChunkSlices {
  static constexpr size_t kSliceAlignBytes = 16;  // one 16-byte vector load
  size_t index = 0;         // chunk number within the message
  size_t offset = 0;        // first element of the chunk
  size_t count = 0;         // elements in the chunk
  int group_size = 1;
  size_t element_size = 4;

  // Slice r of this chunk: [SliceOffset(r), SliceOffset(r) + SliceCount(r)).
  size_t SliceOffset(int r) const { return offset + std::min(count, r * SliceStride()); }
  size_t SliceCount(int r) const {
    size_t begin = std::min(count, r * SliceStride());
    size_t end = r + 1 == group_size ? count : std::min(count, (r + 1) * SliceStride());
    return end - begin;
  }

 private:
  // Elements per slice, rounded up to the alignment unit.
  size_t SliceStride() const {
    size_t unit = std::max<size_t>(1, kSliceAlignBytes / element_size);
    size_t per = (count + group_size - 1) / group_size;
    return (per + unit - 1) / unit * unit;
  }
};

template <class Primitives>
Status RunHierarchicalAllreduce(Primitives& prims, size_t count, void* out, size_t chunk_bytes,
                                bool force_hierarchy) {
  const Topology& topo = prims.topology();
  if (count == 0) return Status::Ok();
  if (topo.group_count == 1 && !force_hierarchy) return prims.GroupAllreduce(count, out);

  const size_t esize = prims.element_size();
  // Chunks hold a whole number of 16-byte units per slice: round down to G*16 bytes.
  size_t unit = std::max<size_t>(1, ChunkSlices::kSliceAlignBytes / esize) * topo.group_size;
  size_t chunk_elems = std::max(unit, (chunk_bytes / esize) / unit * unit);
  const size_t num_chunks = (count + chunk_elems - 1) / chunk_elems;

  auto chunk_at = [&](size_t c) {
    ChunkSlices ch;
    ch.index = c;
    ch.offset = c * chunk_elems;
    ch.count = std::min(chunk_elems, count - ch.offset);
    ch.group_size = topo.group_size;
    ch.element_size = esize;
    return ch;
  };

  NVG_RETURN_IF_ERROR_CTX(prims.GroupReduceScatter(chunk_at(0)), "group reduce-scatter of chunk 0");
  for (size_t c = 0; c < num_chunks; ++c) {
    ChunkSlices chunk = chunk_at(c);
    if (c + 1 < num_chunks)  // overlap the next chunk's NVLink step with this chunk's crossing
      NVG_RETURN_IF_ERROR_CTX(prims.GroupReduceScatter(chunk_at(c + 1)),
                              "group reduce-scatter of chunk " + std::to_string(c + 1));
    NVG_RETURN_IF_ERROR_CTX(prims.CrossAllreduce(chunk),
                            "cross-group allreduce of chunk " + std::to_string(c));
    NVG_RETURN_IF_ERROR_CTX(prims.GroupAllgather(chunk, out),
                            "group allgather of chunk " + std::to_string(c));
  }
  return Status::Ok();
}

}  // namespace nvgroup
