// Run-time timeline control (start_timeline/stop_timeline, nvgroup/engine.h):
// a one-slot mailbox between the caller's thread and the background loop,
// which alone touches the Timeline (timeline.h). The caller posts a command
// and waits, bounded, for the loop's answer; the loop applies the command at
// the top of its next cycle.
//
// One caller at a time (call_mu_); the command and its answer are guarded by
// mu_; the atomic `pending_` keeps the loop's per-cycle check to one load
// (release by the caller after the command is written, acquire by the loop
// before it takes mu_).
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>

#include "engine/timeline.h"
#include "nvgroup/status.h"

namespace nvgroup {

class TimelineControl {
 public:
  // Caller's thread: hands the change to the loop and waits until the loop
  // applied it, at most `timeout_s` + 1 s (NVGROUP_TIMEOUT plus the cycle in
  // progress).
  Status Request(bool start, const std::string& path, bool mark_cycles, double timeout_s);
  // Background thread: whether a command waits (one acquire load).
  bool pending() const { return pending_.load(std::memory_order_acquire); }
  // Background thread: applies the waiting command to `timeline`; sets
  // *mark_cycles (CYCLE_START events) to what the command asked.
  void Apply(Timeline* timeline, bool* mark_cycles);
  // Background thread, when the loop exits: answers a waiting caller and
  // refuses every later one.
  void LoopGone();

 private:
  struct Command {
    bool start = false;
    std::string path;
    bool mark_cycles = false;
  };
  std::mutex call_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> pending_{false};
  Command command_;
  bool answered_ = false;
  Status answer_;
  bool loop_gone_ = false;  // the loop exited: nobody will apply a command
};

}  // namespace nvgroup
