// The plan cache: the fusion plans of grouped collectives, reused while their
// members stay in the response cache (Note [Cached plans]), and the groups
// admitted whole against a plan (Note [Cached groups]). The object that uses
// them (admission, demotion, running from a plan, making plans) is
// CachedGroups (cached_groups.h).
#pragma once

#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/fusion.h"
#include "engine/response_cache.h"
#include "engine/tensor_queue.h"

namespace nvgroup {

// Note [Cached plans]
// The buckets of a grouped collective (EnqueueGroup: the framework's
// deterministic gradient buckets) are planned once and reused. After a group
// has run whole (negotiated or from the cache), its plan records the
// members' cache slots in execution order, the slots' generations and the
// fusion buckets over them (PlanFusion of the group alone). When a later
// cycle's cache hits hold the whole group and every slot still has the
// recorded generation (no member was evicted or renegotiated), the group
// runs from the plan: no fusion planning, its buckets in the plan's fixed
// order. A new or changed group still negotiates (its members miss the
// cache) and gets a new plan. Plans change only while every rank processes
// the same ordered responses, so every rank holds the same plans; the
// cycle's agreement allreduce carries a digest of every rank's cache and
// plans (PlanCache::digest; the agreement in background_loop.cc), so ranks whose state
// diverged (a bug) fail on every rank instead of running different
// collectives.
struct Plan {
  std::vector<int> slots;             // members' cache slots, execution order
  std::vector<uint64_t> generations;  // the slots' generations at planning time
  std::vector<FusionBucket> buckets;  // indices into `slots`
  uint64_t id = 0;                    // hash of the three above (and the group id): PlanId
  uint64_t last_use = 0;
  int first_slot = 0;                 // the lowest of `slots`: plans run in this order
  // This rank's own (not agreed, not in `id`): where member k sat in the
  // Submission it was planned from (TensorEntry::group_index), and the
  // members' cache bits as (word, mask) pairs. See Note [Cached groups].
  std::vector<uint32_t> entry_of;
  std::vector<std::pair<int, uint64_t>> bit_words;
  // This rank's own: which plan this is, counted by PlanCache::Insert (a
  // plan replaced under the same group id gets a new serial), for
  // CachedGroups' memo of registered groups (Note [Registered groups]).
  uint64_t serial = 0;
};

// Every member slot still holds the response the plan was made from.
bool PlanMatchesCache(const Plan& plan, const ResponseCache& cache);

// The agreed identity of `plan` for group `group_id`: a hash of its slots,
// their generations and its buckets.
uint64_t PlanId(uint64_t group_id, const Plan& plan);

// The (word, mask) pairs of `slots`' cache bits, words ascending.
std::vector<std::pair<int, uint64_t>> CacheBitWords(const std::vector<int>& slots);

// The plans by group id, the same on every rank, with the XOR of their ids
// (part of the state digest) and a use clock for LRU eviction.
class PlanCache {
 public:
  static constexpr size_t kMaxPlans = 256;

  bool empty() const { return plans_.empty(); }
  // The plan of `group_id`, or null.
  Plan* Find(uint64_t group_id) {
    auto it = plans_.find(group_id);
    return it == plans_.end() ? nullptr : &it->second;
  }
  const Plan* Find(uint64_t group_id) const {
    auto it = plans_.find(group_id);
    return it == plans_.end() ? nullptr : &it->second;
  }
  // The plan of `group_id`, which must exist.
  Plan& At(uint64_t group_id) { return plans_.at(group_id); }
  const Plan& At(uint64_t group_id) const { return plans_.at(group_id); }
  // Drops the plan of `group_id` (which must exist) from the cache and the digest.
  void Erase(uint64_t group_id);
  // Adds `plan` (its id set) for `group_id`, first evicting the least recently
  // used plan when kMaxPlans are held.
  void Insert(uint64_t group_id, Plan plan);
  // Marks `plan` used now (a run from it).
  void Touch(Plan* plan) { plan->last_use = ++clock_; }
  // XOR of the plans' ids.
  uint64_t digest() const { return digest_; }

 private:
  std::unordered_map<uint64_t, Plan> plans_;  // by group id
  uint64_t digest_ = 0;
  uint64_t clock_ = 0;
  uint64_t serials_ = 0;
};

// Note [Cached groups]
// A group submitted again exactly as its plan was made (same group id, the
// members in the same submission order, each matching its slot's cached
// response, every slot's generation unchanged) is admitted whole: one queue
// entry, one plan lookup and one comparison per member (no name hashing,
// no per-member Pending, no response copies), and it sets its cache bits
// from the plan's precomputed words. After the agreement allreduce, in a
// cycle without a negotiation round, a group whose bits all survived the
// AND runs from its plan (CachedGroups::RunPlans, in first-slot order with the plans of
// groups admitted entry by entry, so every rank runs the same sequence
// whichever way each admitted it) and completes in one pass per bucket.
// The cache bits still carry the agreement: a rank whose group changed
// (or that admitted it entry by entry) sets exactly the bits it matches,
// so a mismatch negotiates and fails on every rank as before. Anything
// that needs per-name state turns the group back into entries (Demote):
// a negotiation round in the cycle (its members must be reportable, and
// rank 0's new responses may change cache slots), waiting past
// report_cached_after_s (Note [Reporting stuck cache hits] in
// negotiation.h), a join, or a plan that went stale while it waited.
struct CachedGroup {
  Submission submission;
  double since = 0;  // when the loop admitted it
};

}  // namespace nvgroup
