// Engine: the Horovod-style front door. One instance per process.
//
// Framework adapters (ops/ for TensorFlow, the pybind11 module, the benchmark)
// submit named collectives with data pointers, a readiness signal and a done
// callback. A background thread negotiates an order across ranks (ranks may
// submit in different orders: collectives are matched by name), validates that
// all ranks agree (dtype, shape, op, scale factors, root, device), fuses ready
// allreduces of the same dtype/op/device into one buffer of up to
// NVGROUP_FUSION_THRESHOLD bytes, and runs them through a Communicator.
//
// Contract:
//  * Enqueue returns a non-OK Status synchronously for bad input on this rank
//    (then `done` is never called). Otherwise `done` is called exactly once,
//    from an engine thread, with OK or the error (same error on every rank for
//    cross-rank mismatches). `done` must not block on other collectives.
//  * Pointers stay valid until `done` runs.
//  * CUDA requests: `ready_event` (a cudaEvent_t recorded by the framework on
//    its stream after the input was produced) is waited on *by the GPU* (no host
//    block); `done` runs after the output is complete on the device.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "nvgroup/status.h"
#include "nvgroup/types.h"

namespace nvgroup {

using DoneCallback = std::function<void(const Status&)>;

// Allgather's output size is known only after negotiation (first dimensions may
// differ across ranks): the engine asks the adapter to allocate it.
// Returns the output pointer (on the request's device) through `out`.
using AllocateOutputFn =
    std::function<Status(const std::vector<int64_t>& output_shape, void** out)>;

struct CollectiveRequest {
  std::string name;                 // unique among in-flight requests; same on every rank
  CollectiveType type = CollectiveType::kAllreduce;
  DataType dtype = DataType::kFloat32;
  Device device = Device::Cpu();
  std::vector<int64_t> shape;
  const void* input = nullptr;
  void* output = nullptr;           // allreduce/broadcast (may equal input); unused for allgather
  AllocateOutputFn allocate_output; // allgather only
  ReduceOp op = ReduceOp::kSum;     // allreduce only
  double prescale_factor = 1.0;     // allreduce only: applied to input before reduction
  double postscale_factor = 1.0;    // allreduce only: applied to the result
  int root_rank = 0;                // broadcast only
  void* ready_event = nullptr;      // CUDA only: cudaEvent_t, may be nullptr
  DoneCallback done;
  // CUDA only, optional (issue 11): called on an engine thread as soon as the
  // request's work is enqueued on the engine's stream, before `done`, with a
  // cudaEvent_t recorded after the request's output is written (one event per
  // bucket). It is valid only during the call: make the consumer's stream wait
  // on it there (cudaStreamWaitEvent captures the event at call time). An
  // adapter that lets its stream continue on this event need not block on
  // `done`, which still follows exactly once, after the host saw the bucket
  // complete, with OK or the device-side error (a peer lost mid-kernel); such
  // an error also aborts the engine, so every later collective fails.
  std::function<void(void* completion_event)> completion_event_ready;
};

struct EngineOptions {
  int64_t mpi_comm_fortran = -1;  // MPI_Comm_c2f of the communicator; -1 = COMM_WORLD
  // Everything else comes from NVGROUP_* environment variables, parsed once in
  // cc/common/env.h; a malformed value makes Init fail naming the variable.
};

// Initializes MPI if nobody has (MPI_THREAD_MULTIPLE requested), splits the
// topology, starts the background thread. Collective. Idempotent while running.
Status Init(const EngineOptions& options);
// Fails every request in flight with kAborted, stops the thread and frees the
// communicators. MPI stays initialized (it cannot be initialized twice), so
// Init works again after Shutdown.
Status Shutdown();
// Finalizes MPI if Init initialized it (and nobody else finalized it). Called
// once at process exit (Python atexit, the benchmark's main) so mpirun exits 0.
Status FinalizeMpi();
bool IsInitialized();

// Topology of the engine's communicator. Fail with kFailedPrecondition before Init.
StatusOr<int> Rank();
StatusOr<int> Size();
StatusOr<int> LocalRank();
StatusOr<int> LocalSize();
StatusOr<int> CrossRank();
StatusOr<int> CrossSize();

Status Enqueue(CollectiveRequest request);

// All requests are negotiated and fused as one unit: none runs until all are
// ready on every rank (Horovod's grouped_allreduce).
Status EnqueueGroup(std::vector<CollectiveRequest> requests);

}  // namespace nvgroup

// --- Engine counters (for benchmarks and tests; never needed for correctness) ---
namespace nvgroup {

// Cumulative since Init, read without stopping the engine (each field is read
// atomically; fields are not a consistent snapshot of one instant).
struct EngineStats {
  uint64_t cycles = 0;                // background-loop cycles (one agreement allreduce each)
  uint64_t negotiation_rounds = 0;    // cycles that went through rank 0 (gather + broadcast)
  uint64_t cached_responses = 0;      // requests agreed through the response cache
  uint64_t negotiated_responses = 0;  // requests (and errors) decided by rank 0
  uint64_t plan_launches = 0;         // grouped collectives run from a cached plan
  uint64_t buckets = 0;               // allreduce buckets run (fused or one tensor)
  uint64_t bucket_tensors = 0;        // tensors in those buckets
  uint64_t ready_event_waits = 0;     // CUDA: WaitEvent calls (one per distinct event per bucket)
  // Seconds the background thread spent, per phase.
  double idle_s = 0;       // waiting for requests (the cycle wait and admission batching)
  double agree_s = 0;      // the cycle's agreement allreduce (cache bits, plan ids, flags)
  double negotiate_s = 0;  // negotiation rounds through rank 0
  double execute_s = 0;    // communicator calls, fusion copies and done callbacks
};

// Fails with kFailedPrecondition before Init.
StatusOr<EngineStats> GetEngineStats();

}  // namespace nvgroup
