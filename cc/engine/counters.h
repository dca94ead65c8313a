// The engine's counters behind GetEngineStats (nvgroup/engine.h): written by
// the background thread, read by any thread. Relaxed atomics: they order
// nothing, so reading them never slows the loop down. The loop's phase times
// go through one scoped timer (PhaseTimer).
#pragma once

#include <atomic>
#include <cstdint>

#include "engine/mpi_wait.h"
#include "nvgroup/engine.h"

namespace nvgroup {

struct EngineCounters {
  std::atomic<uint64_t> cycles{0}, negotiation_rounds{0}, cached_responses{0}, negotiated_responses{0},
      plan_launches{0}, buckets{0}, bucket_tensors{0}, ready_event_waits{0}, agreement_allreduces{0},
      quick_cycles{0}, queue_entries{0}, admitted_entries{0}, cached_group_admissions{0},
      cached_group_runs{0}, cached_group_demotions{0};
  // Time spent per phase, in nanoseconds.
  std::atomic<uint64_t> idle_ns{0}, agree_ns{0}, negotiate_ns{0}, execute_ns{0}, admit_ns{0}, lookup_ns{0},
      complete_ns{0};

  static void Add(std::atomic<uint64_t>& c, uint64_t n = 1) { c.fetch_add(n, std::memory_order_relaxed); }
  static void AddSeconds(std::atomic<uint64_t>& c, double s) {
    c.fetch_add(static_cast<uint64_t>(s * 1e9), std::memory_order_relaxed);
  }

  // A snapshot; `groups_not_batched`, `lone_requests_not_batched` and
  // `bursts_ended_at_size` come from the TensorQueue.
  EngineStats Snapshot(uint64_t groups_not_batched, uint64_t lone_requests_not_batched,
                       uint64_t bursts_ended_at_size) const;
};

// Adds the seconds from `start` to Stop() (or to its end, if not stopped) to
// one phase counter of EngineCounters. Phases nest as EngineStats describes
// them (admit_s and lookup_s inside agree_s, ...): a timer stopped at t hands
// t to the next phase's timer as its start.
class PhaseTimer {
 public:
  explicit PhaseTimer(std::atomic<uint64_t>* into, double start = MonotonicSeconds())
      : into_(into), start_(start) {}
  ~PhaseTimer() {
    if (into_ != nullptr) Stop();
  }
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;
  // Adds the time since the start (once); returns the time it stopped at.
  double Stop() {
    const double now = MonotonicSeconds();
    EngineCounters::AddSeconds(*into_, now - start_);
    into_ = nullptr;
    return now;
  }

 private:
  std::atomic<uint64_t>* into_;
  const double start_;
};

}  // namespace nvgroup
