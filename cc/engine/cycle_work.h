// The cycle's work list: what one background-loop cycle hands from
// negotiation (negotiation.h) to the cached groups (cached_groups.h) and to
// execution (execution.h). A Work entry is one agreed response with this
// rank's entry; it dies at the end of the cycle.
#pragma once

#include <memory>
#include <utility>

#include "engine/tensor_queue.h"
#include "engine/wire_format.h"

namespace nvgroup {

// One of this rank's requests waiting for agreement (Negotiation's pending
// entries).
struct Pending {
  Pending() = default;
  Pending(TensorEntry&& e, double since_s) : entry(std::move(e)), since(since_s) {}
  TensorEntry entry;
  bool reported = false;  // sent to rank 0 in a negotiation round
  bool taken = false;     // moved out of the pending entries this cycle (DropTaken drops it)
  // Admitted after a refusal of its name that rank 0 has not answered yet:
  // neither reported nor in the cache bits until then (Note [Refused
  // duplicates] in coordinator.h).
  bool held = false;
  double since = 0;  // when the loop took it from the queue
};

// A response with this rank's entry (absent for error responses about names
// this rank never submitted).
struct Work {
  // A cache hit's slot in the response cache (not copied: the cache does not
  // change between TakeCacheHits and the end of Execute, but in a cycle with a
  // negotiation round, whose Puts may, so the loop makes the hits Own() theirs
  // before it), or `owned`.
  const ResponseMessage* response = nullptr;
  std::unique_ptr<ResponseMessage> owned;
  std::unique_ptr<Pending> pending;
  int slot = -1;  // the response cache slot it came from (cache hits only)
  void Own() {
    if (owned == nullptr) owned = std::make_unique<ResponseMessage>(*response);
    response = owned.get();
  }
};

// One member of an allreduce bucket: its agreed response and its entry.
struct BucketMember {
  const ResponseMessage* response;
  TensorEntry* entry;
};

}  // namespace nvgroup
