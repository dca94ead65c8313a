// The CUDA communicator: NV-group collectives on device buffers.
//
// One per (MPI communicator, GPU). Creation is collective over `comm`:
//   1. topology: every rank picks its GPU, queries cudaDeviceCanAccessPeer for
//      every pair of GPUs on its node and the node's ranks agree on NV-groups
//      (cc/device/device_topology_cuda.cc);
//   2. registration: each rank cudaMallocs its registered buffer and barrier
//      flags once, and opens its group members' copies through CUDA IPC
//      (cc/device/ipc_cuda.cc);
//   3. the communicator owns one stream: every collective runs there, joined
//      to the caller's stream with events (Note [Internal stream] in
//      communicator_setup_cuda.cc; communicator.h has the stream contract).
// Allreduce runs the one skeleton (cc/algorithms/hierarchical_allreduce.h) with
// DevicePrimitives (cc/device/device_primitives.h): one group -> the one-shot
// or two-shot NVLink kernel (cc/kernels/p2p_allreduce.cuh); several groups ->
// per chunk NVLink reduce-scatter, a reduce-scatter + allgather between the
// groups (CrossExchange: pipelined through pinned memory, or on device memory
// when MPI is CUDA-aware), NVLink allgather.
// ReduceScatter, all ranks in one NV-group: the group reduce-scatter phase with
// the caller's row split (cc/kernels/reduce_scatter.cu), straight into the
// output; several groups: the allreduce in place on the registered buffer,
// then the rank's rows. Allgatherv, Broadcast and Alltoallv copy through the
// members' registered buffers (peer copies over NVLink, MPI barriers between
// the steps) when all ranks form one NV-group (and, Alltoallv, every rank's
// input fits its registered buffer), else stage through host memory and MPI
// (correct, not tuned). NVGROUP_ALLREDUCE_ALGORITHM=hierarchical forces the skeleton's
// three steps on one group; "mpi" has no separate CUDA path (same as auto).
// If some GPUs of a node lack mutual peer access, every group shrinks to one
// GPU and all reduction crosses MPI through host memory (correct, slow; a
// one-line warning says so).
#pragma once

#include <mpi.h>

#include <memory>

#include "common/env.h"
#include "nvgroup/communicator.h"
#include "nvgroup/status.h"

namespace nvgroup {

// `host_topology` carries the node split computed by the caller (rank, size,
// local_rank/local_size, node_index/node_count); the group fields are filled in
// here from peer access. `device_ordinal` < 0 means local_rank % device count.
// Every setting comes from `knobs` (group_size, one_gpu_group, pipeline_chunk,
// algorithm, oneshot_max_bytes, peer_timeout_s, fusion_threshold; see
// communicator.h "Settings"), the registered size from `options`.
StatusOr<std::unique_ptr<Communicator>> CreateCudaCommunicator(MPI_Comm comm, int device_ordinal,
                                                               const Knobs& knobs,
                                                               const CommunicatorOptions& options,
                                                               const Topology& host_topology);

// Overrides the measured kernel launch choices of a CUDA communicator (for the
// benchmark's tuning sweep): one-shot up to `oneshot_max_bytes` (at most the
// 16 MiB staging half), grid caps 1..256 (the communicator further caps every grid
// at what is resident at once on its GPU). Must be called with the same values
// on every rank, between collectives.
Status SetCudaKernelTuning(Communicator* comm, size_t oneshot_max_bytes, int oneshot_blocks,
                           int twoshot_blocks);

// Overrides the pipeline chunk of the two-shot kernel on user buffers (bytes
// per slice; 0 = one chunk: push, fold and gather one after the other).
// Same rules as SetCudaKernelTuning.
Status SetCudaTwoShotChunk(Communicator* comm, size_t chunk_bytes);

}  // namespace nvgroup
