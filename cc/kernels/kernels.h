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
// Most blocks one launch may use (the size of the flag arrays). The barrier is
// per block (block b of every member meets block b of every other member), so
// all blocks of a launch must also be resident at once: the launcher rejects a
// grid larger than the kernel's occupancy x multiprocessors
// (ResidentP2pBlocks), and the communicator caps its grids below that.
constexpr int kMaxBlocks = 256;
// Threads per block: 512 as in vLLM's and TensorRT-LLM's NVLink allreduces
// (their custom allreduce kernels); the flag exchange needs threadIdx < group size.
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
  // Own-rank state of the kernels (never touched by peers):
  // one-shot staging epoch (half = epoch & 1) and the count of blocks of the
  // running one-shot launch that have finished (Note [One-shot staging epoch]);
  alignas(128) uint32_t oneshot_epoch;
  uint32_t oneshot_blocks_done;
  // the current call's deadline, %globaltimer ns (Note [Dead peers]).
  uint64_t call_deadline_ns;
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
  // Two-shot: chunks of this many 16-byte units per slice (rounded up to the
  // grid's thread count), pipelined; 0 = one chunk (the stages one after the
  // other). See "Two-shot" in p2p_allreduce.cuh.
  size_t chunk_units = 0;
  // One-shot: peers.data[p] is member p's staging half 0, half 1 lies this
  // many bytes later; the kernel picks the half (Note [One-shot staging epoch]).
  size_t staging_half_bytes = 0;
  int blocks = 0;            // grid size, 1..ResidentP2pBlocks
  DeviceControl* control = nullptr;  // device pointer of the mapped control words
  uint64_t timeout_ns = 0;           // the whole call's spin budget
  // First kernel of a communicator call: it starts the call's deadline, the
  // call's later kernels (pieces, hierarchy chunks) keep it.
  bool starts_call = true;
};

// Two-shot phases (bits of P2pLaunch::phases).
constexpr int kPhasePushScatter = 1;    // in's slice p -> member p's slot group_rank
constexpr int kPhaseReduceScatter = 2;  // slice group_rank over members -> own data
constexpr int kPhaseAllgather = 4;      // every member's slice -> out
constexpr int kPhasePushResult = 8;     // reduced slice -> every member's data (in place)

// One-shot: copy `in` into own staging, barrier, every rank folds all members'
// staging into `out`. `peers.data` points at staging half 0 of every member.
Status LaunchOneShotAllreduce(const P2pLaunch& launch, cudaStream_t stream);
// Two-shot (and the hierarchy's group steps): the phases named in `phases`,
// pipelined in chunks when `chunk_units` > 0.
Status LaunchTwoShotAllreduce(const P2pLaunch& launch, cudaStream_t stream);
// Largest grid of the P2P kernels for `group_size` that is resident at once on
// `device` (occupancy x multiprocessors, at most kMaxBlocks).
StatusOr<int> ResidentP2pBlocks(int device, int group_size);

// dst[i] = fold over g < num_sources of src[g * count + i] (g order), final
// average division by `divisor`. Local, used for the fold over groups.
Status LaunchFoldSources(const void* src, int num_sources, void* dst, size_t count, DataType dtype,
                         ReduceOp op, int divisor, cudaStream_t stream);

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
Status LaunchBatchedScaledCopy(const DeviceCopySpec* copies, size_t num_copies, size_t total_blocks,
                               DataType dtype, double scale, cudaStream_t stream);
size_t CopyBlocksFor(size_t count);

// Delays later work on `stream` by `microseconds` (stream_delay.cu; the
// simulated link of Communicator::DelayStream). <= 0: nothing launched.
Status LaunchStreamDelay(double microseconds, cudaStream_t stream);

}  // namespace nvgroup
