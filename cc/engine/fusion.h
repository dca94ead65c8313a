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
// The default NVGROUP_FUSION_THRESHOLD is 64 MiB. A bucket costs one batched
// copy in, one allreduce and one batched copy out, so fusion pays off where a
// collective has a fixed cost and bandwidth grows with message size. Our NCCL
// figures on 2xH200 (benchmarks/results/allreduce_perf_h200x2.json) show exactly that: busbw 76 GB/s at 2 MiB,
// 183 at 8 MiB, 247 at 32 MiB, 287 at 128 MiB, 317 at 512 MiB. A 64 MiB bucket
// sits within ~10% of the 128 MiB figure while halving both the wait before
// the first bucket of a step is full and the registered buffer every NV-group
// peer maps (sized max(threshold, 64 MiB) per rank and device, communicator.h).
// 64 MB is also what MLPerf-era Horovod configurations settled on, against Horovod's 128 MiB default and PyTorch DDP's 25 MiB buckets.
//
// Measured with this engine on 2 CPU ranks of our 2-core build box
// (tests/engine/workers/engine_fusion_sweep.py: 161 float32 tensors with
// ResNet-50's size mix, 102.6 MB per step, all ready at once, cached cycles;
// mean of the per-rank medians of 3 steps; the box was shared, load ~13, so
// single numbers swing by tens of percent):
//   threshold      0     1 MiB   4 MiB   16 MiB   64 MiB   128 MiB
//   run 1 (ms)    49.3    57.3   180.3    88.9     91.0     98.1
//   run 2 (ms)    54.4    62.8    87.2    84.0     67.5    109.5
// On the CPU fusion does not pay: the engine's per-collective overhead (a
// cached cycle, ~0.1 ms) is small, and a big bucket most likely streams every
// byte through DRAM three times (copy in, reduce, copy out) where a lone
// tensor (which skips the fusion copies) or a small bucket stays in cache.
// CPU-only jobs are better off with NVGROUP_FUSION_THRESHOLD=0 or 1 MiB; the
// 64 MiB default is chosen for the GPU path, where each collective has a fixed
// cost and the two copies run at HBM bandwidth (several TB/s on an H200, a
// fraction of the time the same bytes take over NVLink).
#pragma once

#include <cstddef>
#include <vector>

#include "engine/wire_format.h"

namespace nvgroup {

// Each tensor starts on a 16-byte boundary of the fused buffer: the widest
// vector load of the copy and reduction kernels (vLLM's packed_t in csrc/custom_all_reduce.cuh).
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

std::vector<FusionBucket> PlanFusion(const std::vector<ResponseMessage>& responses, size_t threshold);
// The same over pointers (the engine's cycle: no copies of the responses).
std::vector<FusionBucket> PlanFusion(const std::vector<const ResponseMessage*>& responses, size_t threshold);

}  // namespace nvgroup
