// Host-side interface of the row reduce-scatter kernel (cc/kernels/reduce_scatter.cu):
// the NV-group reduce-scatter phase with the caller's (Horovod's) uneven split
// instead of the two-shot kernel's equal 16-byte-aligned slices. The protocol
// is written down at the top of reduce_scatter.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/kernels.h"
#include "nvgroup/status.h"

namespace nvgroup {

// One launch reduces one *piece* (Note [Vocabulary], cc/algorithms/
// hierarchical_allreduce.h) of the message (at most the registered
// capacity). Every member of the group launches it with the same `base.count`
// and `base.blocks` (the barrier pairs block b with block b); the ranges differ.
// Row ranges one launch folds (the hierarchical reduce-scatter passes one per
// group, in batches of this many: every member launches the same batches).
constexpr int kMaxRowRanges = 16;

// Elements [lo, hi) of the piece, folded over the members, go to out[0..hi-lo).
struct RowRange {
  size_t lo = 0;  // lo == hi: none
  size_t hi = 0;
  void* out = nullptr;  // this rank's memory (the caller's output, or a send buffer)
};

struct RowScatterLaunch {
  // peers.data[p]: member p's registered data, where the piece lies (element 0
  // of the piece at a 16-byte aligned address); count: elements of the piece;
  // in: the piece of this rank's input to copy into its registered data inside
  // the kernel, or nullptr when it already lies there; op, divisor, blocks,
  // control, timeout_ns, starts_call as for the two-shot kernel. out and phases
  // are not used.
  P2pLaunch base;
  // This rank's ranges of the piece (disjoint from every other member's).
  int num_ranges = 0;
  RowRange ranges[kMaxRowRanges];
};

Status LaunchRowReduceScatter(const RowScatterLaunch& launch, cudaStream_t stream);

// Largest grid of the row reduce-scatter kernel for `group_size` that is
// resident at once on `device` (every dtype's instantiation; at most kMaxBlocks).
StatusOr<int> ResidentRowScatterBlocks(int device, int group_size);

}  // namespace nvgroup
