// DevicePrimitives: the CUDA implementation of the steps of the one
// hierarchical allreduce skeleton (cc/algorithms/hierarchical_allreduce.h).
//
//   GroupAllreduce      one group only: one-shot NVLink kernel up to
//                       oneshot_max_bytes, else the two-shot kernel (copy-in,
//                       reduce-scatter, allgather in one launch);
//   GroupReduceScatter  two-shot kernel, reduce-scatter phase, on one chunk;
//   CrossStart/Finish   slice group_rank of the chunk with the peers of the
//                       other groups: the CrossExchange reduce-scatter +
//                       allgather (cc/algorithms/cross_exchange.h), folded in
//                       group_index order (every rank gets the same bits);
//   GroupAllgather      two-shot kernel, allgather phase, chunk -> out.
//
// Cross step, host-staged (MPI not CUDA-aware), chunk c with k = c % 2:
//   CrossStart: cross_stream (the D2H stream) waits for reduce_scattered[k]
//     (the RS kernel of c), copies the slice into pinned host_send[k],
//     records staged[k]; queues the job. The slice is our slice of the chunk
//     in the registered buffer; in a group of one GPU it is the whole chunk,
//     read from the call's input, and the copy back below writes the chunk
//     of the call's output (nothing goes through the registered buffer: no
//     copy in, no GroupAllgather copy out; reduce_scattered[k] is recorded
//     all the same, after the work that produced the input).
//   the exchange (Note [Cross exchange protocol] in
//     cc/algorithms/cross_exchange.h; progressed by the caller inside
//     CrossFinish, else by the progress thread): once staged[k] completed
//     (`ready`): the first round host_send[k] -> host_recv[k] (reduce-scatter
//     parts, or whole slices for a small slice); once returned[k] (the H2D of
//     chunk c-2 out of host_result[k]) completed too (`writable`): the host
//     fold (ReduceFold, the same contract as the CPU path) into
//     host_result[k], then (reduce-scatter + allgather) the allgather round in
//     place on it; then (`done`) enqueues the H2D host_result[k] -> slice on
//     h2d_stream and records returned[k].
//   CrossFinish: waits for the job, then the caller's stream waits for
//     returned[k], so the AG kernel of c (whose start barrier is what lets the
//     peers read our slice) runs after the copy landed, and in a group of one
//     the caller's later work sees the chunk of `out`.
// Each event is recorded by one thread and polled or waited by the others
// only after that record: staged[k] is recorded in CrossStart before the job
// is queued (the queue's mutex orders the record before the first query), returned[k] in `done` before the job finishes (Wait's acquire
// of finished_below_ orders it before CrossFinish's cudaStreamWaitEvent, and
// chunk c+2's `writable` polls it only after CrossStart(c+2), which follows
// CrossFinish(c)). The host buffers of parity k: host_send[k] is written by the
// D2H of c+2 only after job c finished (CrossStart(c+2) follows CrossFinish(c));
// host_recv[k] and host_result[k] are written by MPI and the fold of one job
// at a time for the same reason.
// With chunks of a quarter of the message (Note [Chunk size] in
// hierarchical_allreduce.h), D2H(c+1), MPI(c) and H2D(c-1) are in flight
// together on the two copy streams and in MPI, while the caller's
// thread only issues work. The
// device side of that job (staging, readiness, fold, copy back) is written
// once for both primitives types (StageCrossJob in device_primitives_cuda.cc);
// the jobs in flight are kept by CrossJobs (cc/algorithms/cross_exchange.h).
// CUDA-aware MPI (MPIX_Query_cuda_support): the same job on device memory:
// send = result = the slice (a group of one: send = the chunk of `in`, result
// = the chunk of `out`), recv = device_recv[k]; ready = reduce_scattered[k]
// completed; the fold is the device fold kernel on fold_stream, synchronized
// before the allgather round; nothing to copy back.
// The kernels run on the communicator's own stream (Note [Internal stream] in
// communicator_setup_cuda.cc).
#pragma once

