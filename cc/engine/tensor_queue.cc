#include "engine/tensor_queue.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "engine/coordinator.h"
#include "engine/wait_policy.h"

namespace nvgroup {

bool InFlightNames::Insert(const std::string& name) {
  if (spare_.empty()) return names_.insert(name).second;
  Set::node_type node = std::move(spare_.back());
  spare_.pop_back();
  node.value() = name;  // reuses the node's characters where they fit
  Set::insert_return_type r = names_.insert(std::move(node));
  if (!r.inserted) spare_.push_back(std::move(r.node));
  return r.inserted;
}

void InFlightNames::Erase(const std::string& name) {
  Set::node_type node = names_.extract(name);
  if (!node.empty() && spare_.size() < kSpareNodes) spare_.push_back(std::move(node));
}

std::vector<TensorEntry> EntryPool::Take() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      std::vector<TensorEntry> entries = std::move(free_.back());
      free_.pop_back();
      return entries;
    }
  }
  return model_;  // the first launches, and after a launch that went entry by entry
}

void EntryPool::Give(std::vector<TensorEntry> entries) {
  if (entries.size() != model_.size()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.size() < kMaxFree) free_.push_back(std::move(entries));
}

Status TensorQueue::Refuse(const Submission& submission, const std::string& duplicate,
                           std::unique_lock<std::mutex>* lock) {
  // Note [Refused duplicates] (coordinator.h): the refusal goes to rank 0 in
  // the entries' place.
  Submission refusal;
  refusal.refused_duplicate = duplicate;
  for (const TensorEntry& e : submission.entries)
    if (std::find(refusal.refused_names.begin(), refusal.refused_names.end(), e.request.name) ==
        refusal.refused_names.end())
      refusal.refused_names.push_back(e.request.name);
  queued_.push_back(std::move(refusal));
  wake_.store(true, std::memory_order_release);
  // Note [Registered names]: say so when the name is a registered group's.
  std::string owner;
  auto by = reserved_by_.find(duplicate);
  if (by != reserved_by_.end()) {
    const bool launched = reservations_.at(by->second).members_in_flight != 0;
    owner = "; '" + duplicate + "' belongs to registered group " + std::to_string(by->second) + " on rank " +
            std::to_string(rank_) +
            (!launched ? ", and a collective submitted by that name (Enqueue or EnqueueGroup) is in flight"
             : by->second == submission.registered_group
                 ? ", whose previous launch is still in flight (wait for its done callback)"
                 : ", whose launch is in flight");
  }
  const bool waiting = waiting_for_first_;
  lock->unlock();
  if (waiting) cv_.notify_one();
  return Status::InvalidArgument(RefusedDuplicateText(duplicate, duplicate, {rank_}) + owner);
}

