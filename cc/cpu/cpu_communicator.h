// CpuCommunicator: the Communicator for host memory (Device::Cpu()).
//
// How it works. Creation splits the ranks into nodes and groups
// (cc/topology/topology.h), maps every group member's registered buffer through
// POSIX shared memory (cc/transport/shm_group.h) and keeps MPI sub-communicators
// for the cross-group step. Allreduce takes one of two paths:
//  * hierarchical (NVGROUP_ALLREDUCE_ALGORITHM=auto|hierarchical): the one
//    skeleton RunHierarchicalAllreduce (cc/algorithms/hierarchical_allreduce.h)
//    over HostPrimitives (cc/cpu/host_primitives.h). Inputs outside the
//    registered buffer go through it in registered_capacity()-sized pieces.
//    "auto" takes it whenever groups have more than one member.
//  * flat MPI (NVGROUP_ALLREDUCE_ALGORITHM=mpi, and "auto" with groups of one
//    rank, where the group step would only copy): the cross exchange
//    (cc/algorithms/cross_exchange.h) over all ranks in rank order, piece by
//    piece, a deterministic reduce-scatter + allgather.
// Inputs, outputs and the registered buffer: see Communicator. An output may
// overlap the registered buffer only as the buffer itself, with the input
// there too (the engine's fused in-place call); an input inside the buffer
// must start at its start.
// ReduceScatter: one group: the group step alone (GroupReduceScatter); several
// groups: RunHierarchicalReduceScatter (cc/algorithms/
// hierarchical_reduce_scatter.h) over HostScatterPrimitives; the flat
// algorithm: the flat allreduce, then this rank's rows.
// Allgatherv and Broadcast are plain MPI (after a cross-rank argument check).
// Settings, from the Knobs it is created with (cc/common/env.h; nothing else
// is read): group_size, algorithm, pipeline_chunk and pipeline_min_chunk
// (chunks of the skeleton; pipeline_chunk is also the piece of the flat path),
// cross_allgather_max_bytes (the cross step's variant), peer_timeout_s (the shared-memory waits) and
// fusion_threshold (the default registered size; CommunicatorOptions::
// registered_bytes sets it instead).
// Threads: one thread at a time calls the collectives (the engine's background
// thread); Abort may be called from any thread.
//
// Note [Blocking MPI steps]
// Abort() and the peer timeout bound the shared-memory waits (ShmGroup). The MPI
// steps (allgatherv, broadcast, alltoallv) are blocking MPI calls; the
// nonblocking point-to-point rounds of the cross-group step and of the flat
// path (CrossExchange) are always completed, never abandoned. Completing them with a timeout was tried and rejected,
// because MPI can neither cancel nor free a collective request, so an abandoned
// one later wrote into freed memory when the late peer arrived (a segfault in
// the test). A peer lost inside an MPI step is reported by MPI (Open MPI ends
// the job). Any failure after communication started breaks the communicator:
// later calls return kUnavailable with the first error, and the group members'
// barriers fail at once.
//
// Note [Determinism contract]
// Element i of an allreduce is reduced as a left fold over the members of a
// group in group_rank order, then a left fold over the group results in
// group_index order (cc/cpu/host_reduce.h says where float16/bfloat16 round).
// The flat path is the same fold with one group of `size` ranks: the message is
// cut into pieces of at most pipeline_chunk bytes and each piece into `size`
// parts (CrossExchange: part r to rank r, which folds the copies in rank order
// 0..size-1 and shares its part; small pieces go whole to every rank, which
// folds them all in the same order). MPI's own reduction is never used, so:
//  * every rank gets the same bits;
//  * the result of element i does not depend on where it sits in the buffer
//    (a fused buffer and the unfused tensors give identical bits);
//  * with one group of all ranks, flat and hierarchical compute the same fold,
//    bit for bit. With several groups the fold differs ((r0+r1)+(r2+r3) versus
//    ((r0+r1)+r2)+r3), so the two agree bitwise only where sums are exact.
#pragma once

#include <mpi.h>

#include <memory>

#include "common/env.h"
#include "nvgroup/communicator.h"
#include "nvgroup/status.h"

namespace nvgroup {

// Creates the CPU communicator over `comm` (duplicated; the caller keeps its
// own). Collective over `comm`.
StatusOr<std::unique_ptr<Communicator>> CreateCpuCommunicator(MPI_Comm comm, const Knobs& knobs,
                                                              const CommunicatorOptions& options);

}  // namespace nvgroup
