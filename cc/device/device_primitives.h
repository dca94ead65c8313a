// DevicePrimitives: the CUDA implementation of the steps of the one
// hierarchical allreduce skeleton (cc/algorithms/hierarchical_allreduce.h).
//
//   GroupAllreduce      one group only: one-shot NVLink kernel up to
//                       oneshot_max_bytes, else the two-shot kernel (push,
//                       fold, gather in one launch, pipelined in chunks);
//   GroupReduceScatter  two-shot kernel, fold stage only, on one chunk;
//   CrossAllreduce      slice group_rank of the chunk with the peers of the
//                       other groups: MPI_Allgather of the slices (device
//                       buffers when MPI is CUDA-aware, else D2H into pinned
//                       memory, MPI, H2D), then a local fold in group_index
//                       order (so every rank gets the same bits);
//   GroupAllgather      two-shot kernel, gather stage only, chunk -> out.
// The kernels run on the communicator's own stream (Note [Internal stream] in
// cuda_communicator_cuda.cc); the cross step runs its copies on a second stream and blocks the calling thread only for its own chunk, so the
// skeleton's next reduce-scatter kernel overlaps this chunk's MPI exchange.
#pragma once

#include <cuda_runtime.h>
#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <memory>

#include "algorithms/hierarchical_allreduce.h"
#include "device/ipc.h"
#include "kernels/kernels.h"
#include "nvgroup/communicator.h"
#include "nvgroup/status.h"
#include "nvgroup/types.h"
#include "topology/topology.h"

namespace nvgroup {

// Launch choices, measured on 2x H200 (docs/PERFORMANCE.md).
struct KernelTuning {
  size_t oneshot_max_bytes = 0;  // messages up to this use the one-shot kernel
  int oneshot_blocks = 0;        // grid cap of the one-shot kernel
  int twoshot_blocks = 0;        // grid cap of the two-shot kernel
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
  DeviceControl* control_host = nullptr;    // cudaHostAllocMapped control words
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

  // Cross step: a copy stream, the slice exchange buffers (double-buffered by
  // chunk parity) and the events that order them against the compute stream.
  cudaStream_t cross_stream = nullptr;
  size_t slice_capacity = 0;                // bytes per group per buffer
  char* host_send = nullptr;                // pinned, slice_capacity
  char* host_recv = nullptr;                // pinned, group_count * slice_capacity
  char* device_recv[2] = {nullptr, nullptr};  // group_count * slice_capacity each
  cudaEvent_t reduce_scattered[2] = {nullptr, nullptr};  // chunk's reduce-scatter done
  cudaEvent_t folded[2] = {nullptr, nullptr};            // chunk's fold done (device_recv free)
  cudaEvent_t received = nullptr;                        // H2D of the exchanged slices done
};

class DevicePrimitives {
 public:
  // `in` is the call's input: in the registered buffer at `registered_offset`
  // bytes (then `in_registered`), or any device pointer (one-shot and two-shot
  // copy it in inside the kernel; the hierarchical path copies it first).
  DevicePrimitives(DeviceGroup* group, const void* in, bool in_registered,
                   size_t registered_offset, DataType dtype, ReduceOp op, cudaStream_t stream);

  const Topology& topology() const { return group_->topo; }
  size_t element_size() const { return esize_; }
  Status GroupAllreduce(size_t count, void* out);
  Status GroupReduceScatter(const ChunkSlices& chunk);
  Status CrossAllreduce(const ChunkSlices& chunk);
  Status GroupAllgather(const ChunkSlices& chunk, void* out);

 private:
  P2pLaunch BaseLaunch(size_t count, int max_blocks);
  char* Registered(int member) const;  // member's registered data + offset

  DeviceGroup* group_;
  const void* in_;
  bool in_registered_;
  size_t registered_offset_;
  DataType dtype_;
  ReduceOp op_;
  size_t esize_;
  cudaStream_t stream_;
};

}  // namespace nvgroup