Status TensorQueue::Push(Submission submission) {
  std::vector<TensorEntry>& entries = submission.entries;
  bool wake = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!closed_.ok()) return closed_;
    // Reserved names are not requests in flight (Note [Registered names]).
    const bool overlapping = in_flight_.size() != reserved_names_ || registered_members_in_flight_ != 0 ||
                             !lent_.empty();
    if (submission.registered_group != 0) {  // Note [Registered names]
      auto r = reservations_.find(submission.registered_group);
      if (r == reservations_.end())
        return Status::FailedPrecondition("registered group " + std::to_string(submission.registered_group) +
                                          " has no reservation in this engine's queue");
      if (r->second.members_in_flight != 0 || r->second.lent != 0) {
        std::string busy = entries[0].request.name;  // the lent name, when one is
        if (r->second.lent != 0)
          for (const std::string& name : r->second.names)
            if (lent_.count(name) != 0) {
              busy = name;
              break;
            }
        return Refuse(submission, busy, &lock);
      }
      r->second.members_in_flight = entries.size();
      registered_members_in_flight_ += entries.size();
    } else {
      // Names go into in_flight_ as they are checked (a reserved name is
      // lent instead, Note [Registered names]); a duplicate (in flight, or
      // twice in this batch) takes the batch's names out again.
      for (size_t i = 0; i < entries.size(); ++i) {
        if (!in_flight_.Insert(entries[i].request.name) && !Lend(entries[i].request.name)) {
          for (size_t j = 0; j < i; ++j) Release(entries[j].request.name);
          return Refuse(submission, entries[i].request.name, &lock);
        }
      }
    }
    last_was_group_ = submission.group_id != 0 && submission.entries.size() > 1;
    // One clock read per push: the admission gap's and the timeline's.
    last_push_ = std::chrono::steady_clock::now();
    const double pushed_at = std::chrono::duration<double>(last_push_.time_since_epoch()).count();
    for (TensorEntry& e : entries) e.enqueue_time = pushed_at;
    queued_.push_back(std::move(submission));
    wake_.store(true, std::memory_order_release);
    // Note [Lone requests skip the gap]: a push while earlier requests are
    // still in flight is part of a burst (or of overlapping callers).
    if (overlapping) {
      followed_ = true;
      lone_takes_ = 0;
    }
    // Note [A repeated burst ends the gap]: the rest of a burst cut short.
    if (burst_size_ != 0 && last_push_ < burst_cut_until_) {
      burst_size_ = 0;
      last_quiet_take_ = 0;
    }
    // Only the loop's wait for a first entry needs a wake-up; admission
    // batching rereads last_push_ when its own timer fires, so a burst does
    // not wake the loop once per enqueue (a group ends the batching, and so
    // does a repeated burst's last push: wake).
    wake = waiting_for_first_ ||
           (batching_ && (last_was_group_ || (burst_size_ != 0 && queued_.size() >= burst_size_)));
  }
  // Ends a polled admission gap (WaitAndPop). Announced after the unlock, so
  // a poller that sees it and takes mu_ does not find mu_ still held by this
  // push (a caller pushing per tensor would otherwise meet the poller on the
  // lock at every push); the push's state was published by the unlock. A
  // poller that took mu_ between the unlock and this increment already saw
  // the push and only polls once more.
  pushes_.fetch_add(1, std::memory_order_release);
  // Ordered after the push by the mutex.
  if (wake) cv_.notify_one();
  return Status::Ok();
}

Status TensorQueue::Reserve(uint64_t group, const std::vector<TensorEntry>& entries) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!closed_.ok()) return closed_;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (in_flight_.Insert(entries[i].request.name)) continue;
    for (size_t j = 0; j < i; ++j) in_flight_.Erase(entries[j].request.name);
    const std::string& name = entries[i].request.name;
    auto by = reserved_by_.find(name);
    if (by != reserved_by_.end())
      return Status::InvalidArgument("RegisterGroup: '" + name + "' belongs to registered group " +
                                     std::to_string(by->second) + " already (UnregisterGroup it first)");
    return Status::InvalidArgument("RegisterGroup: a collective named '" + name +
                                   "' is in flight, or the group names it twice");
  }
  Reservation& r = reservations_[group];
  for (const TensorEntry& e : entries) {
    r.names.push_back(e.request.name);
    reserved_by_.emplace(e.request.name, group);
  }
  reserved_names_ += entries.size();
  return Status::Ok();
}

bool TensorQueue::Lend(const std::string& name) {
  auto by = reserved_by_.find(name);
  if (by == reserved_by_.end()) return false;  // in flight by itself
  Reservation& r = reservations_.at(by->second);
  if (r.members_in_flight != 0 || !lent_.insert(name).second) return false;
  ++r.lent;
  return true;
}

void TensorQueue::Release(const std::string& name) {
  if (!lent_.empty()) {
    auto it = lent_.find(name);
    if (it != lent_.end()) {
      --reservations_.at(reserved_by_.at(name)).lent;
      lent_.erase(it);
      return;
    }
  }
  in_flight_.Erase(name);
}

