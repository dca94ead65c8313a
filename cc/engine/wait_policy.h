// How the engine's background thread waits: for its queue between cycles and
// for the cycle's MPI operations. The whole policy is here, with the
// measurements behind each constant; TensorQueue::WaitAndPop and
// SleepUnlessPushed (tensor_queue.h) and WaitMpi (mpi_wait.h) carry it out.
#pragma once

#include <chrono>
#include <thread>

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
//  * Polling only while the core is free: each poll yields the core
//    (YieldUncontended below), and a yield that gave the core to another
//    thread for longer than kContendedYieldS ends the polling phase at once:
//    the wait then sleeps on its event (the queue's condition variable) or
//    takes WaitMpi's sleep phase. On a quiet host a yield returns in under a
//    microsecond (nothing else wants the core) and the poll sees its event
//    as it happens; on a loaded host the poll would only take CPU from the
//    threads that hold the core (the caller's own submitting thread among
//    them), and a sleeper woken by a futex is scheduled at least as soon.
//  * The finalizer (completion.h), which runs the done callbacks of CUDA
//    buckets after their events, polls for its next job for kExpectWorkS
//    after each one the same way (Finalizer::PollForJob), since in
//    lock-step the next bucket's job follows within it.
//  * The caller's wake-up comes first: after a bucket's done callbacks, which
//    wake a caller blocked in wait()/wait_all(), the loop yields its core
//    once (YieldToWokenCaller), so a caller woken onto this core runs before
//    the loop's own bookkeeping (freeing the cycle's entries, plans, counters).
//
// Where a lock-step step's time went, before these two rules (2-core VM, 2
// ranks, ResNet-50's 214 gradients at 1/64, medians per rank, 5f73a5b with
// probes, load 1.5): grouped 506 us = pybind submission 152-161 (1 us per
// item: Note [A group item's common form] in cc/python/engine_bindings.cc),
// push to the loop's take 26-28 (the caller's own work after the push: the
// loop polls but both cores run the ranks' submitting threads), admission and
// cache bits 12, agreement 9-15, execution 223-235 (of which the 214 done
// callbacks 19), last callback to the caller running 12-15, wait_all's own
// return 19-21; the raw MPI_Allreduce 347 us. Per tensor 829 us: submission
// 270-288 (214 calls), last push to take 56 (the 30 us admission gap and the
// timer wake-up that ends it: now polled, above), admission and cache lookup
// of 214 entries 72, agreement 8-18, cache hits 14, execution 278-287,
// caller wake-up 17-19, wait_all's return 28-29.
// The bisect of 40433e6..9dfe90f with engine_cpu_cost_bench under load 5-7
// (benchmarks/results/engine_cpu_cost_bisect_2rank.json) found no build
// slower than the noise: 40433e6's grouped step was 2.88x the raw
// MPI_Allreduce there, every later build 1.77-1.93x.
// Measurements of the policy (benchmarks/results/engine_cpu_cost_wait_2rank_{a,b}.json,
// 2-core VM with nothing else running, 2 ranks, the engine before these two
// rules and the fast item path of the bindings (ccd78e5) against the engine
// with them, 6 and 10 alternated launches): the grouped exchange 957 -> 839 us
// and 687 -> 580 us, one call per tensor 1325 -> 1174 us and 1024 -> 865 us.
// The raw MPI_Allreduce of the same 1.6 MB took 761-847 us in the first run
// and 315-356 us in the second (Open MPI's shared-memory path on this VM has
// launches in two modes), so the ratio to it was 1.10x / 1.54x there and
// 1.84x / 2.75x here.

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

// ---- Polling without taking a busy core -------------------------------------

// A sched_yield that returned later than this gave the core to another thread
// for that long. On the 2-core VM a yield with nothing else runnable takes
// 0.6 us (p99 0.7 us; 0.1% above 20 us, the hypervisor's own preemptions).
constexpr double kContendedYieldS = 20e-6;

// Yields the core once; false when another thread held it for longer than
// kContendedYieldS meanwhile (the polling phase then ends: see Note [Waiting
// for a lock-step caller]).
inline bool YieldUncontended() {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point before = Clock::now();
  std::this_thread::yield();
  return std::chrono::duration<double>(Clock::now() - before).count() < kContendedYieldS;
}

// After done callbacks that may have woken a caller: one yield, so a caller
// woken onto this core runs now (a no-op system call when none was).
inline void YieldToWokenCaller() { std::this_thread::yield(); }

// ---- Waiting for MPI (WaitMpi, mpi_wait.cc) ---------------------------------

// A small collective between ranks of one host completes in 5-30 us: the
// common case never leaves the busy phase.
constexpr double kBusyPollS = 50e-6;
// A cycle with work: yield the core between polls up to here (while the yields
// find the core free: YieldUncontended). A peer slightly behind (its caller's
// submission came later, or its thread waited for a core) joins within it;
// longer yield-polling took CPU from the peers on an oversubscribed host.
// Polling through contention is worse: busy-polling without yields up to here
// (2-core VM, 2 ranks, one busy-looping process beside them, 2026-12-07,
// benchmarks/cpu_engine_step_bench.py, 3 alternated launches) made the grouped
// step 1000 -> 1343, 771 -> 1658 and 1020 -> 2220 us, and also spinning 200 us
// in the shared-memory barriers (cc/transport/shm_group.cc) slower still.
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
