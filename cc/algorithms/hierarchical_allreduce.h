// The NV-group hierarchical allreduce, written once for every device.
//
// Note [Vocabulary]
// The words of every algorithm file (cc/algorithms, cc/cpu, cc/device),
// defined here only; the other files use them in this sense:
//  * message: the elements of one collective call.
//  * piece: the part of a message that goes through the registered buffer at
//    once: a message whose input is not in the registered buffer is copied in
//    piece by piece (PieceElements). The flat MPI path has no registered
//    buffer; its pieces are at most pipeline_chunk bytes.
//  * chunk: the unit of pipelining inside a piece (PipelineChunking, Note
//    [Chunk size]); two chunks are in the cross step at a time.
//  * slice: a chunk's share of one group member; slice r is owned by group
//    rank r (ChunkSlices). Also what one peer brings to a cross exchange.
//  * part: a slice's share of one peer in the cross step; part p is owned by
//    peer p (CrossExchange). In the reduce-scatter, part (j, l) is the rows of
//    chunk k that the rank of group j, group rank l receives
//    (cc/algorithms/hierarchical_reduce_scatter.h).
//  * unit: kSliceAlignBytes (16 bytes, one vector load) of elements
//    (AlignUnitElements); slices, parts and pieces start on whole units.
//  * step: one of a chunk's three stages below (group reduce-scatter, cross,
//    group allgather); round: one point-to-point exchange among the peers;
//    job: the cross exchange of one slice (both cc/algorithms/cross_exchange.h).
//
// How it works. The ranks form groups of G members (see communicator.h). The
// message (the `count` elements of one Allreduce call, already in this rank's
// registered buffer) is cut into *chunks* (PipelineChunking, Note [Chunk
// size]); each chunk is cut into G *slices*, slice r owned by group rank r.
// Every chunk goes through three *steps*:
//
//   1. GroupReduceScatter(chunk): group rank r reduces slice r of the chunk over
//      all G members' registered buffers (direct loads: NVLink peer reads via
//      CUDA IPC, or POSIX shared memory), in group_rank order, and leaves the
//      result in slice r of its own registered buffer.
//   2. CrossStart(chunk) / CrossFinish(chunk): slice r is allreduced with the
//      rank of group rank r in every other group (the *peers*), in group_index
//      order: a reduce-scatter + allgather among the peers, or for small
//      slices one allgather and a local fold (CrossExchange,
//      cc/algorithms/cross_exchange.h; through pinned host memory when MPI is
//      not CUDA-aware). Each rank sends 1/G of the chunk to the cross step, and
//      2 (P-1)/P of that over the network (P = group_count), so every GPU and
//      every link carries an equal, minimal share of the traffic.
//   3. GroupAllgather(chunk, out): every member copies all G reduced slices of
//      the chunk into `out`.
//
// Pipelining: two chunks are in the cross step at a time. CrossStart(c) only
// queues chunk c (its MPI exchange is progressed off the calling thread);
// CrossFinish(c) waits for it. The order of calls is
//   RS(0) CS(0) RS(1) CS(1) | CF(0) AG(0) RS(2) CS(2) | CF(1) AG(1) RS(3) CS(3) | ...
// so while the caller waits for chunk c, chunk c+1 is being copied to the host
// or reduce-scattered, and chunk c-1 is copied back and allgathered (on a GPU
// the RS/AG kernels and copies are asynchronous on streams; on the CPU the
// group steps of the next chunk run while the progress thread moves this one).
// The primitives double-buffer by chunk.index % 2: chunk c+2 reuses the
// buffers of chunk c, which CrossFinish(c) released.

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
//   Status CrossStart(const ChunkSlices& chunk);   // queue the cross step
//   Status CrossFinish(const ChunkSlices& chunk);  // wait for it (in chunk order)
//   Status GroupAllgather(const ChunkSlices& chunk, void* out);
// Offsets and counts are in elements of the registered buffer / of `out`.
#pragma once

#include <algorithm>
#include <cstddef>

#include "common/checks.h"
#include "nvgroup/communicator.h"
#include "nvgroup/status.h"

