// Per-thread setup of the engine's own threads: their names and their timer
// slack. How those threads wait is cc/engine/wait_policy.h.
#pragma once

namespace nvgroup {

// Names the calling thread (at most 15 characters; shown by top -H, ps -L,
// /proc/<pid>/task/<tid>/comm and debuggers). No effect where unsupported.
void NameThisThread(const char* name);

// Makes the calling thread's sleeps end when asked rather than up to 50 us
// later (Linux's default timer slack, prctl(2) PR_SET_TIMERSLACK): the
// background loop's waits and the finalizer's polls of a bucket's completion
// event sleep for tens of microseconds, and a 50 us overshoot on each was a
// visible share of a step. No effect where unsupported.
void WakeOnTime();

}  // namespace nvgroup
