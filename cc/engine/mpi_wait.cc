#include "engine/mpi_wait.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "common/checks.h"

namespace nvgroup {

double MonotonicSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Spins (yielding) briefly for latency, then sleeps in
// growing steps so oversubscribed hosts are not starved.
Status WaitMpi(MPI_Request* request, const std::string& what, double timeout_s,
               const std::atomic<bool>& abort) {
  // 64 yields cover a sub-10 us round trip on one host (ANCHORS §4: 23 us for
  // a plain MPI op over 2 ranks); 200 us bounds the added latency once sleeping.
  constexpr int kSpinIterations = 64;
  constexpr int kMaxSleepUs = 200;
  const double deadline = MonotonicSeconds() + timeout_s;
  int sleep_us = 1;
  for (int i = 0;; ++i) {
    int done = 0;
    NVG_MPI_CHECK(MPI_Test(request, &done, MPI_STATUS_IGNORE));
    if (done) return Status::Ok();
    if (abort.load(std::memory_order_relaxed))
      return Status::Aborted("nvgroup_tf was aborted while waiting in " + what);
    if (MonotonicSeconds() > deadline)
      return Status::Unavailable(
          "no answer from the other ranks for " + std::to_string(static_cast<int>(timeout_s)) +
          " s in " + what + " (NVGROUP_TIMEOUT): a rank is hung, has exited, or stopped calling "
          "nvgroup_tf; the engine has stopped");
    if (i < kSpinIterations) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      sleep_us = std::min(kMaxSleepUs, sleep_us * 2);
    }
  }
}

}  // namespace nvgroup
