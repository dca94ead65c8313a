// Host-side interface of the NV-group CUDA kernels (cc/kernels/*.cu).
//
// Included by CUDA code only (the .cu files and cc/device/*_cuda.cc): it pulls
// in cuda_runtime.h. The protocol itself (flag layout, barriers, phases) is
// explained in p2p_allreduce.cuh; this header holds what the host must know to
// allocate the shared state and launch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "nvgroup/communicator.h"
#include "nvgroup/status.h"
#include "nvgroup/types.h"

namespace nvgroup {

// Largest NV-group the kernels are compiled for: one NVLink/NVSwitch domain of a
// DGX/HGX board (8 GPUs). Kernels are templated on the group size 2..8.
constexpr int kMaxGroupSize = 8;
// Most blocks one launch may use. The barrier is per block (block b of every
// member meets block b of every other member), so all blocks of a launch must be
// resident at once: the kernels are built for 2 blocks of 512 threads per SM
// (__launch_bounds__(512, 2), <= 64 registers), 256 < 2 x 132 SMs of an
// H100/H200 SXM.
constexpr int kMaxBlocks = 256;
// Threads per block: 512 as in vLLM's and TensorRT-LLM's NVLink allreduces (see
// /work/shared/ANCHORS.md §2); the flag exchange needs threadIdx < group size.
constexpr int kThreadsPerBlock = 512;

// Barrier flags, one per rank, at the start of the rank's IPC allocation.
// See Note [Barrier protocol] in p2p_allreduce.cuh.
struct alignas(128) BarrierFlags {
  // counter[b][p]: how many barriers block b has entered (for flag thread p).
  // Only this rank's thread p of block b touches it.
  uint32_t counter[kMaxBlocks][kMaxGroupSize];
  // arrived[parity][b][p]: written by member p (its block b, thread
  // group_rank) with its counter value when it reaches a barrier; two parities
  // so a peer already at the next barrier cannot overwrite a value this rank
  // still waits for.
  alignas(128) uint32_t arrived[2][kMaxBlocks][kMaxGroupSize];
};

// Host-mapped control words (cudaHostAllocMapped): the host sets `abort`, a
// kernel whose barrier gives up records why in `failure` and which member it
// waited for. Read by the host before every launch and in Synchronize.
struct DeviceControl {
  volatile int abort;         // set by Communicator::Abort()
  volatile int failure;       // 0 ok, kFailureTimeout, kFailureAborted
  volatile int failed_peer;   // group_rank the barrier waited for
  volatile int failed_block;  // block index of that barrier
};
constexpr int kFailureTimeout = 1;
constexpr int kFailureAborted = 2;

// Pointers to every member's IPC-mapped state, indexed by group_rank (own entry
// = own memory), as seen from this rank's device.
struct GroupPeers {
  BarrierFlags* flags[kMaxGroupSize];
  char* data[kMaxGroupSize];  // base of the region this launch reads/writes
};

// What one P2P launch does. The same struct drives the one-shot kernel and the
// phases of the two-shot kernel (see p2p_allreduce.cuh, "How it works").
struct P2pLaunch {
  GroupPeers peers;
  int group_size = 1;
  int group_rank = 0;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  // Average: divide by this in the write that produces the final value (number
  // of ranks); 1 for intermediate levels and for other ops.
  int divisor = 1;
  const void* in = nullptr;  // copy-in source (one-shot) / push source (kPhasePushScatter)
  void* out = nullptr;       // result destination (one-shot; two-shot kAllgather)
  size_t count = 0;          // elements
  int phases = 0;            // two-shot only: kPhase* bits
  // Two-shot on user buffers (phases push + reduce-scatter + allgather only):
  // > 0 runs the pipelined kernel with chunks of this many 16-byte units per
  // slice (rounded up to the grid's thread count); 0 runs the phases one after
  // the other. See Note [Pipelined two-shot] in p2p_allreduce.cuh.
  size_t chunk_units = 0;
  int blocks = 0;            // grid size, 1..kMaxBlocks
  DeviceControl* control = nullptr;  // device pointer of the mapped control words
  uint64_t timeout_ns = 0;           // barrier spin budget
};

// Two-shot phases (bits of P2pLaunch::phases).
constexpr int kPhasePushScatter = 1;    // in's slice p -> member p's slot group_rank
constexpr int kPhaseReduceScatter = 2;  // slice group_rank over members -> own data
constexpr int kPhaseAllgather = 4;      // every member's slice -> out
constexpr int kPhasePushResult = 8;     // reduced slice -> every member's data (in place)

// One-shot: copy `in` into own data, barrier, every rank folds all members'
// data into `out`. `peers.data` must point at the staging half of this call.
Status LaunchOneShotAllreduce(const P2pLaunch& launch, cudaStream_t stream);
// Two-shot (and the hierarchy's group steps): the phases named in `phases`,
// pipelined in chunks when `chunk_units` > 0.
Status LaunchTwoShotAllreduce(const P2pLaunch& launch, cudaStream_t stream);

// dst[i] = fold over g < num_sources of src[g * count + i] (g order), final
// average division by `divisor`. Local, used for the fold over groups.
Status LaunchFoldSources(const void* src, int num_sources, void* dst, size_t count,
                         DataType dtype, ReduceOp op, int divisor, cudaStream_t stream);

// Copy descriptors for LaunchBatchedScaledCopy live in device memory.
struct DeviceCopySpec {
  const void* src;
  void* dst;
  size_t count;        // elements
  size_t first_block;  // prefix sum of blocks over earlier copies
};
// Blocks one copy descriptor gets per kCopyElemsPerBlock elements.
constexpr size_t kCopyElemsPerBlock = 16384;
// One launch for all `num_copies` descriptors (already on the device); the
// total block count is the last first_block + its own blocks.
Status LaunchBatchedScaledCopy(const DeviceCopySpec* copies, size_t num_copies,
                               size_t total_blocks, DataType dtype, double scale,
                               cudaStream_t stream);
size_t CopyBlocksFor(size_t count);

}  // namespace nvgroup
