// TensorQueue: the hand-off between the threads that submit collectives and
// the background loop, and the registry of names in flight.
//
// How it works. Push (any thread) validates that no name is already in flight,
// appends the entries and wakes the loop through a condition variable, so a
// lone small request does not wait for the cycle timer. The loop takes every
// queued entry at the start of a cycle (WaitAndPop). A name stays in flight
// until Finish, which the engine calls just before the request's `done`, so a
// callback may resubmit the same name. Close makes later pushes fail with the
// given status and hands back whatever was still queued.
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "engine/wire_format.h"
#include "nvgroup/engine.h"

namespace nvgroup {

// One submitted collective, self-contained: the caller's request plus what
// this rank reports to rank 0 about it.
struct TensorEntry {
  CollectiveRequest request;
  RequestMessage message;
  double enqueue_time = 0;  // engine clock, for the timeline
};

class TensorQueue {
 public:
  // All or none of `entries` are queued (a group is never split).
  Status Push(std::vector<TensorEntry> entries);
  // Waits until something is queued, shutdown was requested, or `timeout_s`
  // passed; appends the queued entries to `out`.
  void WaitAndPop(double timeout_s, std::vector<TensorEntry>* out, bool* shutdown_requested);
  void RequestShutdown();
  void Finish(const std::string& name);
  // Later pushes fail with `status`; returns the entries still queued.
  std::vector<TensorEntry> Close(const Status& status);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<TensorEntry> queued_;
  std::unordered_set<std::string> in_flight_;
  bool shutdown_requested_ = false;
  Status closed_;  // non-OK once closed
};

}  // namespace nvgroup
