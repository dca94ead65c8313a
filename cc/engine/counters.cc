// The engine's counters behind GetEngineStats (counters.h).
#include "engine/counters.h"

namespace nvgroup {

EngineStats EngineCounters::Snapshot(uint64_t groups_not_batched, uint64_t lone_requests_not_batched,
                                     uint64_t bursts_ended_at_size) const {
  auto get = [](const std::atomic<uint64_t>& c) { return c.load(std::memory_order_relaxed); };
  auto seconds = [&](const std::atomic<uint64_t>& c) { return static_cast<double>(get(c)) * 1e-9; };
  EngineStats st;
  st.cycles = get(cycles);
  st.negotiation_rounds = get(negotiation_rounds);
  st.cached_responses = get(cached_responses);
  st.negotiated_responses = get(negotiated_responses);
  st.plan_launches = get(plan_launches);
  st.buckets = get(buckets);
  st.bucket_tensors = get(bucket_tensors);
  st.ready_event_waits = get(ready_event_waits);
  st.agreement_allreduces = get(agreement_allreduces);
  st.quick_cycles = get(quick_cycles);
  st.queue_entries = get(queue_entries);
  st.admitted_entries = get(admitted_entries);
  st.cached_group_admissions = get(cached_group_admissions);
  st.cached_group_runs = get(cached_group_runs);
  st.cached_group_demotions = get(cached_group_demotions);
  st.groups_not_batched = groups_not_batched;
  st.lone_requests_not_batched = lone_requests_not_batched;
  st.bursts_ended_at_size = bursts_ended_at_size;
  st.admit_s = seconds(admit_ns);
  st.lookup_s = seconds(lookup_ns);
  st.complete_s = seconds(complete_ns);
  st.idle_s = seconds(idle_ns);
  st.agree_s = seconds(agree_ns);
  st.negotiate_s = seconds(negotiate_ns);
  st.execute_s = seconds(execute_ns);
  return st;
}

}  // namespace nvgroup
