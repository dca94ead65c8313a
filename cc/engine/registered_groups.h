// RegisteredGroups: the registered groups of the process (RegisterGroup,
// nvgroup/engine.h), by handle, and their launches.
//
// Note [Registered groups]
// A step's grouped allreduce is the same group every time; EnqueueGroup
// still paid, per member and per step, for the caller building a
// CollectiveRequest (a name string, a shape vector, a done callback), for
// validation, the group id's hash of every name, building the entry, and
// the queue's insert and erase of every name in flight. A registered group
// pays each of those once, at RegisterGroup:
//  * validation (ValidateRegisteredMember) and the entries (Runtime's one
//    builder, the same one EnqueueGroup uses, so the same messages and group
//    id: a launch is indistinguishable from EnqueueGroup on the wire, in the
//    response cache and in the plans);
//  * the names: reserved in the engine's queue (Note [Registered names] in
//    tensor_queue.h), which counts the launch's members down instead;
//  * the entries: an EntryPool hands a launch a ready set, which the loop
//    gives back after the group ran whole from its plan, so a launch writes
//    only each member's pointers, the ready event and a done callback that
//    holds one pointer (RegisteredLaunch::MemberDone: no allocation);
//  * the plan match: CachedGroups compares the members with their cached
//    responses once per plan, not once per launch (CachedGroups'
//    matched_plans_).
// Per launch remain: one registry lookup, one RegisteredLaunch, the
// per-member pointer writes and checks, and one queue push; in the engine
// the plan's per-member work (the fused copies' member list) and one count
// down per bucket for its members (Completion::CompleteAfterStream; a member
// completed alone, on a path below, counts itself down through MemberDone).
// Completion events are announced to the launch once per bucket, and its
// `done` runs once. Anything unusual (the first launch, a
// negotiation round, a join, a stall) takes the entries one by one, exactly
// as EnqueueGroup's (the pool then copies its model for the next launch).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "engine/engine.h"
#include "engine/tensor_queue.h"
#include "nvgroup/engine.h"

namespace nvgroup {

class RegisteredGroups {
 public:
  // Registers `model` (Runtime's validated entries of the members, for
  // `engine`, their process set's), reserving its names in the engine's queue.
  StatusOr<uint64_t> Add(const std::shared_ptr<Engine>& engine, Submission model);
  // One launch (EnqueueRegisteredGroup).
  Status Launch(uint64_t handle, GroupLaunch launch);
  // UnregisterGroup: fails while a launch is in flight.
  Status Remove(uint64_t handle);
  // RegisteredGroupUsable: Launch would find the handle and its engine.
  bool Usable(uint64_t handle) const;
  // Shutdown: forgets every registration (their engines are gone).
  void Clear();

 private:
  struct Group {
    std::weak_ptr<Engine> engine;  // its process set's; expired once that engine stopped
    uint64_t group_id = 0;  // the members' group id (EnqueueGroup's)
    std::shared_ptr<EntryPool> pool;
    std::vector<char> has_data;  // per member: it has elements, so its pointers must not be null
  };
  StatusOr<std::shared_ptr<const Group>> Find(uint64_t handle) const;

  mutable std::mutex mu_;  // guards the three below
  std::unordered_map<uint64_t, std::shared_ptr<const Group>> groups_;
  uint64_t next_handle_ = 1;
  uint64_t forgotten_below_ = 1;  // handles below it were registered before the last Shutdown
};

}  // namespace nvgroup
