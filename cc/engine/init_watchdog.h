// InitWatchdog: the bound on the parts of init() that MPI cannot bound.
//
// Note [Init watchdog]
// MPI_Init_thread and the blocking collectives of the communicators' setup
// (MPI_Comm_dup, MPI_Comm_split and MPI_Allgather in cc/topology/topology.cc,
// cc/cpu/cpu_communicator.cc and cc/transport/shm_group.cc; MPI_Comm_split in
// process-set registration) have no timeout: a peer that stopped (SIGSTOP) or
// hangs before it joins them holds every other rank in them forever, and Open
// MPI reports nothing. So Init runs under a watchdog, a thread that knows
// Init's current phase and when it began:
//
//  * Every phase gets `bound_s`: Init's wait (the larger of
//    NVGROUP_INIT_TIMEOUT and NVGROUP_TIMEOUT) plus kInitWatchdogGraceS.
//    Every bounded wait inside a phase gives up after Init's wait (the arrival
//    check after that plus kArrivalGraceS), so where a wait can give up its
//    error reaches Python first; the watchdog acts only where nothing else can.
//  * On expiry it logs at error level the phase, how long it waited and what
//    Init knows of the other ranks (the arrival check's verdict, init_arrival.h),
//    unlinks the shared-memory names this process created and not yet
//    unlinked (shm_group.h), and ends the process with
//    _exit(kInitWatchdogExitCode): a thread blocked inside MPI cannot be
//    brought back, and a rank that exits non-zero makes mpirun end the job, the
//    stopped peer with it.
//  * While armed, SIGTERM (mpirun ends every rank with it when one dies:
//    before the liveness monitor exists only Open MPI's daemons see a death,
//    and mpirun's message names the dead rank) writes one line naming the
//    phase and that cause, unlinks the pending shared-memory names and
//    re-raises SIGTERM with the default action (the process ends). The
//    handler that was there before is back once the watchdog is disarmed.
//
// So a rank of a job where a peer dies or freezes during init() ends within
// bound_s of the phase it is stuck in, with an error (Python) or a logged line
// and a non-zero exit.
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace nvgroup {

constexpr double kInitWatchdogGraceS = 5.0;
constexpr int kInitWatchdogExitCode = 70;  // EX_SOFTWARE of sysexits.h

class InitWatchdog {
 public:
  // Armed from construction to destruction. `what` names the caller in the
  // messages ("nvgroup_tf.init", "add_process_set").
  InitWatchdog(const char* what, double bound_s);
  ~InitWatchdog();
  InitWatchdog(const InitWatchdog&) = delete;
  InitWatchdog& operator=(const InitWatchdog&) = delete;

  // A new phase begins, with a fresh bound. `phase` is a short key (the test
  // hook's name, below), `description` what the phase does, for the messages;
  // both must be string literals.
  void Enter(const char* phase, const char* description);
  // What this rank knows about the others, quoted when the watchdog fires.
  void NoteRanks(const std::string& text);

 private:
  void Watch();
  void SetTermMessage();

  const char* what_;
  const double bound_s_;
  std::mutex mu_;
  std::condition_variable changed_;
  bool disarmed_ = false;
  const char* phase_ = "start";
  const char* description_ = "starting";
  double phase_started_ = 0;
  std::string ranks_;
  std::thread thread_;
};

// Test hook: the next InitWatchdog::Enter(phase) in this process stops it
// (SIGSTOP, kind "stop") or kills it (SIGKILL, kind "kill"), as a user's rank
// that freezes or dies there. Phases: mpi_init, arrival, dup, knobs,
// cpu_communicator, device_check, cuda_communicator, local_sizes, control_dup,
// engine, process_set.
// Whether `phase` is one of these (the hook refuses any other: it would never fire).
bool IsInitPhase(const std::string& phase);
void SetInitFaultForTesting(const std::string& phase, const std::string& kind);

}  // namespace nvgroup
