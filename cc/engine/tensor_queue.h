// TensorQueue: the hand-off between the threads that submit collectives and
// the background loop, and the registry of names in flight.
//
// How it works. Push (any thread) validates that no name is already in flight,
// appends the entries and wakes the loop through a condition variable, so a
// lone small request does not wait for the cycle timer. The loop takes every
// queued entry at the start of a cycle (WaitAndPop). A name stays in flight
// until Finish, which the engine calls just before the request's `done`, so a
// callback may resubmit the same name. A push refused for a name in flight
// fails on the caller's thread and also queues a record of the refusal (a
// Submission without entries) in its place, for rank 0 to hear of it (Note
// [Refused duplicates] in coordinator.h). Close makes later pushes fail with
// the given status and hands back whatever was still queued.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "engine/response_cache.h"
#include "engine/wire_format.h"
#include "nvgroup/engine.h"

namespace nvgroup {

class RegisteredLaunch;  // registered_launch.h

// One submitted collective, self-contained: the caller's request plus what
// this rank reports to rank 0 about it.
struct TensorEntry {
  CollectiveRequest request;
  // What this rank reports to rank 0, but for the name and the shape: they
  // stay in `request` (no copies on the enqueue path). Report() is the whole.
  RequestMessage message;
  RequestMessage Report() const {
    RequestMessage m = message;
    m.name = request.name;
    m.shape = request.shape;
    return m;
  }
  double enqueue_time = 0;  // when Push queued it (engine clock, MonotonicSeconds), for the timeline
  uint32_t group_index = 0;  // position in its Submission (the order the caller gave)
  // A member of a registered group's launch (Note [Registered groups],
  // registered_groups.h): the group's handle, whose names the queue holds
  // reserved (0: not registered, the name is in flight by itself), and the
  // launch, which hears of completion events once per bucket.
  uint64_t registered_group = 0;
  RegisteredLaunch* launch = nullptr;
};

// One Enqueue or EnqueueGroup: its entries travel as one queue entry from
// Push to the background loop, which admits a cached group whole (Note
// [Cached groups] in plan_cache.h) and anything else entry by entry.
// Whether `entry` is what `response` was negotiated for (RequestMatchesResponse).
inline bool EntryMatchesResponse(const TensorEntry& entry, const ResponseMessage& response, int rank) {
  return RequestMatchesResponse(entry.message, entry.request.name, entry.request.shape, response, rank);
}

// A registered group's entries (names, shapes, messages: the registration's
// copy), reused from launch to launch so that a launch builds no strings and
// allocates nothing per member (Note [Registered groups]). Take (caller's
// thread) hands out a free set or a copy of the registration's; Give (the
// background loop, after the group ran whole: CachedGroups::ClearReady)
// hands a set back, with its names and shapes untouched.
class EntryPool {
 public:
  explicit EntryPool(std::vector<TensorEntry> model) : model_(std::move(model)) {}
  const std::vector<TensorEntry>& model() const { return model_; }
  std::vector<TensorEntry> Take();
  void Give(std::vector<TensorEntry> entries);

 private:
  // Two launches can be in flight at once (the next one is accepted once the
  // previous one's completion events were announced, before its `done`); a
  // third set covers the one the loop has not given back yet.
  static constexpr size_t kMaxFree = 3;
  const std::vector<TensorEntry> model_;
  std::mutex mu_;
  std::vector<std::vector<TensorEntry>> free_;
};

struct Submission {
  std::vector<TensorEntry> entries;
  uint64_t group_id = 0;  // the entries' message.group_id (0: not grouped)
  // A launch of a registered group (its handle; 0: EnqueueGroup or Enqueue),
  // and the pool its entries came from and go back to.
  uint64_t registered_group = 0;
  std::shared_ptr<EntryPool> pool;
  // A refused push (Note [Refused duplicates]), with no entries: the distinct
  // names of its requests, and the name in flight that refused them.
  std::vector<std::string> refused_names;
  std::string refused_duplicate;
};

// The names in flight on this rank (a name is unique until its request
// completes). A step inserts and erases every gradient's name once; the set
// keeps the nodes of erased names (at most kSpareNodes) and refills them on
// the next insert, so a steady state of steps allocates nothing here (a
// node holds the name's characters: a string assignment into it reuses
// them). Not thread-safe: TensorQueue's lock guards it.
class InFlightNames {
 public:
  // False (and nothing changes) when `name` is in flight already.
  bool Insert(const std::string& name);
  void Erase(const std::string& name);
  size_t size() const { return names_.size(); }

