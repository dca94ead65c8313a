#include "engine/response_cache.h"

#include <algorithm>

namespace nvgroup {

bool RequestMatchesResponse(const RequestMessage& request, const ResponseMessage& response, int rank) {
  return RequestMatchesResponse(request, request.name, request.shape, response, rank);
}

bool RequestMatchesResponse(const RequestMessage& request, const std::string& name,
                            const std::vector<int64_t>& shape, const ResponseMessage& response, int rank) {
  if (!response.ok() || name != response.name || request.type != response.type ||
      request.dtype != response.dtype || request.device_kind != response.device_kind ||
      request.op != response.op || request.prescale_factor != response.prescale_factor ||
      request.postscale_factor != response.postscale_factor || request.root_rank != response.root_rank ||
      request.group_id != response.group_id || request.group_size != response.group_size)
    return false;
  if (request.type == CollectiveType::kJoin) return false;  // never cached
  if (request.type == CollectiveType::kAlltoall) {
    // Same trailing dimensions and this rank's row of the splits matrix.
    const size_t n = request.splits.size();
    if (rank < 0 || n == 0 || response.first_dims.size() != n * n || static_cast<size_t>(rank) >= n)
      return false;
    if (!std::equal(request.splits.begin(), request.splits.end(), response.first_dims.begin() + rank * n))
      return false;
    if (shape.size() != response.shape.size() || shape.empty()) return false;
    for (size_t d = 1; d < shape.size(); ++d)
      if (shape[d] != response.shape[d]) return false;
    return true;
  }
  if (request.type != CollectiveType::kAllgather) return shape == response.shape;
  if (shape.size() != response.shape.size() || shape.empty()) return false;
  if (rank < 0 || static_cast<size_t>(rank) >= response.first_dims.size()) return false;
  if (shape[0] != response.first_dims[rank]) return false;
  for (size_t d = 1; d < shape.size(); ++d)
    if (shape[d] != response.shape[d]) return false;
  return true;
}

uint64_t ResponseDigest(const ResponseMessage& r) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a 64 offset basis
  auto bytes = [&h](const void* p, size_t n) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ c[i]) * 1099511628211ull;  // FNV-1a 64 prime
  };
  auto value = [&bytes](auto v) { bytes(&v, sizeof(v)); };
  bytes(r.name.data(), r.name.size());
  value(static_cast<int>(r.error_code));
  value(static_cast<int>(r.type));
  value(static_cast<int>(r.dtype));
  value(static_cast<int>(r.device_kind));
  value(static_cast<int>(r.op));
  value(r.prescale_factor);
  value(r.postscale_factor);
  value(r.root_rank);
  value(r.shape.size());
  for (int64_t d : r.shape) value(d);
  value(r.first_dims.size());
  for (int64_t d : r.first_dims) value(d);
  value(r.group_id);
  value(r.group_size);
  return h;
}

ResponseCache::ResponseCache(int capacity)
    : slots_(capacity > 0 ? capacity : 0), generations_(slots_.size(), 0) {}

uint64_t ResponseCache::SlotDigest(int slot) const {
  // splitmix64 finalizer over (slot, generation), mixed with the response's hash.
  uint64_t x = (static_cast<uint64_t>(slot) << 40) ^ generations_[slot];
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x ^ ResponseDigest(slots_[slot].response);
}

int ResponseCache::Find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? -1 : it->second;
}

int ResponseCache::GroupCount(uint64_t group_id) const {
  auto it = group_counts_.find(group_id);
  return it == group_counts_.end() ? 0 : it->second;
}

void ResponseCache::Erase(int slot) {
  Slot& s = slots_[slot];
  digest_ ^= SlotDigest(slot);
  ++generations_[slot];
  by_name_.erase(s.response.name);
  if (s.response.group_id != 0 && --group_counts_[s.response.group_id] == 0)
    group_counts_.erase(s.response.group_id);
  s = Slot();
}

void ResponseCache::Put(const ResponseMessage& response) {
  if (slots_.empty()) return;
  int slot = Find(response.name);
  if (slot >= 0) {
    Erase(slot);
  } else {
    for (int i = 0; i < capacity() && slot < 0; ++i)
      if (!slots_[i].used) slot = i;
    if (slot < 0) {  // full: evict the least recently used (lowest clock; unique)
      slot = 0;
      for (int i = 1; i < capacity(); ++i)
        if (slots_[i].last_use < slots_[slot].last_use) slot = i;
      Erase(slot);
    }
  }
  Slot& s = slots_[slot];
  s.used = true;
  s.response = response;
  s.last_use = ++clock_;
  ++generations_[slot];
  digest_ ^= SlotDigest(slot);
  by_name_[response.name] = slot;
  if (response.group_id != 0) ++group_counts_[response.group_id];
}

void ResponseCache::Touch(int slot) { slots_[slot].last_use = ++clock_; }

}  // namespace nvgroup
