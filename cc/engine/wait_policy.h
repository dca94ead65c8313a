// How the engine's background thread waits: for its queue between cycles and
// for the cycle's MPI operations. The whole policy is here, with the
// measurements behind each constant; TensorQueue::WaitAndPop and
// SleepUnlessPushed (tensor_queue.h) and WaitMpi (mpi_wait.h) carry it out.
#pragma once

namespace nvgroup {

// Note [Waiting for a lock-step caller]
// The loop's waits are of three kinds, and each waits the way its case needs.
//  * Work in flight or expected: poll, do not sleep. A caller in lock-step
//    (one group, wait, next group; one tensor, wait, next tensor) puts every
//    one of the engine's wake-ups on its critical path: a sleeping thread
//    wakes tens of microseconds after the futex or timer that ends its sleep
//    on a quiet VM (the vCPU halted; more under load, when the woken thread
//    queues for a core), while a polling one sees the change within a poll.
//    So after each completion, and after each submission the loop took, the
//    loop polls its queue for kExpectWorkS before it sleeps on it (the
//    caller's next submission comes within it in lock-step); and the waits
//    of a cycle that carries work (the agreement, a negotiation round)
//    busy-poll MPI_Test for kBusyPollS, then yield the core between polls up
//    to kInFlightYieldPollS, and only then sleep (a peer that is that late
//    is computing, not submitting).
//  * Nothing in flight: sleep. An idle rank waits for its queue for
//    kIdleCycleWaitS (Note [An idle rank sleeps]), and an idle cycle's
//    agreement sleeps from its start, but a submission ends that sleep at
//    once (TensorQueue::SleepUnlessPushed: the wait then polls, as above),
//    so a submission never waits for an idle sleep to run out.
//  * Neither case polls for long: every polling phase is bounded (the ones
//    above, and the communicators' own spin-then-yield waits), so a rank
//    whose peers are computing sleeps again within a fraction of a
//    millisecond and the compute that follows an exchange keeps its cores
//    (benchmarks/engine_cpu_cost_bench.py measures both: the exchange
//    against a raw MPI_Allreduce of the same bytes, and the compute after
//    it against no engine at all).
// Measurements (2-core VM, 2 ranks, ResNet-50's 214 gradients at 1/64, 1.6 MB,
// benchmarks/results/engine_cpu_cost_bisect_2rank.json, load 5-7): the grouped
// step costs 1.89x a raw MPI_Allreduce with this policy and 1.93x without it
// (9dfe90f), per tensor 2.79x and 2.88x, compute after an exchange 0.98x: no
// change outside the noise under that load; kExpectWorkS and
// kInFlightYieldPollS are not tuned yet on a quiet machine.

// ---- Waiting for the queue ---------------------------------------------------

// After a completion or a taken submission: how long the loop polls its queue
// before sleeping on it. Covers the caller's turnaround in lock-step (a done
// callback, the caller's wake-up and its next enqueue: 20-80 us through pybind
// on the 2-core VM), small against the compute that follows an exchange (a
// forward pass, milliseconds), whose cores it would take.
constexpr double kExpectWorkS = 200e-6;

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
// in WaitMpi, see Note [Busy-poll, then sleep] in mpi_wait.h) until the idle
// rank's own submission or its idle timer brings it into the same cycle. What
// needs an idle rank without a submission of its own waits at most one idle
// cycle more: a peer's shutdown agreement, a peer's report to an idle rank 0
// (stall warnings, NVGROUP_STALL_WARNING_TIME and NVGROUP_STALL_SHUTDOWN_TIME
// are seconds), rank 0's timeline control, an abort raised while the loop
// sleeps (abort flags are read at the top of a cycle). Every one of these is
// bounded by NVGROUP_TIMEOUT + 1 s already, far above it.
constexpr double kIdleCycleWaitS = 0.05;

// The loop's wait for its queue: `cycle_s` (NVGROUP_CYCLE_TIME) when this rank
// has something in flight, else the idle wait (never shorter than cycle_s).
inline double IdleCycleWaitSeconds(double cycle_s, bool nothing_in_flight) {
  if (!nothing_in_flight) return cycle_s;
  return cycle_s > kIdleCycleWaitS ? cycle_s : kIdleCycleWaitS;
}

// The loop's last activity (a completion, or a submission it took) and the
// polling window that follows it (kExpectWorkS). Background thread only.
class ExpectedWork {
 public:
  void Activity(double now) { last_ = now; }
  // Seconds left to poll the queue at `now` (0: sleep on it).
  double PollSeconds(double now) const {
    const double left = last_ + kExpectWorkS - now;
    return left > 0 ? left : 0;
  }

 private:
  double last_ = -1;
};

// ---- Waiting for MPI (WaitMpi, mpi_wait.cc) ---------------------------------

// A small collective between ranks of one host completes in 5-30 us: the
// common case never leaves the busy phase.
constexpr double kBusyPollS = 50e-6;
// A cycle with work: yield the core between polls up to here. A peer slightly
// behind (its caller's submission came later, or its thread waited for a
// core) joins within it; longer yield-polling took CPU from the peers on an
// oversubscribed host.
constexpr double kInFlightYieldPollS = 250e-6;
// Then sleeps, growing from 1 us: steps up to kMinMaxSleepUs, and in a long
// wait up to kLateFraction of the time waited so far (at most kMaxSleepUs),
// so a long wait polls a few hundred times a second and ends at most
// max(200 us, 5%) after its request completed.
constexpr int kMinMaxSleepUs = 200;
constexpr int kMaxSleepUs = 2000;
constexpr double kLateFraction = 0.05;
// An idle cycle's agreement (WaitMpi's sleep_at_once): sleeps from the start,
// growing from kIdleFirstSleepUs to kIdleMaxSleepUs (then 5% of the time
// waited, as above): under load each poll cost 10-15 us of CPU, and a
// submission ends the sleep at once (SleepUnlessPushed).
constexpr int kIdleFirstSleepUs = 20;
constexpr int kIdleMaxSleepUs = 1000;

}  // namespace nvgroup
