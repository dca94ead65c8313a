// GPU topology: which GPU each rank drives and which ranks form NV-groups.
//
// How it works.
//  1. Nodes: SplitNodes (cc/topology) gives local_rank/local_size.
//  2. GPU: the requested ordinal, else local_rank % cudaGetDeviceCount.
//  3. Peer access: the node's ranks MPI_Allgather their ordinals and PCI bus
//     ids; each rank asks cudaDeviceCanAccessPeer for its GPU against every
//     other rank's GPU and the rows are allgathered, so every rank of the node
//     holds the whole matrix. Two ranks on one GPU count as "no peer access"
//     (an NV-group needs distinct GPUs), except in the one-GPU group mode
//     (NVGROUP_ONE_GPU_GROUP=1, for tests): there ranks on one GPU count as
//     connected, so G processes sharing one GPU (under MPS) form a group and
//     run the real IPC path; the communicator then caps every grid so that the
//     kernels of all members fit on the GPU together (a member spinning on a
//     block that cannot be scheduled would deadlock).
//  4. Group size G: Knobs::group_size (NVGROUP_GROUP_SIZE, or the caller's
//     override) when given, else the node's rank count (at most kMaxGroupSize; else the
//     largest divisor of it that is). Groups are blocks of G consecutive local
//     ranks; every pair in a block must have mutual peer access. When detection
//     finds a block without it, G falls back to 1 (host-staged MPI between
//     single-GPU groups, correct but slow) and the node's local rank 0 prints a
//     one-line warning; a requested G whose blocks lack peer access is an error.
//     All ranks agree on G (MPI_MIN over the communicator) before SplitGroups,
//     so every rank gets the same verdict.
#pragma once

#include <mpi.h>

#include "nvgroup/communicator.h"
#include "nvgroup/status.h"
#include "topology/topology.h"

namespace nvgroup {

// Fills `topo` and `comms` and selects the device (cudaSetDevice). Collective.
// `device_ordinal` < 0: local_rank % device count. `requested_group_size` 0: detect.
// `one_gpu_group`: ranks on one GPU may form a group (see above).
// `*device_out` receives the chosen ordinal, `*ranks_on_device` how many local
// ranks (itself included, of any group) drive the same GPU.
Status ResolveDeviceTopology(MPI_Comm comm, int device_ordinal, int requested_group_size, bool one_gpu_group,
                             Topology* topo, TopologyComms* comms, int* device_out, int* ranks_on_device);

}  // namespace nvgroup
