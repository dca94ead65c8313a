// The plan cache (plan_cache.h): PlanCache itself, and the engine's methods
// around it: admitting a group whole against its plan, demoting cached groups
// back into entries, running whole groups from their plans and making plans
// for groups that ran whole without one (Note [Cached plans], Note [Cached
// groups]).
#include "engine/plan_cache.h"

#include <algorithm>

#include "common/checks.h"
#include "engine/engine.h"

namespace nvgroup {

bool PlanMatchesCache(const Plan& plan, const ResponseCache& cache) {
  for (size_t k = 0; k < plan.slots.size(); ++k)
    if (cache.generation(plan.slots[k]) != plan.generations[k]) return false;
  return !plan.slots.empty();
}

uint64_t PlanId(uint64_t group_id, const Plan& plan) {
  uint64_t h = group_id;
  auto mix = [&h](uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);  // boost::hash_combine's constant
  };
  for (size_t k = 0; k < plan.slots.size(); ++k) {
    mix(static_cast<uint64_t>(plan.slots[k]));
    mix(plan.generations[k]);
  }
  for (const FusionBucket& b : plan.buckets) {
    mix(b.responses.size());
    for (size_t k = 0; k < b.responses.size(); ++k) {
      mix(b.responses[k]);
      mix(b.offsets[k]);
    }
  }
  return h;
}

std::vector<std::pair<int, uint64_t>> CacheBitWords(const std::vector<int>& slots) {
  std::vector<int> sorted = slots;
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::pair<int, uint64_t>> words;
  for (int slot : sorted) {
    if (words.empty() || words.back().first != slot / 64) words.push_back({slot / 64, 0});
    words.back().second |= uint64_t{1} << (slot % 64);
  }
  return words;
}

void PlanCache::Erase(uint64_t group_id) {
  auto it = plans_.find(group_id);
  digest_ ^= it->second.id;
  plans_.erase(it);
}

void PlanCache::Insert(uint64_t group_id, Plan plan) {
  if (plans_.size() >= kMaxPlans) {  // evict the least recently used (unique clock values)
    auto lru = plans_.begin();
    for (auto p = plans_.begin(); p != plans_.end(); ++p)
      if (p->second.last_use < lru->second.last_use) lru = p;
    digest_ ^= lru->second.id;
    plans_.erase(lru);
  }
  plan.last_use = ++clock_;
  digest_ ^= plan.id;
  plans_.emplace(group_id, std::move(plan));
}

// ---- The engine's use of the plan cache ----------------------------------------

const Plan* Engine::PlanFor(const Submission& s) const {
  if (s.group_id == 0 || joined_) return nullptr;
  const Plan* found = plans_.Find(s.group_id);
  if (found == nullptr) return nullptr;
  const Plan& plan = *found;
  if (plan.entry_of.size() != s.entries.size() || !PlanMatchesCache(plan, cache_)) return nullptr;
  // Names are unique among the submission's entries (TensorQueue::Push), so
  // a match of every member makes entry_of a one-to-one map.
  for (size_t k = 0; k < plan.slots.size(); ++k) {
    const uint32_t e = plan.entry_of[k];
    if (e >= s.entries.size() || !EntryMatchesResponse(s.entries[e], cache_.Get(plan.slots[k]), rank_))
      return nullptr;
  }
  return &plan;
}

void Engine::AdmitSubmission(Submission submission, double now) {
  Add(counters_.queue_entries);
  // Note [Refused duplicates] (controller.h): a group with a name refused and
  // not answered yet goes entry by entry (Admit holds those entries back).
  bool after_refusal = false;
  for (size_t i = 0; i < submission.entries.size() && !refusals_.empty() && !after_refusal; ++i)
    after_refusal = refusals_.count(submission.entries[i].request.name) != 0;
  if (!after_refusal && PlanFor(submission) != nullptr) {  // Note [Cached groups]
    if (timeline_.enabled())
      for (const TensorEntry& e : submission.entries) TimelineAdmitted(e, now);
    auto g = std::make_unique<CachedGroup>();
    g->submission = std::move(submission);
    g->since = now;
    cached_groups_.push_back(std::move(g));
    Add(counters_.cached_group_admissions);
    return;
  }
  for (TensorEntry& e : submission.entries) Admit(std::move(e), now);
}

void Engine::DemoteCachedGroups(double now, bool all) {
  size_t kept = 0;
  for (std::unique_ptr<CachedGroup>& g : cached_groups_) {
    // A plan that changed while the group waited (evicted, a member
    // renegotiated) no longer describes it: PlanFor checks it again.
    if (!all && now - g->since < report_cached_after_s_ && PlanFor(g->submission) != nullptr) {
      cached_groups_[kept++] = std::move(g);
      continue;
    }
    Add(counters_.cached_group_demotions);
    // The timeline's admission events were written when the group came.
    for (TensorEntry& e : g->submission.entries) AddPending(std::move(e), g->since);
  }
  cached_groups_.resize(kept);
}

