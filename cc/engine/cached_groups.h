// CachedGroups: the plans of grouped collectives (PlanCache, plan_cache.h)
// and the groups admitted whole against them. It owns the plans, the cached
// groups waiting for agreement (oldest first) and the cycle's ready groups;
// it admits a submission whole when its plan still describes it, demotes
// groups back into Negotiation's entries, sets their cache bits, runs the
// cycle's whole groups from their plans (through Execution) and makes plans
// for groups that ran whole without one (Note [Cached plans], Note [Cached
// groups], plan_cache.h).
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "engine/counters.h"
#include "engine/cycle_work.h"
#include "engine/negotiation.h"
#include "engine/plan_cache.h"
#include "engine/tensor_queue.h"
#include "engine/timeline.h"

namespace nvgroup {

class Execution;

class CachedGroups {
 public:
  // `negotiation` holds the response cache the plans are made over and takes
  // the entries of groups that are not (or no longer) admitted whole.
  CachedGroups(Negotiation* negotiation, int rank, EngineCounters* counters, Timeline* timeline);

  // No cached group waits.
  bool empty() const { return cached_.empty(); }
  // The cycle's groups that run from their plans (TakeReady).
  const std::vector<std::unique_ptr<CachedGroup>>& ready() const { return ready_; }
  // The plans' part of the state digest (Note [Cached plans]).
  uint64_t digest() const { return plans_.digest(); }

  // One submission from the queue: whole, if it fits its plan, else per
  // entry into Negotiation.
  void Admit(Submission submission, double now);
  // Admits the cached groups' entries one by one (Note [Cached groups]);
  // `all`: every group, else only those that can no longer run whole.
  void Demote(double now, bool all);
  // Sets the cached groups' cache bits from their plans.
  void SetCacheBits(std::vector<uint64_t>* bits) const;
  // Moves the cached groups whose bits survived the agreement into the ready
  // groups and claims their slots (Negotiation::ClaimSlots).
  void TakeReady(const std::vector<uint64_t>& bits);
  // Runs the cycle's whole cached groups that have a valid plan (the ready
  // groups and those in the first `cache_hits` work entries) through
  // `execution`; marks their work entries in `done`.
  Status RunPlans(std::vector<Work>* work, size_t cache_hits, std::vector<bool>* done, Execution* execution);
  // Records plans for groups of this cycle that ran whole without one
  // (`threshold`: the fusion threshold the buckets are planned with).
  void MakePlans(const std::vector<Work>& work, size_t threshold);
  // A failed cycle: fails the ready groups' entries not completed yet with
  // `status` (through `execution`).
  void FailReady(const Status& status, Execution* execution);
  // The end of a cycle: the ready groups ran (or failed); a registered
  // group's entries go back to their pool (Note [Registered groups]).
  void ClearReady();

 private:
  // The plan `s` can run from unchanged, or null.
  const Plan* PlanFor(const Submission& s);

  Negotiation* const negotiation_;
  const int rank_;
  EngineCounters* const counters_;
  Timeline* const timeline_;
  PlanCache plans_;                                   // the same on every rank
  std::vector<std::unique_ptr<CachedGroup>> cached_;  // admitted whole, waiting (oldest first)
  std::vector<std::unique_ptr<CachedGroup>> ready_;   // this cycle's, to run from their plans
  std::vector<size_t> slot_to_work_;                  // scratch of RunPlans, one per cache slot
  struct PlanRun {                                    // RunPlans' list: one group to run from its plan
    int first_slot;
    Plan* plan;
    CachedGroup* group;  // null: the members are work entries
  };
  std::vector<PlanRun> plan_runs_;
  std::vector<BucketMember> plan_members_;  // RunPlans' members of one bucket
  // Registered groups (by handle) whose entries matched a plan (its serial)
  // member by member: their entries never change (Note [Registered groups]),
  // so while the plan's slots keep their generations the next launch
  // matches it without comparing its members again.
  std::unordered_map<uint64_t, uint64_t> matched_plans_;
  static constexpr size_t kMaxMatchedPlans = 4 * PlanCache::kMaxPlans;
};

}  // namespace nvgroup
