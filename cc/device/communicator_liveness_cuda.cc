// CudaCommunicator (cuda_communicator_impl.h): the members' processes and
// the host waits that watch them -- Synchronize, WaitRecordedEvent, the state
// checks at the start of every call (CheckHealthy), the diagnosis of a
// failure as a member's exit (Diagnose), and Abort.
//
// Note [Peer processes]. Members of a group share a node, so each rank knows
// its members' pids. Synchronize and WaitRecordedEvent poll their event and
// look, every kLivenessCheck, whether the members' processes still exist; a
// CUDA error (a fault from a mapping whose owner exited) or a timeout is
// reported as kUnavailable naming the member whose process is gone. A communicator that saw a failure
// never frees its own region: a peer kernel that timed out or is still
// spinning may yet store flags into it; the process exit frees it.
#include <cuda_runtime.h>
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "common/cuda_checks.h"
#include "device/cuda_communicator_impl.h"

namespace nvgroup {
namespace {

// Synchronize: how often it looks at the members' processes while it waits,
// and how long it still waits for the kernels to give up after an abort.
constexpr auto kLivenessCheck = std::chrono::milliseconds(2);
constexpr auto kAbortDrain = std::chrono::seconds(10);

// Whether process `pid` (same node) still runs: kill(pid, 0) finds it and it
// is no zombie (an exited child not yet reaped by its launcher).
bool ProcessAlive(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == EPERM;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;  // no procfs: trust kill()
  char state = 'R';
  const int got = std::fscanf(f, "%*d (%*[^)]) %c", &state);
  std::fclose(f);
  return got != 1 || (state != 'Z' && state != 'X');
}

}  // namespace

std::string CudaCommunicator::MemberName(int p) const {
  const bool known = p >= 0 && p < static_cast<int>(member_ranks_.size());
  return "group rank " + std::to_string(p) + " (rank " + std::to_string(known ? member_ranks_[p] : -1) +
         ", pid " +
         std::to_string(known && p < static_cast<int>(member_pids_.size()) ? member_pids_[p] : -1) + ")";
}

int CudaCommunicator::DeadMember() {
  if (dead_member_ >= 0) return dead_member_;
  for (int p = 0; p < static_cast<int>(member_pids_.size()); ++p) {
    if (p == group_.topo.group_rank || !pid_visible_[p]) continue;
    if (!ProcessAlive(member_pids_[p])) {
      dead_member_ = p;
      // this rank's kernels still spinning on the member give up
      if (group_.control_host != nullptr) group_.control_host->abort = 1;
      break;
    }
  }
  return dead_member_;
}

Status CudaCommunicator::Diagnose(Status s) {
  if (s.ok() || s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kInvalidArgument) return s;
  const int p = DeadMember();
  if (p < 0) return s;
  return Status::Unavailable(MemberName(p) + " exited while its memory was mapped here (" + s.ToString() +
                             "). This communicator cannot be used any more.");
}

Status CudaCommunicator::CheckHealthy() const {
  const DeviceControl* c = group_.control_host;
  if (dead_member_ >= 0)
    return Status::Unavailable(MemberName(dead_member_) +
                               " exited while its memory was mapped here. This communicator "
                               "cannot be used any more.");
  if (c->failure == kFailureTimeout) {
    const int p = c->failed_peer;
    const bool alive = p >= 0 && p < static_cast<int>(member_pids_.size()) && ProcessAlive(member_pids_[p]);
    return Status::Unavailable("NV-group barrier timed out: " + MemberName(p) + " did not arrive within " +
                               std::to_string(group_.timeout_ns / 1e9) + " s of the call's start (block " +
                               std::to_string(c->failed_block) + "); its process " +
                               (alive ? "still runs (it hung or does not take part in this call)"
                                      : "is gone") +
                               ". This communicator cannot be used any more.");
  }
  if (c->failure == kFailureAborted || aborted_ || c->abort)
    return Status::Aborted("the CUDA communicator was aborted");
  return Status::Ok();
}

Status CudaCommunicator::Synchronize(void* stream) {
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  NVG_CUDA_CHECK(cudaEventRecord(sync_, StreamOf(stream)));
  return WaitForEvent(sync_);
}

Status CudaCommunicator::WaitForEvent(cudaEvent_t event) {
  // Polls instead of blocking, so that a member's exit is noticed while the
  // kernels wait for it (Note [Peer processes]). The schedule follows what is
  // waited for: a bucket's copies and kernels take tens of microseconds to
  // milliseconds. Spin for kSpin (a short bucket ends within it), then sleep
  // kShortSleep between polls until kShortPhase (the end of a step's last
  // bucket is seen within a few microseconds: these waits are on the step's
  // critical path), then back off, doubling up to kLongSleep (a long wait is
  // seen at most kLongSleep late, a small share of it, without waking the
  // core every few microseconds). The callers' threads sleep on time
  // (WakeOnTime, cc/common/thread_setup.h).
  using Clock = std::chrono::steady_clock;
  constexpr auto kSpin = std::chrono::microseconds(20);
  constexpr auto kShortPhase = std::chrono::microseconds(300);
  constexpr auto kShortSleep = std::chrono::microseconds(5);
  constexpr auto kLongSleep = std::chrono::microseconds(200);
  const auto start = Clock::now();
  auto next_look = start + kLivenessCheck;
  auto sleep = kShortSleep;
  Clock::time_point drain_until{};
  for (;;) {
    const cudaError_t q = cudaEventQuery(event);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) {
      (void)cudaGetLastError();
      return Diagnose(Status::Internal(std::string("waiting for the stream failed: ") + cudaGetErrorName(q) +
                                       ": " + cudaGetErrorString(q)));
    }
    const auto now = Clock::now();
    if (now - start < kSpin) continue;
    if (now - start >= kShortPhase) sleep = std::min<std::chrono::microseconds>(sleep * 2, kLongSleep);
    std::this_thread::sleep_for(sleep);
    if (now < next_look) continue;
    next_look = now + kLivenessCheck;
    if (dead_member_ < 0 && DeadMember() >= 0) drain_until = now + kAbortDrain;
    if (dead_member_ >= 0 && now > drain_until) break;  // kernels aborted; do not wait forever
  }
  return CheckHealthy();
}

Status CudaCommunicator::WaitRecordedEvent(void* event) {
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  return WaitForEvent(static_cast<cudaEvent_t>(event));  // as Synchronize: a member's exit is noticed
}

void CudaCommunicator::Abort() {
  aborted_ = true;
  if (group_.control_host != nullptr) group_.control_host->abort = 1;
}

}  // namespace nvgroup
