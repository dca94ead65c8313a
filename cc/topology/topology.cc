#include "topology/topology.h"

#include <string>

#include "common/checks.h"

namespace nvgroup {
namespace {

void FreeComm(MPI_Comm* comm) {
  if (*comm == MPI_COMM_NULL) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(comm);  // best effort in a destructor: nothing to report to
  *comm = MPI_COMM_NULL;
}

// Index of this rank's "leader" among all leaders (ordered by rank) and the
// number of leaders, shared with the members of `members` (leader = rank 0 of
// `members`). Collective over `comm` and `members`.
Status NumberLeaders(MPI_Comm comm, MPI_Comm members, bool is_leader, int* index, int* count) {
  int rank = 0;
  NVG_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_Comm leaders = MPI_COMM_NULL;
  NVG_MPI_CHECK(MPI_Comm_split(comm, is_leader ? 0 : MPI_UNDEFINED, rank, &leaders));
  int info[2] = {0, 0};
  if (is_leader) {
    Status s;
    if (MPI_Comm_rank(leaders, &info[0]) != MPI_SUCCESS || MPI_Comm_size(leaders, &info[1]) != MPI_SUCCESS)
      s = Status::Internal("MPI_Comm_rank/size of the leader communicator failed");
    MPI_Comm_free(&leaders);
    NVG_RETURN_IF_ERROR(s);
  }
  NVG_MPI_CHECK(MPI_Bcast(info, 2, MPI_INT, 0, members));
  *index = info[0];
  *count = info[1];
  return Status::Ok();
}

}  // namespace

TopologyComms::~TopologyComms() {
  FreeComm(&cross);
  FreeComm(&group);
  FreeComm(&local);
}

Status SplitNodes(MPI_Comm comm, Topology* topo, TopologyComms* comms) {
  NVG_MPI_CHECK(MPI_Comm_rank(comm, &topo->rank));
  NVG_MPI_CHECK(MPI_Comm_size(comm, &topo->size));
  NVG_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, topo->rank, MPI_INFO_NULL, &comms->local));
  NVG_MPI_CHECK(MPI_Comm_rank(comms->local, &topo->local_rank));
  NVG_MPI_CHECK(MPI_Comm_size(comms->local, &topo->local_size));
  NVG_RETURN_IF_ERROR(NumberLeaders(comm, comms->local, topo->local_rank == 0, &topo->node_index,
                                    &topo->node_count));
  topo->group_index = topo->rank;
  topo->group_count = topo->size;
  topo->group_rank = 0;
  topo->group_size = 1;
  return Status::Ok();
}

Status SplitGroups(MPI_Comm comm, int requested_group_size, const char* source, Topology* topo,
                   TopologyComms* comms) {
  const int g = requested_group_size > 0 ? requested_group_size : topo->local_size;
  // One agreement round: [min G, max G, min node size, max node size, min "G divides my node"].
  // Maxima travel negated so one MPI_MIN does all five.
  int view[5] = {g, -g, topo->local_size, -topo->local_size, topo->local_size % g == 0 ? 1 : 0};
  int agreed[5];
  NVG_MPI_CHECK(MPI_Allreduce(view, agreed, 5, MPI_INT, MPI_MIN, comm));
  const int g_min = agreed[0], g_max = -agreed[1];
  const int node_min = agreed[2], node_max = -agreed[3];
  const bool divides = agreed[4] == 1;
  const std::string nodes = node_min == node_max ? std::to_string(node_min) + " ranks per node"
                                                 : std::to_string(node_min) + " to " +
                                                       std::to_string(node_max) + " ranks per node";
  if (g_min != g_max)
    return Status::InvalidArgument(std::string(source) + " differs across ranks (values from " +
                                   std::to_string(g_min) + " to " + std::to_string(g_max) +
                                   "); set the same group size on every rank");
  if (requested_group_size <= 0 && node_min != node_max)
    return Status::InvalidArgument("nodes have different rank counts (" + nodes + "): set " + source +
                                   " to a common divisor");
  if (!divides)
    return Status::InvalidArgument(std::string(source) + "=" + std::to_string(g) +
                                   " does not divide the ranks of every node (" + nodes +
                                   "); choose a divisor of the ranks per node");

  topo->group_size = g;
  topo->group_rank = topo->local_rank % g;
  NVG_MPI_CHECK(MPI_Comm_split(comms->local, topo->local_rank / g, topo->local_rank, &comms->group));
  NVG_RETURN_IF_ERROR(NumberLeaders(comm, comms->group, topo->group_rank == 0, &topo->group_index,
                                    &topo->group_count));
  NVG_MPI_CHECK(MPI_Comm_split(comm, topo->group_rank, topo->group_index, &comms->cross));
  return Status::Ok();
}

}  // namespace nvgroup
