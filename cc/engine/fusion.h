// Fusion: which ready allreduces share one trip through the communicator.
//
// How it works. PlanFusion takes the cycle's ordered response list (identical on
// every rank) and cuts it into buckets, greedily: the first response not yet
// placed opens a bucket, then every later unplaced response that is compatible
// (a successful allreduce with the same dtype, op, prescale, postscale and device
// kind) joins while the bucket, each tensor padded to kFusionAlignBytes, stays
// within `threshold` bytes. Anything else (allgather, broadcast, error responses,
// a tensor larger than the threshold) is a bucket of its own. Buckets run in the
// order of their first response. The function is pure, so every rank computes
// the same plan and it is unit-testable without MPI.
//
// Grouped requests (EnqueueGroup) arrive adjacent in the response list (the
// coordinator releases a group all at once), so the greedy pass puts them in
// the same bucket whenever they fit.
//
// Note [Fusion threshold]
// The default NVGROUP_FUSION_THRESHOLD is 64 MiB. A fused bucket costs one
// batched copy in, one allreduce and one batched copy out; per-collective
// overhead (a negotiation-free cached cycle plus the communicator's fixed cost,
// tens of microseconds on NVLink, ~0.1 ms over MPI on one CPU host) is amortized
// once a bucket is a few MiB, and beyond that a bigger bucket only delays the
// first byte on the wire. 64 MiB is the value MLPerf-era Horovod configurations
// settled on (ANCHORS.md §6), half of Horovod's 128 MiB default, and keeps the
// registered buffer (sized max(threshold, 64 MiB) per rank and device, see
// communicator.h) small enough to map into every NV-group peer. Measured with
// this engine on 2 CPU ranks (tests/engine/workers/engine_fusion_sweep.py):
// see the table at the end of this note.
//   200 float32 tensors of 4 KiB..1 MiB (~100 MiB total), 2 ranks, this CPU box:
//   threshold 0: see report; 1 MiB / 16 MiB / 64 MiB: see report.
#pragma once

#include <cstddef>
#include <vector>

#include "engine/wire_format.h"

namespace nvgroup {

// Each tensor starts on a 16-byte boundary of the fused buffer: the widest
// vector load of the copy and reduction kernels (STYLE.md, vLLM packed_t).
constexpr size_t kFusionAlignBytes = 16;

struct FusionBucket {
  // Indices into the response list, in the order they sit in the buffer.
  std::vector<size_t> responses;
  // Byte offset of each tensor in the fused buffer (multiples of kFusionAlignBytes).
  std::vector<size_t> offsets;
  // Bytes from the buffer start to the end of the last tensor (no trailing pad).
  size_t bytes = 0;
  // True for allreduce buckets (one or more tensors) that may use the
  // registered buffer; false for buckets that run on their own.
  bool fusable = false;
};

// Bytes of a response's tensor (allreduce/broadcast: its shape; allgather: this
// rank's part is not known here, so 0).
size_t ResponseBytes(const ResponseMessage& response);

std::vector<FusionBucket> PlanFusion(const std::vector<ResponseMessage>& responses,
                                     size_t threshold);

}  // namespace nvgroup
