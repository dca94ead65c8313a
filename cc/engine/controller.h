// Coordinator: rank 0's side of negotiation (Horovod's controller, without MPI).
//
// How it works. Each negotiation round rank 0 feeds it every rank's newly
// reported requests (AddRequest). A name is *complete* once all ranks have
// reported it; BuildResponse then checks that the ranks agree on every
// parameter and yields either the agreed response or an error naming the
// tensor, the parameter and each rank's value. Complete responses are released
// in the order they completed (the deterministic order every rank executes),
// except grouped ones: they wait until every member of their group is
// complete, then are released together, adjacent. Names that completed through
// the response cache instead are dropped with Forget.
// Join: a rank's join request marks it *joined*; from then on a name is
// complete once every rank has reported it or joined (the joined ranks
// contribute zeros, see Engine::MakeJoinStandIn), and only allreduce and
// reducescatter of host tensors may complete that way (anything else becomes an
// error naming the joined ranks). The join itself completes once every rank
// joined; its response carries the last rank to join (root_rank). The class is pure (no
// MPI, no clock of its own), so it is deterministic and testable.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/stall_inspector.h"
#include "engine/wire_format.h"

namespace nvgroup {

// The response for one name given every rank's request (index = rank).
// Mismatches become kFailedPrecondition responses such as
// "Mismatched allreduce tensor shapes for 'w': rank 0 has [2, 3], rank 1 has [3, 3]".
ResponseMessage BuildResponse(const std::vector<RequestMessage>& by_rank);

class Coordinator {
 public:
  // `stall` (may be null) is told about reports and completions.
  Coordinator(int size, StallInspector* stall);

  void AddRequest(int rank, RequestMessage request, double now);
  // `name` completed through the response cache: drop what rank 0 holds for it.
  void Forget(const std::string& name);
  // Whether any rank's report is held (else Forget has nothing to drop).
  bool HoldsReports() const { return !table_.empty(); }
  // Responses released since the last call, in execution order.
  std::vector<ResponseMessage> TakeReadyResponses();
  // Error responses for names stalled past NVGROUP_STALL_SHUTDOWN_TIME (and
  // for the completed members of their groups, which can never be released).
  std::vector<ResponseMessage> TakeStalledResponses(double now);

 private:
  struct Pending {
    std::vector<RequestMessage> by_rank;
    std::vector<bool> reported;
    int count = 0;
  };
  void Release(ResponseMessage response);
  // Note [Groups that cannot run]: fail what is held of the groups of `p`'s
  // reporters after their groups turned out to differ across ranks.
  void FailGroupsOf(const Pending& p, const std::string& message);
  // An error response for `name` of no group (released at once) with `message`.
  void ReleaseError(const std::string& name, const std::string& message);
  // Join: true once every rank has reported `p` or joined.
  bool Complete(const Pending& p) const;
  // Builds, checks against the joined ranks and releases the response of a
  // complete entry (erases it from table_).
  void Finish(std::unordered_map<std::string, Pending>::iterator it);

  int size_;
  // Join (engine.h): ranks whose join request arrived, and the last of them.
  std::vector<bool> joined_;
  int joined_count_ = 0;
  int last_joined_ = -1;
  StallInspector* stall_;
  std::unordered_map<std::string, Pending> table_;
  // Groups with members still incomplete: how many members completed, and the
  // successful ones held back until the whole group can run.
  struct HeldGroup {
    uint32_t completed = 0;
    std::vector<ResponseMessage> held;
  };
  std::unordered_map<uint64_t, HeldGroup> groups_;
  // Note [Groups that cannot run]: (rank, group id) -> the error its members
  // get, and how many of its members have not been failed yet.
  struct FailedGroup {
    std::string message;
    uint32_t left = 0;
  };
  std::map<std::pair<int, uint64_t>, FailedGroup> failed_groups_;
  std::vector<ResponseMessage> ready_;
};

}  // namespace nvgroup