 private:
  static constexpr size_t kSpareNodes = 4096;
  using Set = std::unordered_set<std::string>;
  Set names_;
  std::vector<Set::node_type> spare_;
};

class TensorQueue {
 public:
  // `rank`: this engine's rank, named in the error of a refused push.
  explicit TensorQueue(int rank) : rank_(rank) {}
  // All or none of the entries are queued (a group is never split). A
  // duplicate name refuses them all with RefusedDuplicateText (coordinator.h)
  // and queues the refusal's record instead. A launch of a registered group
  // checks no name: its reservation says whether its previous launch is
  // still in flight (then it is refused the same way).
  Status Push(Submission submission);
  // Note [Registered names]
  // A registered group's names are reserved in the queue from RegisterGroup
  // to UnregisterGroup: they sit in the in-flight names all along, so any
  // other submission of one of them is refused as a duplicate (on every
  // rank, Note [Refused duplicates]), and the group's launches need no
  // per-name insert or erase. The reservation counts the members of the
  // launch in flight instead: Push of a launch finds it zero and sets it to
  // the member count, Finish of a member counts it down (members of one
  // group in a row: one update), and the next launch is accepted once it
  // is zero again, as a name is once its request finished.
  // Between launches the names are lent: an Enqueue or EnqueueGroup of one
  // of them (a caller that registers where it can and submits by name where
  // it cannot, ops/adapter.h, or the same names in a second framework
  // program) is accepted as if the name were free, and the name counts as
  // in flight by that submission until it finishes (lent_, the reservation's
  // `lent`); a launch of the group meanwhile is refused like a duplicate
  // name, as is a second submission of a lent name. So whether a rank
  // submits a name through its registration or by itself changes nothing
  // for the names' one-at-a-time rule, which the ranks agree on.
  // Reserve fails (and reserves nothing) when a name is in flight, lent or
  // reserved already; Unreserve fails while a launch is in flight (a lent
  // name stays in flight, now by itself, until its submission finishes).
  Status Reserve(uint64_t group, const std::vector<TensorEntry>& entries);
  Status Unreserve(uint64_t group);
  // Waits until something is queued, shutdown was requested, or `timeout_s`
  // passed; then, while pushes keep arriving less than `gap_s` apart, keeps
  // collecting them for up to `max_batch_s` after the first one; appends the
  // queued submissions to `out`. Returns the seconds spent waiting.
  //
  // Note [Admission batching]
  // A framework enqueues a step's gradients as a burst of separate calls
  // (214 for ResNet-50, a few microseconds apart through pybind or TF's
  // executor). Waking on the first one and starting a cycle at once split the
  // burst over many cycles, each paying its own agreement allreduce, buckets
  // and completions, and the ranks' cycles took different slices of it, so the
  // cross-rank intersection was smaller still. Waiting until the queue has
  // been quiet for `gap_s` (the engine uses 30 us, see background_loop.cc)
  // makes a burst one cycle on every rank; a lone request pays at most the
  // gap (nothing once the caller is seen in lock-step: Note [Lone requests
  // skip the gap] below), and a never-ending stream at most `max_batch_s`
  // (the cycle time).
  // A grouped collective (EnqueueGroup of several) is a burst already: when
  // the latest push was one, the wait ends at once, so a step's group does
  // not wait out the gap (one gap per step, 30 us, on the cached-group path).
  //
  // Note [Lone requests skip the gap]
  // A caller that submits one request at a time and waits for it (a small
  // hvd.allreduce in a tf.function, a metric, a barrier-like call) sends no
  // burst: every wait for a quiet gap was in vain, and the gap plus the timer
  // wake-up that ends it were a fixed part of its latency. A burst shows
  // itself by pushes that come while earlier requests are still in flight;
  // a caller in lock-step pushes only after its previous request completed
  // (Finish runs before `done`). So the queue remembers how the latest takes
  // went: a take of a single submission with no push overlapping requests in
  // flight before the next take is "lone"; after kLoneTakesBeforeNoBatching
  // lone takes in a row the loop takes the next first entry at once. A take
  // of several submissions, or a push while something is in flight, turns
  // the batching back on, so a framework's per-tensor bursts are batched from
  // their second cycle on: at most one split burst each time the caller's
  // pattern changes (the split's leftovers start the next cycle quickly, Note
  // [Leftovers start the next cycle] in background_loop.cc).
  //
  // Note [A repeated burst ends the gap]
  // A per-tensor caller in lock-step sends the same burst every step (the
  // same gradients, one push each), and every wait for its quiet gap came
  // after the burst's last push: the gap was a fixed part of every step. So
  // the queue remembers the size of the takes that ended on a quiet gap: once
  // two such takes in a row took the same number of submissions (more than
  // one), the admission batching ends as soon as that many are queued. A push
  // that comes less than gap_s after a take ended that way shows the burst
  // was larger than the one remembered (its rest follows at once): the queue
  // forgets the size, and the gap applies again until two quiet takes agree
  // anew. A lock-step caller's next burst comes only after its requests
  // completed, far more than gap_s later. The ranks need not decide alike:
  // the agreement runs what every rank has, and the rest waits for the next
  // cycle (Note [Leftovers start the next cycle] in background_loop.cc).
  //
  // `poll_s` (Note [Waiting for a lock-step caller] in wait_policy.h): poll
  // for a first entry that long (yielding the core between polls) before
  // sleeping on the condition variable for the rest of `timeout_s`.
  double WaitAndPop(double timeout_s, double poll_s, double gap_s, double max_batch_s,
                    std::vector<Submission>* out, bool* shutdown_requested);
  // Sleeps up to `seconds` unless something is queued or shutdown is
  // requested, which ends the sleep at once (Push wakes it); returns whether
  // one of them did. An idle cycle's agreement sleeps here (mpi_wait.h).
  bool SleepUnlessPushed(double seconds);
  void RequestShutdown();
  // Finish for `n` entries under one lock (a bucket's members; a
  // registered group's count down its reservation).
  void Finish(TensorEntry* const* entries, size_t n);
  // Finish for `n` names under one lock (a bucket's members once their
  // entries are gone), and `members` members of registered group `group`
  // (none when `group` is 0).
  void Finish(const std::string* const* names, size_t n, uint64_t group = 0, size_t members = 0);
  // Pushes of grouped collectives that ended admission batching at once.
  uint64_t groups_not_batched() const { return groups_not_batched_.load(std::memory_order_relaxed); }
  // Takes whose first entry (not a group) was taken at once, without waiting
  // for a quiet gap (Note [Lone requests skip the gap]).
  uint64_t lone_requests_not_batched() const { return lone_not_batched_.load(std::memory_order_relaxed); }
  // Takes whose batching ended as soon as the remembered burst size was
  // queued (Note [A repeated burst ends the gap]).
  uint64_t bursts_ended_at_size() const { return bursts_at_size_.load(std::memory_order_relaxed); }
  // Lone takes in a row after which the gap is skipped.
  static constexpr int kLoneTakesBeforeNoBatching = 4;
  // Later pushes fail with `status`; returns the submissions still queued.
  std::vector<Submission> Close(const Status& status);

