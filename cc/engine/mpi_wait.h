// Bounded waits on non-blocking MPI operations, and the engine's clock.
//
// The engine never blocks in MPI without a bound (see the design constraints in
// engine.h): it starts a non-blocking operation and polls it here
// until it completes, an abort flag is raised, or a timeout passes.
#pragma once

#include <mpi.h>

#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "nvgroup/status.h"

namespace nvgroup {

// Seconds on a monotonic clock (timeouts, stall times, timeline stamps).
double MonotonicSeconds();

// Polls `request` until it completes (OK), `abort` becomes true (kAborted) or
// `timeout_s` passes (kUnavailable naming `what`, and `cycle` when >= 0, and
// NVGROUP_TIMEOUT). The text is built only on failure (the engine waits here
// several times per cycle).
//
// Note [Busy-poll, then sleep]
// The wait first polls MPI_Test without pausing, then yields the core between
// polls, and only then sleeps in growing steps, so a long wait for a slow peer
// costs no CPU (the phases and their lengths: wait_policy.h, Note [Waiting
// for a lock-step caller]). Sleeping early was the old behaviour: the
// kernel's timer slack (50 us by default) turned each 1-2-4 us sleep into
// ~55 us, which a step of 214 small collectives paid many times. The engine's
// background thread also lowers its own timer slack (WakeOnTime,
// cc/common/thread_setup.h).
//
// `sleep_at_once`: skip the busy and yield phases, for a wait that is known to
// be long, such as an idle rank's agreement allreduce (Note [An idle rank
// sleeps] in wait_policy.h): it waits for a peer's idle timer or submission.
// Its sleeps go through `sleep_unless_woken` when given (it returns true when
// a submission ended the sleep early: the wait then polls as a wait with work
// does), else std::this_thread::sleep_for.
Status WaitMpi(MPI_Request* request, const char* what, double timeout_s, const std::atomic<bool>& abort,
               int64_t cycle = -1, bool sleep_at_once = false,
               const std::function<bool(double seconds)>* sleep_unless_woken = nullptr);

// Note [Liveness probe]
// After a wait timed out, the waiting ranks learn who is silent: each sends a
// one-byte message to every other rank on `comm` (which must carry no other
// point-to-point traffic) and listens for theirs for `grace_s`. The live ranks
// are stuck in the same collective and time out within a cycle of each other,
// so a grace of a second or two lets them all answer; a hung or dead rank
// never does. Unanswered receives are cancelled; sends are left to complete
// (one byte goes out eagerly). Returns the ranks that did not answer.
StatusOr<std::vector<int>> FindSilentRanks(MPI_Comm comm, double grace_s);

// A bounded collective wait of init() or of the process-set registration gave
// up (kUnavailable: a rank stopped, hung or died in it): every live rank is
// stuck in the same wait and gives up within moments of the others, so a
// liveness probe on `comm` (above, grace 2 s) names the ranks that are gone,
// appended to `waited`. Any other status is returned as it is.
Status NameSilentRanks(Status waited, MPI_Comm comm);

}  // namespace nvgroup
