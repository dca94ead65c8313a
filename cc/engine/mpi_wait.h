// Bounded waits on non-blocking MPI operations, and the engine's clock.
//
// The engine never blocks in MPI without a bound (see the design constraints in
// background_loop.h): it starts a non-blocking operation and polls it here
// until it completes, an abort flag is raised, or a timeout passes.
#pragma once

#include <mpi.h>

#include <atomic>
#include <string>
#include <vector>

#include "nvgroup/status.h"

namespace nvgroup {

// Seconds on a monotonic clock (timeouts, stall times, timeline stamps).
double MonotonicSeconds();

// Polls `request` until it completes (OK), `abort` becomes true (kAborted) or
// `timeout_s` passes (kUnavailable naming `what` and NVGROUP_TIMEOUT).
Status WaitMpi(MPI_Request* request, const std::string& what, double timeout_s,
               const std::atomic<bool>& abort);

// Note [Liveness probe]
// After a wait timed out, the waiting ranks learn who is silent: each sends a
// one-byte message to every other rank on `comm` (which must carry no other
// point-to-point traffic) and listens for theirs for `grace_s`. The live ranks
// are stuck in the same collective and time out within a cycle of each other,
// so a grace of a second or two lets them all answer; a hung or dead rank
// never does. Unanswered receives are cancelled; sends are left to complete
// (one byte goes out eagerly). Returns the ranks that did not answer.
StatusOr<std::vector<int>> FindSilentRanks(MPI_Comm comm, double grace_s);

}  // namespace nvgroup