 private:
  const int rank_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Submission> queued_;
  std::chrono::steady_clock::time_point last_push_;
  // Pushes so far: a polled admission gap (WaitAndPop, without the lock)
  // sees a new push by it changing; the lock orders what it then reads. On a
  // cache line of its own, away from mu_ and what a push writes under it:
  // the poll reads it continually while the caller pushes.
  alignas(64) std::atomic<uint64_t> pushes_{0};
  alignas(64) InFlightNames in_flight_;
  // Note [Registered names]: by group handle.
  struct Reservation {
    std::vector<std::string> names;
    size_t members_in_flight = 0;
    size_t lent = 0;  // its names in flight by an unregistered submission (in lent_)
  };
  std::unordered_map<uint64_t, Reservation> reservations_;
  std::unordered_map<std::string, uint64_t> reserved_by_;  // every reserved name's group
  std::unordered_set<std::string> lent_;  // reserved names in flight by an unregistered submission
  size_t reserved_names_ = 0;                // the reservations' names (all in in_flight_)
  size_t registered_members_in_flight_ = 0;  // the sum of their members_in_flight
  // Under mu_: `name` was found in in_flight_; lends it when it is a
  // reserved name of a group with no launch in flight and not lent already.
  bool Lend(const std::string& name);
  // Under mu_: a finished unregistered entry's name leaves flight (a lent
  // name goes back to its reservation).
  void Release(const std::string& name);
  // Under mu_: refuses `submission` for `duplicate` (Note [Refused
  // duplicates]), queueing the refusal's record; unlocks `lock`.
  Status Refuse(const Submission& submission, const std::string& duplicate,
                std::unique_lock<std::mutex>* lock);
  // Under mu_: counts down `members` of registered group `group`.
  void FinishRegistered(uint64_t group, size_t members);
  bool shutdown_requested_ = false;
  bool waiting_for_first_ = false;  // WaitAndPop or SleepUnlessPushed waits for a first entry (Push wakes it)
  // Something is queued or shutdown was requested: read without the lock by
  // WaitAndPop's polling phase (set under mu_ with the change it announces;
  // the poller takes mu_ before reading what was queued).
  std::atomic<bool> wake_{false};
  bool last_was_group_ = false;  // the latest push was a grouped collective of several
  bool batching_ = false;  // WaitAndPop is in admission batching (a group push wakes it)
  Status closed_;  // non-OK once closed
  std::atomic<uint64_t> groups_not_batched_{0};
  // Note [Lone requests skip the gap]: the latest take (how many
  // submissions, whether a push overlapped requests in flight since) and the
  // lone takes in a row before it.
  size_t last_take_count_ = 0;
  bool followed_ = false;
  // Note [A repeated burst ends the gap]: the size of the latest take that
  // ended on a quiet gap, the burst size the batching ends at (0: none), and
  // until when a push shows that a take ended at it cut a burst short.
  size_t last_quiet_take_ = 0;
  size_t burst_size_ = 0;
  std::chrono::steady_clock::time_point burst_cut_until_{};
  int lone_takes_ = 0;
  std::atomic<uint64_t> lone_not_batched_{0};
  std::atomic<uint64_t> bursts_at_size_{0};
};

}  // namespace nvgroup
