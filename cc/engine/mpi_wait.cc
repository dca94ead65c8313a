#include "engine/mpi_wait.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "common/checks.h"
#include "engine/wait_policy.h"

namespace nvgroup {

double MonotonicSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// See Note [Busy-poll, then sleep] in mpi_wait.h; the schedule is wait_policy.h's.
Status WaitMpi(MPI_Request* request, const char* what, double timeout_s, const std::atomic<bool>& abort,
               int64_t cycle, bool sleep_at_once,
               const std::function<bool(double seconds)>* sleep_unless_woken) {
  int done = 0;
  NVG_MPI_CHECK(MPI_Test(request, &done, MPI_STATUS_IGNORE));
  if (done) return Status::Ok();
  double start = MonotonicSeconds();
  const double deadline = start + timeout_s;
  bool idle = sleep_at_once;
  bool contended = false;  // a yield gave the core away: the sleep phase starts
  int sleep_us = idle ? kIdleFirstSleepUs : 1;
  for (;;) {
    NVG_MPI_CHECK(MPI_Test(request, &done, MPI_STATUS_IGNORE));
    if (done) return Status::Ok();
    auto where = [&] { return std::string(what) + (cycle >= 0 ? " of cycle " + std::to_string(cycle) : ""); };
    if (abort.load(std::memory_order_relaxed))
      return Status::Aborted("nvgroup_tf was aborted while waiting in " + where());
    const double now = MonotonicSeconds();
    if (now > deadline)
      return Status::Unavailable("no answer from the other ranks for " +
                                 std::to_string(static_cast<int>(timeout_s)) + " s in " + where() +
                                 " (NVGROUP_TIMEOUT): a rank is hung, has exited, or stopped calling "
                                 "nvgroup_tf; the engine has stopped");
    if (!idle && now - start < kBusyPollS) continue;
    if (!idle && !contended && now - start < kInFlightYieldPollS) {
      contended = !YieldUncontended();  // a busy core: sleep from here on
      continue;
    }
    if (idle && sleep_unless_woken != nullptr) {
      if ((*sleep_unless_woken)(sleep_us * 1e-6)) {  // a submission: poll from here on
        idle = false;
        contended = false;
        start = MonotonicSeconds();
        sleep_us = 1;
        continue;
      }
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    }
    const int cap = std::max(idle ? kIdleMaxSleepUs : kMinMaxSleepUs,
                             std::min(kMaxSleepUs, static_cast<int>((now - start) * kLateFraction * 1e6)));
    sleep_us = std::min(cap, sleep_us * 2);
  }
}

StatusOr<std::vector<int>> FindSilentRanks(MPI_Comm comm, double grace_s) {
  // Any tag works: the engine's communicator carries collectives only.
  constexpr int kProbeTag = 7411;
  static const char kToken = 1;  // static: a send to a dead rank may never finish
  int rank = 0, size = 1;
  NVG_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  NVG_MPI_CHECK(MPI_Comm_size(comm, &size));
  // Heap, and leaked if a receive is left cancelled-but-maybe-matched: MPI may
  // still write into it after we return.
  auto* received = new std::vector<char>(size);
  std::vector<MPI_Request> recvs(size, MPI_REQUEST_NULL);
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    NVG_MPI_CHECK(MPI_Irecv(&(*received)[r], 1, MPI_CHAR, r, kProbeTag, comm, &recvs[r]));
    MPI_Request send;
    NVG_MPI_CHECK(MPI_Isend(&kToken, 1, MPI_CHAR, r, kProbeTag, comm, &send));
    NVG_MPI_CHECK(MPI_Request_free(&send));
  }
  const double deadline = MonotonicSeconds() + grace_s;
  for (bool waiting = true; waiting && MonotonicSeconds() < deadline;) {
    waiting = false;
    for (MPI_Request& q : recvs) {
      if (q == MPI_REQUEST_NULL) continue;
      int done = 0;
      NVG_MPI_CHECK(MPI_Test(&q, &done, MPI_STATUS_IGNORE));  // sets q to NULL when done
      waiting = waiting || !done;
    }
    if (waiting) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::vector<int> silent;
  for (int r = 0; r < size; ++r) {
    if (recvs[r] == MPI_REQUEST_NULL) continue;
    silent.push_back(r);
    NVG_MPI_CHECK(MPI_Cancel(&recvs[r]));
    NVG_MPI_CHECK(MPI_Request_free(&recvs[r]));
  }
  if (silent.empty()) delete received;
  return silent;
}

Status NameSilentRanks(Status waited, MPI_Comm comm) {
  if (waited.code() != StatusCode::kUnavailable) return waited;
  StatusOr<std::vector<int>> silent = FindSilentRanks(comm, 2.0);
  if (!silent.ok() || silent.value().empty()) return waited;
  std::string who;
  for (int r : silent.value()) who += (who.empty() ? "rank " : ", rank ") + std::to_string(r);
  return Status::Unavailable(waited.message() + "; " + who +
                             " did not answer a liveness probe (stopped, hung or dead)");
}

}  // namespace nvgroup