Status TensorQueue::Unreserve(uint64_t group) {
  std::lock_guard<std::mutex> lock(mu_);
  auto r = reservations_.find(group);
  if (r == reservations_.end()) return Status::Ok();  // a queue that never reserved it
  if (r->second.members_in_flight != 0)
    return Status::FailedPrecondition("UnregisterGroup: a launch of registered group " +
                                      std::to_string(group) +
                                      " is in flight; unregister it after its done callback ran");
  for (const std::string& name : r->second.names) {
    reserved_by_.erase(name);
    // A lent name stays in flight, by its submission alone from now on.
    if (lent_.erase(name) == 0) in_flight_.Erase(name);
  }
  reserved_names_ -= r->second.names.size();
  reservations_.erase(r);
  return Status::Ok();
}

double TensorQueue::WaitAndPop(double timeout_s, double poll_s, double gap_s, double max_batch_s,
                               std::vector<Submission>* out, bool* shutdown_requested) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  if (poll_s > 0) {  // Note [Waiting for a lock-step caller]: poll, then sleep below
    const Clock::time_point until =
        start +
        std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(std::min(poll_s,
                                                                                           timeout_s)));
    // Acquire: pairs with Push's release store; the lock below orders the
    // read of queued_ in any case.
    while (!wake_.load(std::memory_order_acquire) && Clock::now() < until)
      if (!YieldUncontended()) break;  // the core is busy: sleep below instead
  }
  std::unique_lock<std::mutex> lock(mu_);
  // Note [Lone requests skip the gap]: how the previous take went.
  if (last_take_count_ == 1 && !followed_) {
    if (lone_takes_ < kLoneTakesBeforeNoBatching) ++lone_takes_;
  } else if (last_take_count_ > 1 || followed_) {
    lone_takes_ = 0;
  }
  last_take_count_ = 0;
  followed_ = false;
  waiting_for_first_ = true;
  cv_.wait_for(lock, std::chrono::duration<double>(timeout_s),
               [this] { return !queued_.empty() || shutdown_requested_; });
  waiting_for_first_ = false;
  const bool lone = lone_takes_ >= kLoneTakesBeforeNoBatching;
  if (lone && !queued_.empty() && !shutdown_requested_ && gap_s > 0) {
    if (last_was_group_) groups_not_batched_.fetch_add(1, std::memory_order_relaxed);
    else lone_not_batched_.fetch_add(1, std::memory_order_relaxed);
  }
  if (!lone && !queued_.empty() && !shutdown_requested_ && gap_s > 0) {
    // See Note [Admission batching]: the wait ends when no push came for
    // gap_s, or max_batch_s after the first entry was seen here.
    const Clock::time_point first = Clock::now();
    const auto gap = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap_s));
    const auto cap = first +
                     std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(max_batch_s));
    batching_ = true;
    bool gap_polling = true;
    bool quiet = false;     // ended on a quiet gap
    bool repeated = false;  // ended at the burst size (Note [A repeated burst ends the gap])
    for (;;) {
      if (last_was_group_) {  // a grouped collective: a whole burst by itself
        groups_not_batched_.fetch_add(1, std::memory_order_relaxed);
        break;
      }
      if (burst_size_ != 0 && queued_.size() >= burst_size_) {
        repeated = true;
        break;
      }
      const Clock::time_point quiet_at = last_push_ + gap;
      const Clock::time_point until = std::min(quiet_at, cap);
      const Clock::time_point now = Clock::now();
      if (now >= until || shutdown_requested_) {
        quiet = !shutdown_requested_ && now >= quiet_at;
        break;
      }
      // Note [Waiting for a lock-step caller] (wait_policy.h): the gap is
      // polled while the core is free (a timer wake-up ended it 20-30 us late
      // on the 2-core VM), else slept on. The poll follows the pushes by
      // their count alone (pushes_), taking each one's time as when it saw
      // the count change, and takes the lock again only once the pushes
      // stopped for gap_s (or at the cap); the loop above then rereads
      // last_push_. A poll that took the lock at every push met a caller
      // pushing per tensor on that lock at every push; with it one Enqueue of
      // ResNet-50's 214 took 0.62-0.72 us, against 0.43-0.47 us with the
      // timed wait before the poll (engine_perf, 1 and 2 ranks, one H100
      // host: benchmarks/results/device_checks_h100x1_5875006/).
      if (gap_polling) {
        uint64_t seen = pushes_.load(std::memory_order_relaxed);
        Clock::time_point quiet_until = quiet_at;
        // The pushes counted here and those already queued reach the burst
        // size: the lock above counts the queue again (a push counted in
        // both, queued before the lock and counted after it, only ends the
        // poll early).
        const uint64_t pushes_before = seen;
        const size_t queued_before = queued_.size();
        const size_t burst = burst_size_;
        lock.unlock();
        for (;;) {
          const Clock::time_point polled = Clock::now();
          const uint64_t pushes = pushes_.load(std::memory_order_acquire);
          if (pushes != seen) {
            seen = pushes;
            quiet_until = polled + gap;
            if (burst != 0 && queued_before + (pushes - pushes_before) >= burst) break;
          }
          if (polled >= std::min(quiet_until, cap)) break;
          if (!YieldUncontended()) {
            gap_polling = false;
            break;
          }
        }
        lock.lock();
        continue;
      }
      cv_.wait_until(lock, until);
    }
    batching_ = false;
    // Note [A repeated burst ends the gap]
    if (repeated) {
      bursts_at_size_.fetch_add(1, std::memory_order_relaxed);
      burst_cut_until_ = Clock::now() + gap;
    } else if (quiet) {
      const size_t took = queued_.size();
      burst_size_ = took > 1 && took == last_quiet_take_ ? took : 0;
      last_quiet_take_ = took;
    }
  }
  for (Submission& s : queued_) out->push_back(std::move(s));
  last_take_count_ = queued_.size();
  queued_.clear();
  wake_.store(shutdown_requested_, std::memory_order_relaxed);
  *shutdown_requested = shutdown_requested_;
  return std::chrono::duration<double>(Clock::now() - start).count();
}

