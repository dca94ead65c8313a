// Bounded waits on non-blocking MPI operations, and the engine's clock.
//
// The engine never blocks in MPI without a bound (see the design constraints in
// background_loop.h): it starts a non-blocking operation and polls it here
// until it completes, an abort flag is raised, or a timeout passes.
#pragma once

#include <mpi.h>

#include <atomic>
#include <string>

#include "nvgroup/status.h"

namespace nvgroup {

// Seconds on a monotonic clock (timeouts, stall times, timeline stamps).
double MonotonicSeconds();

// Polls `request` until it completes (OK), `abort` becomes true (kAborted) or
// `timeout_s` passes (kUnavailable naming `what` and NVGROUP_TIMEOUT).
Status WaitMpi(MPI_Request* request, const std::string& what, double timeout_s,
               const std::atomic<bool>& abort);

}  // namespace nvgroup
