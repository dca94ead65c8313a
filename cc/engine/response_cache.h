// Response cache: negotiation-free agreement for collectives seen before.
//
// How it works. Every rank holds an identical cache of successful responses,
// `capacity` slots indexed by slot number. It stays identical because it only
// changes while all ranks process the same ordered response list: Put() for
// each successful response negotiated through rank 0, Touch() for each cache
// hit, in the same order everywhere, with a deterministic LRU (a logical clock,
// lowest free slot first). A rank whose ready request matches slot s (same
// name and parameters, see Matches) sets bit s of its bit vector; one bitwise
// AND allreduce tells every rank which slots are ready on all ranks, and those
// run without a round trip to rank 0. A request whose parameters changed does
// not match, goes through rank 0, and its new response replaces the slot
// (Put on an existing name), which invalidates the old entry on every rank.
//
// Each slot has a generation, bumped whenever its content changes (Put,
// eviction), so a cached execution plan (plan_cache.h) can tell that its
// members are still the responses it was made from. digest() is an
// order-independent hash of the whole cache (every used slot's number,
// generation and response): the ranks compare it in every cycle's agreement
// allreduce, so caches that diverged (a bug) are an error on every rank,
// never a wrong result.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/wire_format.h"

namespace nvgroup {

// True if `request` (this rank's, `rank`) is what `response` was negotiated
// for: same collective, dtype, device kind, op, scale factors, root and group,
// and the same shape (allgather: same trailing dimensions and this rank's
// first dimension as recorded for `rank`).
bool RequestMatchesResponse(const RequestMessage& request, const ResponseMessage& response, int rank);
// The same, with the request's name and shape given apart (a TensorEntry
// keeps them only in its CollectiveRequest); request.name/shape are ignored.
bool RequestMatchesResponse(const RequestMessage& request, const std::string& name,
                            const std::vector<int64_t>& shape, const ResponseMessage& response, int rank);

// A hash of every field of `response` (FNV-1a 64 over its encoding).
uint64_t ResponseDigest(const ResponseMessage& response);

class ResponseCache {
 public:
  explicit ResponseCache(int capacity);

  int capacity() const { return static_cast<int>(slots_.size()); }
  // Slot holding `name`, or -1.
  int Find(const std::string& name) const;
  const ResponseMessage& Get(int slot) const { return slots_[slot].response; }
  // Number of cached responses of group `group_id`.
  int GroupCount(uint64_t group_id) const;

  // Inserts `response` (replacing the entry of the same name, if any); evicts
  // the least recently used entry when full. No-op when capacity is 0.
  void Put(const ResponseMessage& response);
  void Touch(int slot);

  uint64_t generation(int slot) const { return generations_[slot]; }
  uint64_t digest() const { return digest_; }

 private:
  struct Slot {
    bool used = false;
    uint64_t last_use = 0;
    ResponseMessage response;
  };
  void Erase(int slot);

  uint64_t SlotDigest(int slot) const;

  std::vector<Slot> slots_;
  std::vector<uint64_t> generations_;  // per slot, survives Erase
  uint64_t digest_ = 0;                // XOR of SlotDigest over used slots
  std::unordered_map<std::string, int> by_name_;
  std::unordered_map<uint64_t, int> group_counts_;
  uint64_t clock_ = 0;
};

}  // namespace nvgroup