namespace nvgroup {

// One 16-byte vector load: the alignment of slices, parts and pieces.
constexpr size_t kSliceAlignBytes = 16;

// Elements of `element_size` bytes in one unit (Note [Vocabulary]).
inline size_t AlignUnitElements(size_t element_size) {
  return std::max<size_t>(1, kSliceAlignBytes / element_size);
}

// Elements per piece (Note [Vocabulary]): the most elements of `element_size`
// bytes that fit `capacity_bytes`, in whole blocks of `block_elements`
// elements (1: any count; AlignUnitElements(e): whole units; times G: whole
// units per group member), at least one block. Every rank computes the same
// pieces from the same arguments.
inline size_t PieceElements(size_t capacity_bytes, size_t element_size, size_t block_elements) {
  return std::max(block_elements, capacity_bytes / element_size / block_elements * block_elements);
}

// One chunk and its G slices. Slices are contiguous, in group_rank order,
// cover the chunk exactly, and all but the last start on a whole unit so
// 16-byte vector loads stay aligned.
struct ChunkSlices {
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
    size_t unit = AlignUnitElements(element_size);
    size_t per = (count + group_size - 1) / group_size;
    return (per + unit - 1) / unit * unit;
  }
};

// Note [Chunk size]
// Two chunks are in the cross step at a time, so a message of one chunk has
// nothing to overlap: its copy to the host, its MPI exchange and its copy back
// run one after the other. A message of B bytes is therefore cut into chunks
// of ceil(B / kMinPipelineChunks) bytes, but at least min_bytes (each chunk
// pays the cross step's fixed cost: its jobs, events and MPI calls) and at most
// max_bytes (NVGROUP_PIPELINE_MIN_CHUNK, NVGROUP_PIPELINE_CHUNK; a minimum
// above the maximum is the maximum), in whole 16-byte units per slice
// (rounded up from the quarter, down from the maximum). With 4 chunks the
// copy of chunk c+1 to the host, the exchange of chunk c and the copy back of
// chunk c-1 are in flight together for two of them; the geometry is the same
// on every rank (the knobs are agreed). The minimum's default, 1 MiB, was
// measured on one H100 with 2 and 4 ranks as groups of 1 (cross_step_bench's
// min-chunk-x4 column, docs/PERFORMANCE.md): 1-2 MiB messages took 8-18% less
// as one or two chunks than as four of 256 KiB, each chunk's fixed cost
// outweighing the overlap; from 4 MiB up the geometry is the same either way.
struct PipelineChunking {
  static constexpr size_t kMinPipelineChunks = 4;
  size_t max_bytes = 4u << 20;
  size_t min_bytes = 1u << 20;

  // Elements per chunk of a message of `count` elements.
  size_t ChunkElements(size_t count, size_t element_size, int group_size) const {
    const size_t unit = AlignUnitElements(element_size) * group_size;
    const size_t most = std::max(unit, (max_bytes / element_size) / unit * unit);
    const size_t least = std::min(most,
                                  (std::min(min_bytes, max_bytes) / element_size + unit - 1) / unit * unit);
    const size_t quarter = ((count + kMinPipelineChunks - 1) / kMinPipelineChunks + unit - 1) / unit * unit;
    return std::max(unit, std::min(most, std::max(least, quarter)));
  }
};

template <class Primitives>
Status RunHierarchicalAllreduce(Primitives& prims, size_t count, void* out, const PipelineChunking& chunking,
                                bool force_hierarchy) {
  const Topology& topo = prims.topology();
  if (count == 0) return Status::Ok();
  if (topo.group_count == 1 && !force_hierarchy) return prims.GroupAllreduce(count, out);

  const size_t esize = prims.element_size();
  const size_t chunk_elems = chunking.ChunkElements(count, esize, topo.group_size);
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

  constexpr size_t kInFlight = 2;  // chunks in the cross step at a time (double buffering)
  auto issue = [&](size_t c) -> Status {
    NVG_RETURN_IF_ERROR_CTX(prims.GroupReduceScatter(chunk_at(c)),
                            "group reduce-scatter of chunk " + std::to_string(c));
    NVG_RETURN_IF_ERROR_CTX(prims.CrossStart(chunk_at(c)),
                            "starting the cross-group step of chunk " + std::to_string(c));
    return Status::Ok();
  };
  // A chunk started is always finished (its buffers stay in use until then),
  // also when a later step fails: the first error is returned after that.
  Status first;
  size_t started = 0;
  for (; started < std::min(kInFlight, num_chunks) && first.ok(); ++started) first = issue(started);
  if (!first.ok()) --started;  // a failed CrossStart queued nothing; a failed RS neither
  for (size_t c = 0; c < started; ++c) {
    ChunkSlices chunk = chunk_at(c);
    Status s = prims.CrossFinish(chunk);
    if (!s.ok()) s = s.WithContext("cross-group allreduce of chunk " + std::to_string(c));
    if (s.ok() && first.ok()) {
      s = prims.GroupAllgather(chunk, out);
      if (!s.ok()) s = s.WithContext("group allgather of chunk " + std::to_string(c));
    }
    if (first.ok()) first = s;
    if (first.ok() && started < num_chunks) {
      first = issue(started);
      if (first.ok()) ++started;
    }
  }
  return first;
}

}  // namespace nvgroup
