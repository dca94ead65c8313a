// Internal controls of the running engine for other parts of the library (the
// liveness monitor of cc/transport), not part of the public contract in
// nvgroup/engine.h.
#pragma once

#include <cstdint>

#include "nvgroup/status.h"

namespace nvgroup {

// Fails every pending and later request of the running engine with `reason`
// (e.g. kUnavailable "rank 2 (host h, pid 123) died or exited without
// shutdown(); aborting"), makes every wait in flight return (negotiation waits
// and the communicators' spin waits) and stops the background loop; Shutdown()
// is still needed to join and free. The first reason wins. No-op when no
// engine is running. Safe from any thread, including a monitor thread.
void AbortEngine(const Status& reason);

// Testing only: makes this rank's cache-and-plan digest (Note [Cached plans]
// in plan_cache.h) differ from the other ranks', as if its response cache
// had diverged; the next cycle must then fail on every rank. No-op when no
// engine is running.
void PerturbStateDigestForTesting();

// Testing and benchmarks only: the delay added to every allreduce bucket on
// the engine's stream (NVGROUP_TEST_BUCKET_DELAY_US, set from it at Init;
// Communicator::DelayStream), microseconds; 0 = none. Takes effect at the
// next bucket. Safe from any thread.
void SetBucketDelayForTesting(double microseconds);
double BucketDelayForTesting();
// Buckets that the simulated link delayed since the process started (a
// benchmark's denominator: the link time it added is this count times the delay).
int64_t DelayedBucketsForTesting();

// Testing only: from the next Init on, host collectives complete the way CUDA
// ones do (Completion::StartHostEvents, completion.h): on the finalizer's
// thread, after one host token per bucket that a request's
// completion_event_ready hears of first. Lets the CPU suite run that path.
void SetHostCompletionEventsForTesting(bool on);

}  // namespace nvgroup
