// Host topology: how the ranks of an MPI communicator split into nodes and
// NV-groups, and the MPI sub-communicators each level of the allreduce uses.
//
// How it works.
//  1. Nodes. MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) gives the *local*
//     communicator (ranks that share memory). Its local_rank-0 ranks, ordered by
//     rank, number the nodes (node_index); the index is broadcast in the node.
//  2. Groups. G ranks per group: the requested size (Knobs::group_size:
//     NVGROUP_GROUP_SIZE, or the caller's override), else the node's rank
//     count. Group = local_rank / G on its node, group_rank = local_rank % G. Group leaders (group_rank 0),
//     ordered by rank, number the groups (group_index), so every member of a
//     group agrees on its index however ranks are mapped to nodes.
//  3. Sub-communicators: group comm (one group, ordered by group_rank) and cross
//     comm (one group_rank across all groups, ordered by group_index).
//
// Validation is collective: one MPI_Allreduce of every rank's view (requested G,
// node size, divisibility) lets all ranks reach the same verdict, so a bad
// NVGROUP_GROUP_SIZE fails with the same kInvalidArgument on every rank instead
// of leaving some ranks waiting in a split.
#pragma once

#include <mpi.h>

#include "nvgroup/communicator.h"
#include "nvgroup/status.h"

namespace nvgroup {

// Owns the sub-communicators; frees them unless MPI is already finalized.
class TopologyComms {
 public:
  TopologyComms() = default;
  TopologyComms(const TopologyComms&) = delete;
  TopologyComms& operator=(const TopologyComms&) = delete;
  ~TopologyComms();

  MPI_Comm local = MPI_COMM_NULL;  // ranks of this node
  MPI_Comm group = MPI_COMM_NULL;  // ranks of this group, rank == group_rank
  MPI_Comm cross = MPI_COMM_NULL;  // peers (same group_rank), rank == group_index
};

// Fills rank, size, local_rank/local_size and node_index/node_count of `topo`
// (group fields: one group per rank) and creates comms->local. Collective.
Status SplitNodes(MPI_Comm comm, Topology* topo, TopologyComms* comms);

// Fills the group fields of `topo` (after SplitNodes) for `requested_group_size`
// (0 = the node's rank count) and creates comms->group and comms->cross.
// `source` names where the request came from for the error text
// (e.g. "NVGROUP_GROUP_SIZE"). Collective; same verdict on every rank.
Status SplitGroups(MPI_Comm comm, int requested_group_size, const char* source, Topology* topo,
                   TopologyComms* comms);

}  // namespace nvgroup
