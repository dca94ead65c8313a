// Negotiation: this rank's side of agreeing on what is ready. It owns the
// entries waiting for agreement (pending, in admission order), this rank's
// refusals of duplicates not answered yet, the response cache and its cache
// bits, this rank's join, the MPI buffers of the cycle's agreement and of a
// negotiation round, and on rank 0 the Coordinator (coordinator.h) and the
// stall inspector. The background loop (engine.h) calls it in this order
// each cycle: Admit / AddRefusal, FillCacheBits (then the agreement
// allreduce), TakeCacheHits, Round when the agreement asked for one.
#pragma once

#include <mpi.h>

#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/env.h"
#include "engine/coordinator.h"
#include "engine/counters.h"
#include "engine/cycle_work.h"
#include "engine/mpi_wait.h"
#include "engine/response_cache.h"
#include "engine/stall_inspector.h"
#include "engine/tensor_queue.h"
#include "engine/timeline.h"

namespace nvgroup {

// Note [Reporting stuck cache hits]
// A cached request only sets its bit; rank 0 hears of it only if a negotiation
// round happens. If it is not ready on every rank within report_cached_after_s
// (1 s, or half the stall warning/shutdown time when shorter), this rank forces
// a round and reports it, so the stall inspector can name the missing ranks.
// Reporting does not stop it from completing through the cache later: rank 0
// then forgets its report (Coordinator::Forget). 1 s: ranks of a healthy job
// drift apart by milliseconds to ~100 ms per step (input pipelines, stragglers),
// so steady-state steps never pay for a report, while the default 60 s stall
// warning still sees the name almost from the start.

// The timeline's events of an entry the loop took from the queue at `now`
// (rank 0's timeline; a no-op when it is off is the caller's check).
void TimelineAdmitted(Timeline* timeline, const TensorEntry& entry, double now);

class Negotiation {
 public:
  // `comm`: the engine's communicator (owned by the Engine); `abort`: polled
  // by every wait; `counters` and `timeline` are the Engine's.
  Negotiation(const Knobs& knobs, MPI_Comm comm, int rank, int size, const std::atomic<bool>& abort,
              EngineCounters* counters, Timeline* timeline);

  const ResponseCache& cache() const { return cache_; }
  int cache_words() const { return cache_words_; }
  // See Note [Reporting stuck cache hits].
  double report_cached_after_s() const { return report_cached_after_s_; }
  // This rank's join is pending (a join was admitted and has not run yet).
  bool joined() const { return joined_; }
  // The join ran (Execution::RunJoin's response): this rank takes part again.
  void EndJoin() { joined_ = false; }
  bool HasPending() const { return !pending_.empty(); }
  // Nothing of this rank waits for agreement: no pending entry, no join, no
  // refusal due (Note [An idle rank sleeps] in wait_policy.h; the cached
  // groups are the caller's to add).
  bool NothingInFlight() const {
    return pending_.empty() && !joined_ && (refusals_.empty() || !AnyRefusalDue());
  }

  // ---- Admission ----
  // `entry` is moved from once, into its Pending.
  void Admit(TensorEntry&& entry, double now);
  // Admit's bookkeeping: a Pending among the pending entries, waiting since
  // `since` (also the way back for a demoted cached group's entries).
  void AddPending(TensorEntry&& entry, double since);
  // Note [Refused duplicates] (coordinator.h): a refused push from the queue.
  void AddRefusal(const Submission& refusal);
  // Whether a name of `s` was refused and not answered yet (its entries then
  // go entry by entry, and Admit holds them back).
  bool RefusedAnyName(const Submission& s) const;

