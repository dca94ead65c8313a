#include "engine/init_watchdog.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "common/logging.h"
#include "engine/mpi_wait.h"
#include "transport/shm_group.h"

namespace nvgroup {
namespace {

// The SIGTERM line, written by Enter and read by the handler: two buffers,
// the handler reads the one `g_term_current` names (Enter fills the other,
// then flips).
constexpr size_t kTermMessageBytes = 512;
char g_term_message[2][kTermMessageBytes];
std::atomic<int> g_term_current{-1};  // -1: no message yet
std::atomic<int> g_armed{0};          // watchdogs alive; the first one installs the handler
struct sigaction g_previous_term;

void OnTerm(int sig) {
  const int i = g_term_current.load(std::memory_order_acquire);
  if (i >= 0) {
    const char* m = g_term_message[i];
    ssize_t ignored = write(STDERR_FILENO, m, strlen(m));
    (void)ignored;
  }
  UnlinkPendingShmSegments();
  signal(sig, SIG_DFL);
  raise(sig);
}

std::mutex g_fault_mu;
std::string g_fault_phase, g_fault_kind;

}  // namespace

bool IsInitPhase(const std::string& phase) {
  static const char* const kPhases[] = {
      "mpi_init",          "arrival",     "dup",         "knobs",  "cpu_communicator", "device_check",
      "cuda_communicator", "local_sizes", "control_dup", "engine", "process_set"};
  for (const char* p : kPhases)
    if (phase == p) return true;
  return false;
}

void SetInitFaultForTesting(const std::string& phase, const std::string& kind) {
  std::lock_guard<std::mutex> lock(g_fault_mu);
  g_fault_phase = phase;
  g_fault_kind = kind;
}

InitWatchdog::InitWatchdog(const char* what, double bound_s) : what_(what), bound_s_(bound_s) {
  phase_started_ = MonotonicSeconds();
  SetTermMessage();
  if (g_armed.fetch_add(1) == 0) {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_handler = OnTerm;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGTERM, &sa, &g_previous_term) != 0)
      NVG_LOG(kWarning) << what_ << ": could not install the SIGTERM handler of init ("
                        << std::strerror(errno) << "); a rank ended by mpirun during init() does not say so";
  }
  thread_ = std::thread([this] { Watch(); });
}

InitWatchdog::~InitWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    disarmed_ = true;
  }
  changed_.notify_all();
  thread_.join();
  if (g_armed.fetch_sub(1) == 1) {
    if (sigaction(SIGTERM, &g_previous_term, nullptr) != 0)
      NVG_LOG(kWarning) << what_ << ": could not restore the SIGTERM handler (" << std::strerror(errno)
                        << ")";
    g_term_current.store(-1, std::memory_order_release);
  }
}

void InitWatchdog::Enter(const char* phase, const char* description) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    phase_ = phase;
    description_ = description;
    phase_started_ = MonotonicSeconds();
    SetTermMessage();
  }
  changed_.notify_all();
  std::string kind;
  {
    std::lock_guard<std::mutex> lock(g_fault_mu);
    if (g_fault_phase == phase) {
      kind = g_fault_kind;
      g_fault_phase.clear();
    }
  }
  if (kind == "stop") raise(SIGSTOP);
  if (kind == "kill") raise(SIGKILL);
}

void InitWatchdog::NoteRanks(const std::string& text) {
  std::lock_guard<std::mutex> lock(mu_);
  ranks_ = text;
  SetTermMessage();
}

// Under mu_.
void InitWatchdog::SetTermMessage() {
  const int next = g_term_current.load(std::memory_order_relaxed) == 0 ? 1 : 0;
  char rank[16] = "?";
  if (LogRank() >= 0) std::snprintf(rank, sizeof(rank), "%d", LogRank());
  std::snprintf(
      g_term_message[next], kTermMessageBytes,
      "[nvgroup rank %s] ERROR: %s ended by SIGTERM in phase %s (%s): mpirun ends every rank this way "
      "when a rank dies during init(); mpirun's message names it%s%s\n",
      rank, what_, phase_, description_, ranks_.empty() ? "" : "; ", ranks_.c_str());
  g_term_current.store(next, std::memory_order_release);
}

void InitWatchdog::Watch() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!disarmed_) {
    const double left = phase_started_ + bound_s_ - MonotonicSeconds();
    if (left > 0) {
      changed_.wait_for(lock, std::chrono::duration<double>(std::min(left, 1.0)));
      continue;
    }
    NVG_LOG(kError) << what_ << " was stuck for " << bound_s_ << " s in phase " << phase_ << " ("
                    << description_
                    << "; bound: the larger of NVGROUP_INIT_TIMEOUT and NVGROUP_TIMEOUT, plus "
                    << kInitWatchdogGraceS << " s): a rank stopped, hung or died inside a blocking MPI call, "
                    << "which has no timeout" << (ranks_.empty() ? "" : "; ") << ranks_
                    << ". Ending this process (exit code " << kInitWatchdogExitCode
                    << ") so that mpirun ends the job";
    UnlinkPendingShmSegments();
    std::fflush(nullptr);
    _exit(kInitWatchdogExitCode);
  }
}

}  // namespace nvgroup
