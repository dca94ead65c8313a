// How long the background loop sleeps between cycles when this rank has
// nothing in flight, and the names of the engine's threads.
#pragma once

namespace nvgroup {

// Note [An idle rank sleeps]
// A rank with nothing in flight (nothing pending, no cached group waiting, no
// join) has no reason to run the cycle at the cycle time: every collective it
// could take part in needs its own submission, and TensorQueue::Push wakes the
// loop at once (the same wake-up that ends a busy rank's cycle wait), so a
// collective submitted after a quiet spell starts as soon as before. Running
// the 1 ms cycle anyway cost each rank an agreement allreduce and the polls
// of its wait every millisecond, taken from the application's own compute
// (the next forward pass follows a step's allreduce: with the ranks filling
// the cores of a 2-core host that compute ran ~20% slower with the engine
// alive; benchmarks/engine_cpu_cost_bench.py measures it).
// So an idle rank waits for its queue for IdleCycleWaitSeconds. The cycle is
// still a collective: a busy peer's agreement waits for the idle rank (sleeping
// in WaitMpi, see Note [Busy-poll, then sleep]) until the idle rank's own
// submission or its idle timer brings it into the same cycle. What needs an idle
// rank without a submission of its own waits at most one idle cycle more:
// a peer's shutdown agreement, a peer's report to an idle rank 0 (stall
// warnings, NVGROUP_STALL_WARNING_TIME and NVGROUP_STALL_SHUTDOWN_TIME are seconds), rank 0's timeline control, an abort
// raised while the loop sleeps (abort flags are read at the top of a cycle).
// Every one of these is bounded by NVGROUP_TIMEOUT + 1 s already, far above it.
constexpr double kIdleCycleWaitS = 0.05;

// The loop's wait for its queue: `cycle_s` (NVGROUP_CYCLE_TIME) when this rank
// has something in flight, else the idle wait (never shorter than cycle_s).
inline double IdleCycleWaitSeconds(double cycle_s, bool nothing_in_flight) {
  if (!nothing_in_flight) return cycle_s;
  return cycle_s > kIdleCycleWaitS ? cycle_s : kIdleCycleWaitS;
}

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