bool TensorQueue::SleepUnlessPushed(double seconds) {
  std::unique_lock<std::mutex> lock(mu_);
  waiting_for_first_ = true;
  const bool woken = cv_.wait_for(lock, std::chrono::duration<double>(seconds),
                                  [this] { return !queued_.empty() || shutdown_requested_; });
  waiting_for_first_ = false;
  return woken;
}

void TensorQueue::RequestShutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_requested_ = true;
    wake_.store(true, std::memory_order_release);
  }
  cv_.notify_one();
}

void TensorQueue::FinishRegistered(uint64_t group, size_t members) {
  auto r = reservations_.find(group);
  if (r == reservations_.end()) return;
  const size_t finished = std::min(members, r->second.members_in_flight);
  r->second.members_in_flight -= finished;
  registered_members_in_flight_ -= finished;
}

void TensorQueue::Finish(TensorEntry* const* entries, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t group = 0;  // Note [Registered names]: a group's members in a row, one update
  size_t members = 0;
  for (size_t i = 0; i < n; ++i) {
    const TensorEntry& e = *entries[i];
    if (e.registered_group == 0) {
      Release(e.request.name);
      continue;
    }
    if (e.registered_group != group) {
      if (members != 0) FinishRegistered(group, members);
      group = e.registered_group;
      members = 0;
    }
    ++members;
  }
  if (members != 0) FinishRegistered(group, members);
}

void TensorQueue::Finish(const std::string* const* names, size_t n, uint64_t group, size_t members) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < n; ++i) Release(*names[i]);
  if (group != 0 && members != 0) FinishRegistered(group, members);
}

std::vector<Submission> TensorQueue::Close(const Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = status;
  std::vector<Submission> left;
  left.swap(queued_);
  return left;
}

}  // namespace nvgroup