#include <cuda_runtime.h>
#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <vector>

#include "algorithms/cross_exchange.h"
#include "algorithms/hierarchical_allreduce.h"
#include "algorithms/hierarchical_reduce_scatter.h"
#include "device/ipc.h"
#include "kernels/kernels.h"
#include "kernels/reduce_scatter.h"
#include "nvgroup/communicator.h"
#include "nvgroup/status.h"
#include "nvgroup/types.h"
#include "topology/topology.h"

namespace nvgroup {

// Launch choices, measured on 2x H200 (docs/PERFORMANCE.md).
struct KernelTuning {
  size_t oneshot_max_bytes = 0;  // messages up to this use the one-shot kernel
  int oneshot_blocks = 0;  // grid cap of the one-shot kernel
  int twoshot_blocks = 0;  // grid cap of the two-shot kernel
  // Two-shot on user buffers: pipeline chunk per slice in bytes (0: the phases
  // run one after the other over the whole message).
  size_t twoshot_chunk_bytes = 0;
};

// Long-lived state of one CUDA communicator that the primitives use.
struct DeviceGroup {
  Topology topo;
  TopologyComms comms;
  int device = 0;
  std::unique_ptr<IpcRegion> region;  // registered buffer + flags + staging of every member
  DeviceControl* control_host = nullptr;  // cudaHostAllocMapped control words
  DeviceControl* control_device = nullptr;  // the same, as the kernels see them
  uint64_t timeout_ns = 0;
  KernelTuning tuning;
  // Upper bound on every grid: kMaxBlocks, less in the one-GPU group mode
  // (members share the GPU's multiprocessors).
  int block_cap = kMaxBlocks;
  bool cuda_aware_mpi = false;
  // Set once the current communicator call launched its first kernel (that
  // kernel starts the call's deadline; Note [Dead peers] in p2p_allreduce.cuh).
  bool call_started = false;

  // Cross step (group_count > 1), see the header comment. Buffers by chunk
  // parity k; slice_capacity bytes each (recv: recv_capacity, what either
  // variant of the exchange receives, CrossExchange::MaxRecvBytes).
  std::unique_ptr<CrossExchange> cross;
  cudaStream_t cross_stream = nullptr;  // D2H of the slices
  cudaStream_t h2d_stream = nullptr;  // H2D of the reduced slices
  cudaStream_t fold_stream = nullptr;  // CUDA-aware: the device fold
  size_t slice_capacity = 0;
  size_t recv_capacity = 0;
  char* host_send[2] = {nullptr, nullptr};  // pinned
  char* host_recv[2] = {nullptr, nullptr};  // pinned
  char* host_result[2] = {nullptr, nullptr};  // pinned
  char* device_recv[2] = {nullptr, nullptr};  // CUDA-aware only
  cudaEvent_t reduce_scattered[2] = {nullptr, nullptr};  // chunk's reduce-scatter done
  cudaEvent_t staged[2] = {nullptr, nullptr};  // slice copied into host_send[k]
  cudaEvent_t returned[2] = {nullptr, nullptr};  // host_result[k] copied back
  // Hierarchical reduce-scatter: the group fold's output (this rank's parts
  // of a chunk, the cross step's send buffer; slice_capacity bytes each, by
  // chunk parity), who sits where, and the call's plan and part counts.
  char* row_send[2] = {nullptr, nullptr};  // device memory
  RowOwners row_owners;
  RowScatterPlan row_plan;
  std::vector<size_t> row_parts[2];
};

// The row reduce-scatter kernel's launch (cc/kernels/reduce_scatter.cu) over
// the group's registered buffers for one piece of `count` elements, written
// once for the communicator's one-group ReduceScatter and the hierarchical
// reduce-scatter's group fold: one thread per 16-byte unit of the piece,
// capped at min(twoshot_blocks, row_block_cap) blocks (the same on every
// member). The caller sets in, starts_call and the ranges.
RowScatterLaunch RowScatterLaunchFor(const DeviceGroup& group, DataType dtype, ReduceOp op, int divisor,
                                     size_t count, int row_block_cap);

class DevicePrimitives {
 public:
  // `in` is the call's input: in the registered buffer at `registered_offset`
  // bytes (then `in_registered`), or any device pointer (one-shot and two-shot
  // copy it in inside the kernel; the hierarchical path of a group of several
  // GPUs copies it in first). `out` is the call's output (GroupAllgather's).
  // A group of one GPU serves no peer from the registered buffer: its cross
  // step reads each chunk from `in` and writes the result into `out`
  // (CrossStart), and GroupAllgather has nothing left to do.
  DevicePrimitives(DeviceGroup* group, const void* in, bool in_registered, size_t registered_offset,
                   void* out, DataType dtype, ReduceOp op, cudaStream_t stream);