void Engine::TakeReadyCachedGroups(const std::vector<uint64_t>& bits) {
  size_t kept = 0;
  for (std::unique_ptr<CachedGroup>& g : cached_groups_) {
    const Plan& plan = plans_.At(g->submission.group_id);  // checked by DemoteCachedGroups this cycle
    bool ready = true;
    for (const auto& [word, mask] : plan.bit_words) ready = ready && (bits[1 + word] & mask) == mask;
    if (!ready) {
      cached_groups_[kept++] = std::move(g);
      continue;
    }
    for (int slot : plan.slots) claimed_slots_[slot] = 1;
    ready_groups_.push_back(std::move(g));
  }
  cached_groups_.resize(kept);
}

Status Engine::RunPlans(std::vector<Work>* work, size_t cache_hits, std::vector<bool>* done) {
  if (plans_.empty()) return Status::Ok();
  plan_runs_.clear();
  for (const std::unique_ptr<CachedGroup>& g : ready_groups_) {
    Plan& plan = plans_.At(g->submission.group_id);
    plan_runs_.push_back({plan.first_slot, &plan, g.get()});
  }
  // The cache hits of whole groups (TakeCacheHits takes groups whole), in
  // order of their first member.
  std::vector<uint64_t> groups;
  for (size_t i = 0; i < cache_hits; ++i) {
    const ResponseMessage& r = *(*work)[i].response;
    if (r.group_id == 0 || (*done)[i]) continue;
    if (std::find(groups.begin(), groups.end(), r.group_id) == groups.end()) groups.push_back(r.group_id);
  }
  if (slot_to_work_.size() != static_cast<size_t>(cache_.capacity())) slot_to_work_.assign(cache_.capacity(), 0);
  for (size_t i = 0; i < cache_hits; ++i)
    if ((*work)[i].slot >= 0) slot_to_work_[(*work)[i].slot] = i;
  for (uint64_t group : groups) {
    Plan* found = plans_.Find(group);
    if (found == nullptr) continue;
    Plan& plan = *found;
    bool valid = PlanMatchesCache(plan, cache_);
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
    Add(counters_.plan_launches);
    if (run.group != nullptr) Add(counters_.cached_group_runs);
    for (const FusionBucket& b : plan.buckets) {
      plan_members_.clear();
      for (size_t k : b.responses) {
        if (run.group != nullptr) {
          plan_members_.push_back({&cache_.Get(plan.slots[k]), &run.group->submission.entries[plan.entry_of[k]]});
        } else {
          const size_t i = slot_to_work_[plan.slots[k]];
          (*done)[i] = true;
          plan_members_.push_back({(*work)[i].response, &(*work)[i].pending->entry});
        }
      }
      NVG_RETURN_IF_ERROR(RunMembers(b, plan_members_.data()));
    }
  }
  return Status::Ok();
}

void Engine::MakePlans(const std::vector<Work>& work) {
  if (cache_.capacity() == 0) return;
  std::unordered_map<uint64_t, std::vector<size_t>> members;  // group id -> work indices
  std::vector<uint64_t> order;
  uint64_t kept = 0;  // the last group found with a valid plan (members are adjacent)
  for (size_t i = 0; i < work.size(); ++i) {
    const ResponseMessage& r = *work[i].response;
    if (r.group_id == 0 || (r.group_id == kept && kept != 0)) continue;
    if (const Plan* existing = plans_.Find(r.group_id)) {
      if (PlanMatchesCache(*existing, cache_)) {  // checked once per group, not per member
        kept = r.group_id;
        continue;
      }
      plans_.Erase(r.group_id);  // a member was renegotiated: replan below
    }
    auto [it, inserted] = members.try_emplace(r.group_id);
    if (inserted) order.push_back(r.group_id);
    it->second.push_back(i);
  }
  const size_t threshold = std::min(knobs_.fusion_threshold, cpu_comm_->registered_capacity());
  for (uint64_t group : order) {
    const std::vector<size_t>& idx = members[group];
    Plan plan;
    std::vector<ResponseMessage> responses;
    bool ok = idx.size() == work[idx[0]].response->group_size;
    for (size_t i : idx) {
      const ResponseMessage& r = *work[i].response;
      const int slot = work[i].slot >= 0 ? work[i].slot : cache_.Find(r.name);
      ok = ok && r.ok() && r.type == CollectiveType::kAllreduce && slot >= 0 &&
           ResponseDigest(cache_.Get(slot)) == ResponseDigest(r);
      if (!ok) break;
      plan.slots.push_back(slot);
      plan.generations.push_back(cache_.generation(slot));
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
      if (p == nullptr || joined_) {
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

}  // namespace nvgroup
