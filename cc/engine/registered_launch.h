// RegisteredLaunch: one EnqueueRegisteredGroup call in flight (Note
// [Registered groups], registered_groups.h). Its members complete one by one,
// in whichever buckets and on whichever engine thread they run; the launch
// counts them down and runs the group's one `done` after the last, with OK or
// the first member's error. Completion (completion.h) tells it of each
// bucket's completion event once, not once per member, and the caller hears
// of the last one only.
//
// Lifetime: EnqueueRegisteredGroup creates it and gives each member the
// done callback MemberDone{this}; the last member's completion runs the
// group's `done` and deletes the launch. Nothing reaches it after that: a
// member's completion event is announced before that member completes. If
// the launch is never queued (Push refused it), its caller deletes it.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <utility>

#include "nvgroup/engine.h"

namespace nvgroup {

class RegisteredLaunch {
 public:
  RegisteredLaunch(uint32_t members, DoneCallback done, std::function<void(void*)> completion_event_ready)
      : members_(members),
        remaining_(members),
        done_(std::move(done)),
        completion_event_ready_(std::move(completion_event_ready)) {}

  // A member's done callback: one pointer, which std::function holds without
  // allocating (no per-member allocation on a launch).
  struct MemberDone {
    RegisteredLaunch* launch;
    void operator()(const Status& status) const { launch->CompleteMember(status); }
  };

  // Whether the caller asked for a completion event (GroupLaunch::completion_event_ready).
  bool announces_events() const { return static_cast<bool>(completion_event_ready_); }
  // `members` of the launch are enqueued on the engine's stream, `event`
  // recorded after them (Completion::CompleteAfterStream, on the background
  // thread, bucket after bucket). Once every member was announced, the
  // caller hears of the last event, which covers the earlier buckets' work:
  // the engine runs a launch's buckets in order on one stream.
  void AnnounceEvent(void* event, size_t members) {
    announced_ += members;
    if (announced_ == members_) completion_event_ready_(event);
  }
  // One member completed; the last runs `done` and deletes the launch.
  void CompleteMember(const Status& status) { CompleteMembers(status, 1); }
  // `count` members completed with `status` at once (a bucket's, on the
  // finalizer: Completion::CompleteAfterStream), as `count` CompleteMember
  // calls; the last of all runs `done` and deletes the launch.
  void CompleteMembers(const Status& status, uint32_t count) {
    if (!status.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (first_error_.ok()) first_error_ = status;
    }
    // acq_rel: the last member sees every earlier member's error.
    if (remaining_.fetch_sub(count, std::memory_order_acq_rel) != count) return;
    Status result;
    {
      std::lock_guard<std::mutex> lock(mu_);
      result = first_error_;
    }
    DoneCallback done = std::move(done_);
    delete this;
    done(result);
  }

 private:
  const size_t members_;
  size_t announced_ = 0;  // the background thread's (AnnounceEvent)
  std::atomic<uint32_t> remaining_;
  std::mutex mu_;  // guards first_error_
  Status first_error_;
  DoneCallback done_;
  const std::function<void(void*)> completion_event_ready_;
};

}  // namespace nvgroup
