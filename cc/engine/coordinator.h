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
// contribute zeros, see Negotiation::MakeJoinStandIn), and only allreduce and
// reducescatter of host tensors may complete that way (anything else becomes an
// error naming the joined ranks). The join itself completes once every rank
// joined; its response carries the last rank to join (root_rank). A rank's
// refusal of a duplicate takes the place of its request (Note [Refused
// duplicates]). The class is pure (no MPI, no clock of its own), so it is
// deterministic and testable.
//
// Note [Refused duplicates]
// TensorQueue::Push refuses a collective whose name is in flight on its rank
// (or repeats a name of its group). Whether a rank refuses depends on its
// timing: with A and then B of one name, a rank whose A is still in flight
// refuses B, while a rank whose A completed already accepts B, which waits for
// B on the ranks that refused it. So a refusal is not local: the refusing
// rank reports it to rank 0 as a request of that name (refused_duplicate set,
// one per name of the refused submission) and the refusal counts as that
// rank's submission of the name. Rank 0 matches it by name like any request;
// once every rank has reported the name or refused it, the response is
// RefusedDuplicateText, an error on every rank: ranks whose B waits fail it
// with the text the refusing rank got from Push. The rules that keep the
// generations of a name apart (A, B, and a later legal reuse C of the name):
//  * a rank reports its refusal only once it holds no request of that name
//    that came before it (its A was answered, or completed through the
//    response cache), so A's entry at rank 0 is gone (released or forgotten)
//    when the refusal arrives, and a refusal never meets its own rank's A;
//  * a request of that name admitted after the refusal (C) is held back on
//    the refusing rank, neither reported nor set in the cache bits, until the
//    refusal's answer arrived, so C never meets another rank's B (through rank
//    0 or the cache); the answer is the first response of that name after the
//    refusal was reported, so the rank consumes it and fails nothing with it.
// A program that refuses on some ranks a collective that other ranks never
// submit leaves the refusal waiting for them like any unmatched request: the
// stall inspector names it, and the next collective of that name on those
// ranks fails with the duplicate error.
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

// The error of a collective named `name` refused on `ranks` because a
// collective named `in_flight` was in flight there (Note [Refused
// duplicates]): the refusing rank's own error and, from rank 0, every other
// rank's.
std::string RefusedDuplicateText(const std::string& name, const std::string& in_flight,
                                 const std::vector<int>& ranks);

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
