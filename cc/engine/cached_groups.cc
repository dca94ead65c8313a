// The cached groups (cached_groups.h): admitting a group whole against its
// plan, demoting cached groups back into entries, running whole groups from
// their plans and making plans for groups that ran whole without one (Note
// [Cached plans], Note [Cached groups] in plan_cache.h).
#include "engine/cached_groups.h"

#include <algorithm>
#include <unordered_map>

#include "common/checks.h"
#include "engine/execution.h"

namespace nvgroup {

CachedGroups::CachedGroups(Negotiation* negotiation, int rank, EngineCounters* counters, Timeline* timeline)
    : negotiation_(negotiation), rank_(rank), counters_(counters), timeline_(timeline) {}

const Plan* CachedGroups::PlanFor(const Submission& s) {
  if (s.group_id == 0 || negotiation_->joined()) return nullptr;
  const Plan* found = plans_.Find(s.group_id);
  if (found == nullptr) return nullptr;
  const Plan& plan = *found;
  const ResponseCache& cache = negotiation_->cache();
  if (plan.entry_of.size() != s.entries.size() || !PlanMatchesCache(plan, cache)) return nullptr;
  if (s.registered_group != 0) {
    auto memo = matched_plans_.find(s.registered_group);
    if (memo != matched_plans_.end() && memo->second == plan.serial) return &plan;
  }
  // Names are unique among the submission's entries (TensorQueue::Push), so
  // a match of every member makes entry_of a one-to-one map.
  for (size_t k = 0; k < plan.slots.size(); ++k) {
    const uint32_t e = plan.entry_of[k];
    if (e >= s.entries.size() || !EntryMatchesResponse(s.entries[e], cache.Get(plan.slots[k]), rank_))
      return nullptr;
  }
  if (s.registered_group != 0) {
    if (matched_plans_.size() >= kMaxMatchedPlans) matched_plans_.clear();
    matched_plans_[s.registered_group] = plan.serial;
  }
  return &plan;
}

void CachedGroups::Admit(Submission submission, double now) {
  EngineCounters::Add(counters_->queue_entries);
  // Note [Refused duplicates] (coordinator.h): a group with a name refused and
  // not answered yet goes entry by entry (Negotiation::Admit holds those
  // entries back).
  const bool after_refusal = negotiation_->RefusedAnyName(submission);
  if (!after_refusal && PlanFor(submission) != nullptr) {  // Note [Cached groups]
    if (timeline_->enabled())
      for (const TensorEntry& e : submission.entries) TimelineAdmitted(timeline_, e, now);
    auto g = std::make_unique<CachedGroup>();
    g->submission = std::move(submission);
    g->since = now;
    cached_.push_back(std::move(g));
    EngineCounters::Add(counters_->cached_group_admissions);
    return;
  }
  for (TensorEntry& e : submission.entries) negotiation_->Admit(std::move(e), now);
}

void CachedGroups::Demote(double now, bool all) {
  size_t kept = 0;
  for (std::unique_ptr<CachedGroup>& g : cached_) {
    // A plan that changed while the group waited (evicted, a member
    // renegotiated) no longer describes it: PlanFor checks it again.
    if (!all && now - g->since < negotiation_->report_cached_after_s() && PlanFor(g->submission) != nullptr) {
      cached_[kept++] = std::move(g);
      continue;
    }
    EngineCounters::Add(counters_->cached_group_demotions);
    // The timeline's admission events were written when the group came.
    for (TensorEntry& e : g->submission.entries) negotiation_->AddPending(std::move(e), g->since);
  }
  cached_.resize(kept);
}

void CachedGroups::SetCacheBits(std::vector<uint64_t>* bits) const {
  for (const std::unique_ptr<CachedGroup>& g : cached_)  // Note [Cached groups]
    for (const auto& [word, mask] : plans_.At(g->submission.group_id).bit_words) (*bits)[1 + word] |= mask;
}

void CachedGroups::TakeReady(const std::vector<uint64_t>& bits) {
  size_t kept = 0;
  for (std::unique_ptr<CachedGroup>& g : cached_) {
    const Plan& plan = plans_.At(g->submission.group_id);  // checked by Demote this cycle
    bool ready = true;
    for (const auto& [word, mask] : plan.bit_words) ready = ready && (bits[1 + word] & mask) == mask;
    if (!ready) {
      cached_[kept++] = std::move(g);
      continue;
    }
    negotiation_->ClaimSlots(plan.slots);
    ready_.push_back(std::move(g));
  }
  cached_.resize(kept);
}

Status CachedGroups::RunPlans(std::vector<Work>* work, size_t cache_hits, std::vector<bool>* done,
                              Execution* execution) {
  if (plans_.empty()) return Status::Ok();
  const ResponseCache& cache = negotiation_->cache();
  plan_runs_.clear();
  for (const std::unique_ptr<CachedGroup>& g : ready_) {
    Plan& plan = plans_.At(g->submission.group_id);
    plan_runs_.push_back({plan.first_slot, &plan, g.get()});
  }
  // The cache hits of whole groups (Negotiation::TakeCacheHits takes groups
  // whole), in order of their first member.
  std::vector<uint64_t> groups;
  for (size_t i = 0; i < cache_hits; ++i) {
    const ResponseMessage& r = *(*work)[i].response;
    if (r.group_id == 0 || (*done)[i]) continue;
    if (std::find(groups.begin(), groups.end(), r.group_id) == groups.end()) groups.push_back(r.group_id);
  }
  if (slot_to_work_.size() != static_cast<size_t>(cache.capacity()))
    slot_to_work_.assign(cache.capacity(), 0);
  for (size_t i = 0; i < cache_hits; ++i)
    if ((*work)[i].slot >= 0) slot_to_work_[(*work)[i].slot] = i;
  for (uint64_t group : groups) {
    Plan* found = plans_.Find(group);
    if (found == nullptr) continue;
    Plan& plan = *found;
    bool valid = PlanMatchesCache(plan, cache);
    for (size_t k = 0; k < plan.slots.size() && valid; ++k) {
      // The slot is one of this cycle's hits (the hits hold the group whole);
      // entries of slots not hit this cycle are stale, hence both checks.
      const int slot = plan.slots[k];
      valid = slot_to_work_[slot] < cache_hits && (*work)[slot_to_work_[slot]].slot == slot;
    }
    if (!valid || plan.slots.size() != (*work)[slot_to_work_[plan.slots[0]]].response->group_size) {
      plans_.Erase(group);  // a member changed: the group replans after it runs
      continue;
    }
    plan_runs_.push_back({plan.first_slot, &plan, nullptr});
  }
  // Every rank runs the same plans in the same order (lowest member slot
  // first), whether it admitted a group whole or entry by entry.
  std::sort(plan_runs_.begin(), plan_runs_.end(),
            [](const PlanRun& a, const PlanRun& b) { return a.first_slot < b.first_slot; });
  for (const PlanRun& run : plan_runs_) {
    Plan& plan = *run.plan;
    plans_.Touch(&plan);
    EngineCounters::Add(counters_->plan_launches);
    if (run.group != nullptr) EngineCounters::Add(counters_->cached_group_runs);
    for (const FusionBucket& b : plan.buckets) {
      plan_members_.clear();
      for (size_t k : b.responses) {
        if (run.group != nullptr) {
          plan_members_.push_back({&cache.Get(plan.slots[k]),
                                   &run.group->submission.entries[plan.entry_of[k]]});
        } else {
          const size_t i = slot_to_work_[plan.slots[k]];
          (*done)[i] = true;
          plan_members_.push_back({(*work)[i].response, &(*work)[i].pending->entry});
        }
      }
      NVG_RETURN_IF_ERROR(execution->RunMembers(b, plan_members_.data()));
    }
  }
  return Status::Ok();
}

void CachedGroups::MakePlans(const std::vector<Work>& work, size_t threshold) {
  const ResponseCache& cache = negotiation_->cache();
  if (cache.capacity() == 0) return;
  std::unordered_map<uint64_t, std::vector<size_t>> members;  // group id -> work indices
  std::vector<uint64_t> order;
  uint64_t kept = 0;  // the last group found with a valid plan (members are adjacent)
  for (size_t i = 0; i < work.size(); ++i) {
    const ResponseMessage& r = *work[i].response;
    if (r.group_id == 0 || (r.group_id == kept && kept != 0)) continue;
    if (const Plan* existing = plans_.Find(r.group_id)) {
      if (PlanMatchesCache(*existing, cache)) {  // checked once per group, not per member
        kept = r.group_id;
        continue;
      }
      plans_.Erase(r.group_id);  // a member was renegotiated: replan below
    }
    auto [it, inserted] = members.try_emplace(r.group_id);
    if (inserted) order.push_back(r.group_id);
    it->second.push_back(i);
  }
  for (uint64_t group : order) {
    const std::vector<size_t>& idx = members[group];
    Plan plan;
    std::vector<ResponseMessage> responses;
    bool ok = idx.size() == work[idx[0]].response->group_size;
    for (size_t i : idx) {
      const ResponseMessage& r = *work[i].response;
      const int slot = work[i].slot >= 0 ? work[i].slot : cache.Find(r.name);
      ok = ok && r.ok() && r.type == CollectiveType::kAllreduce && slot >= 0 &&
           ResponseDigest(cache.Get(slot)) == ResponseDigest(r);
      if (!ok) break;
      plan.slots.push_back(slot);
      plan.generations.push_back(cache.generation(slot));
      responses.push_back(r);
    }
    if (!ok) continue;
    plan.buckets = PlanFusion(responses, threshold);
    // This rank's own: how to admit the group whole next time (Note [Cached
    // groups]); a member without its own entry (a join's stand-in) leaves
    // entry_of empty, so the group is always admitted entry by entry.
    plan.first_slot = *std::min_element(plan.slots.begin(), plan.slots.end());
    for (size_t i : idx) {
      const Pending* p = work[i].pending.get();
      if (p == nullptr || negotiation_->joined()) {
        plan.entry_of.clear();
        break;
      }
      plan.entry_of.push_back(p->entry.group_index);
    }
    plan.bit_words = CacheBitWords(plan.slots);
    plan.id = PlanId(group, plan);
    plans_.Insert(group, std::move(plan));
  }
}

void CachedGroups::ClearReady() {
  for (std::unique_ptr<CachedGroup>& g : ready_)
    if (g->submission.pool != nullptr) g->submission.pool->Give(std::move(g->submission.entries));
  ready_.clear();
}

void CachedGroups::FailReady(const Status& status, Execution* execution) {
  for (std::unique_ptr<CachedGroup>& g : ready_)
    for (TensorEntry& e : g->submission.entries)
      if (e.request.done) execution->Complete(&e, status);
  ready_.clear();
}

}  // namespace nvgroup
