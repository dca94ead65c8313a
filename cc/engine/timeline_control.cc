// Run-time timeline control (timeline_control.h).
#include "engine/timeline_control.h"

#include <chrono>

#include "engine/mpi_wait.h"

namespace nvgroup {

Status TimelineControl::Request(bool start, const std::string& path, bool mark_cycles, double timeout_s) {
  const char* what = start ? "start_timeline" : "stop_timeline";
  std::lock_guard<std::mutex> one_at_a_time(call_mu_);
  std::unique_lock<std::mutex> lock(mu_);
  if (loop_gone_)
    return Status::FailedPrecondition(std::string(what) + ": the engine's background loop has stopped");
  command_ = Command{start, path, mark_cycles};
  answered_ = false;
  pending_.store(true, std::memory_order_release);
  if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout_s + 1.0), [this] { return answered_; })) {
    pending_ = false;
    return Status::Unavailable(std::string(what) + ": the background loop did not take the change within " +
                               std::to_string(timeout_s) + " s (NVGROUP_TIMEOUT)");
  }
  return answer_.ok() ? answer_ : answer_.WithContext(what);
}

void TimelineControl::Apply(Timeline* timeline, bool* mark_cycles) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!pending_) return;  // the caller gave up meanwhile
  pending_ = false;
  if (command_.start) {
    answer_ = timeline->Open(command_.path, MonotonicSeconds());
    *mark_cycles = answer_.ok() && command_.mark_cycles;
  } else {
    timeline->Close();
    *mark_cycles = false;
    answer_ = Status::Ok();
  }
  answered_ = true;
  cv_.notify_all();
}

void TimelineControl::LoopGone() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    loop_gone_ = true;
    if (pending_) {
      pending_ = false;
      answer_ = Status::FailedPrecondition("the engine's background loop has stopped");
      answered_ = true;
    }
  }
  cv_.notify_all();
}

}  // namespace nvgroup
