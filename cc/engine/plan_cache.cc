// The plan cache (plan_cache.h): PlanCache and the plans' checks, ids and
// cache bits. The groups that run from the plans are CachedGroups'
// (cached_groups.cc).
#include "engine/plan_cache.h"

#include <algorithm>

#include "common/checks.h"

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
  plan.serial = ++serials_;
  digest_ ^= plan.id;
  plans_.emplace(group_id, std::move(plan));
}

}  // namespace nvgroup