  const Topology& topology() const { return group_->topo; }
  size_t element_size() const { return esize_; }
  Status GroupAllreduce(size_t count, void* out);
  Status GroupReduceScatter(const ChunkSlices& chunk);
  Status CrossStart(const ChunkSlices& chunk);
  Status CrossFinish(const ChunkSlices& chunk);
  Status GroupAllgather(const ChunkSlices& chunk, void* out);

 private:
  P2pLaunch BaseLaunch(size_t count, int max_blocks);
  char* Registered(int member) const;  // member's registered data + offset

  DeviceGroup* group_;
  const void* in_;
  bool in_registered_;
  size_t registered_offset_;
  void* out_;
  DataType dtype_;
  ReduceOp op_;
  size_t esize_;
  cudaStream_t stream_;
  CrossJobs jobs_;
};

// The CUDA primitives of the hierarchical reduce-scatter
// (cc/algorithms/hierarchical_reduce_scatter.h), chunk c with k = c % 2:
//   GroupFold: G > 1: the row reduce-scatter kernel on the piece
//     (cc/kernels/reduce_scatter.cu), one range per group j (our part (j, l)),
//     written consecutively into row_send[k]; groups in batches of
//     kMaxRowRanges, one launch each, the same launches on every member (a
//     part may be empty); the piece's first launch copies `in` in. G == 1:
//     device copies of the parts from `in` into row_send[k]. Before either,
//     the stream waits for staged[k] (the copy of chunk c - 2 out of
//     row_send[k]); after, it records reduce_scattered[k].
//   CrossStart, host-staged (MPI not CUDA-aware): cross_stream waits for
//     reduce_scattered[k], copies row_send[k] into pinned host_send[k],
//     records staged[k]; the CrossExchange reduce-scatter job (ready:
//     staged[k]; writable: returned[k], the copy of chunk c - 2 out of
//     host_result[k]) folds the P copies of our part on the host (ReduceFold,
//     divisor size for Average) into host_result[k], then copies it into
//     `out` on h2d_stream and records returned[k]. CUDA-aware: the job sends row_send[k] itself (ready:
//     reduce_scattered[k]), receives into device_recv[k] and the device fold
//     writes `out` on fold_stream, synchronized before the job finishes.
//   CrossFinish: waits for the job.
//   Finish: the stream waits for returned[0..1], so the caller sees `out`
//     complete (CUDA-aware: nothing left in flight).
// A chunk with no part for our group rank is skipped by all its peers alike.
class DeviceScatterPrimitives {
 public:
  DeviceScatterPrimitives(DeviceGroup* group, const void* in, bool in_registered, void* out, DataType dtype,
                          ReduceOp op, int row_block_cap, cudaStream_t stream);
  Status GroupFold(const RowChunk& chunk);
  Status CrossStart(const RowChunk& chunk);
  Status CrossFinish(const RowChunk& chunk);
  Status Finish();

 private:
  DeviceGroup* group_;
  const RowScatterPlan& plan_;
  const char* in_;
  bool in_registered_;
  char* out_;
  DataType dtype_;
  ReduceOp op_;
  size_t esize_;
  int row_block_cap_;
  cudaStream_t stream_;
  CrossJobs jobs_;
};

}  // namespace nvgroup