  // ---- The agreement ----
  // The agreement allreduce's buffer (see CycleBuffers).
  std::vector<uint64_t>& agreement_bits() { return mpi_buffers_->bits; }
  // Sets the cache bits of this rank's ready pending entries (and a joined
  // rank's stand-ins) in `bits` (word 0 is the flag word); returns whether
  // this rank needs a negotiation round.
  bool FillCacheBits(double now, std::vector<uint64_t>* bits);
  // Rank 0: collects the stall inspector's error responses for the next
  // round; returns whether any wait for one.
  bool TakeStalledResponses(double now);
  // A ready cached group (cached_groups.h) runs these slots this cycle:
  // TakeCacheHits touches them in slot order but does not take them.
  void ClaimSlots(const std::vector<int>& slots) {
    for (int slot : slots) claimed_slots_[slot] = 1;
  }
  // The agreed cache hits (`bits` after the AND), in slot order, out of the
  // pending entries.
  std::vector<Work> TakeCacheHits(const std::vector<uint64_t>& bits);
  // The negotiation round of cycle `cycle`: reports this rank's new requests
  // and due refusals to rank 0, which answers every rank with the same
  // response list; appends its responses to `work`.
  Status Round(double now, uint64_t cycle, std::vector<Work>* work);

  // ---- Exit ----
  // The pending entries, oldest first, and dropping them all.
  const std::vector<Pending*>& pending_order() const { return order_; }
  void ClearPending() {
    order_.clear();
    pending_.clear();
  }
  // After an abandoned MPI operation: the buffers it may still write are
  // never freed (see CycleBuffers).
  void AbandonBuffers() { (void)mpi_buffers_.release(); }

 private:
  // Whether a refusal of `name` is due for the next negotiation round.
  bool RefusalDue(const std::string& name) const;
  bool AnyRefusalDue() const;
  // Whether `r` answers this rank's reported refusal of its name (consumed).
  bool TakeRefusalAnswer(const ResponseMessage& r);
  // Drops the entries taken out of pending_ from order_ (before they die
  // with the cycle's work).
  void DropTaken();
  Status Negotiate(double now, uint64_t cycle, std::vector<Work>* work);
  // Join: on a rank that has joined, the stand-in request for a collective it
  // never submitted (zeros in, output discarded); null if `r` cannot take one.
  std::unique_ptr<Pending> MakeJoinStandIn(const ResponseMessage& r);
  // Join: cache bits a joined rank sets for every cached response it can
  // stand in for.
  void SetJoinedCacheBits(std::vector<uint64_t>* bits);
  // `what` names the operation in a timeout or abort message (of `cycle`).
  Status Wait(MPI_Request* request, const char* what, uint64_t cycle) {
    return WaitMpi(request, what, peer_timeout_s_, abort_, static_cast<int64_t>(cycle));
  }

  MPI_Comm comm_;
  const int rank_;
  const int size_;
  const double peer_timeout_s_;
  const std::atomic<bool>& abort_;
  EngineCounters* const counters_;
  Timeline* const timeline_;

  // Memory that the cycle's non-blocking MPI operations read or write. An
  // operation abandoned after a timeout or an abort may still complete later,
  // so once that happened this memory is never freed (AbandonBuffers).
  struct CycleBuffers {
    std::vector<uint64_t> bits;  // flag word + cache bits
    int my_length = 0;
    std::vector<int> lengths, displs;
    std::vector<uint8_t> request_bytes, gathered, response_bytes;
    uint64_t response_length = 0;
  };
  std::unique_ptr<CycleBuffers> mpi_buffers_ = std::make_unique<CycleBuffers>();

  std::unordered_map<std::string, std::unique_ptr<Pending>> pending_;
  std::vector<Pending*> order_;  // pending_'s entries, oldest first
  // This rank's refusals of each name not answered yet (Note [Refused
  // duplicates] in coordinator.h): the names in flight that refused them,
  // oldest first, and whether the oldest was reported (at most one of a name
  // is out at a time).
  struct Refusals {
    std::deque<std::string> unreported;
    bool reported = false;
  };
  std::unordered_map<std::string, Refusals> refusals_;
  ResponseCache cache_;  // the same on every rank
  const int cache_words_;
  std::vector<uint8_t> claimed_slots_;  // ClaimSlots
  double report_cached_after_s_;
  bool joined_ = false;  // this rank's join is pending
  StallInspector stall_;                  // rank 0
  Coordinator coordinator_;               // rank 0
  std::vector<ResponseMessage> stalled_;  // rank 0: stall errors for the next round
};

}  // namespace nvgroup
