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
//    block); `done` runs after the output is complete on the device, unless
//    the request sets `wait_on_completion` (below).
//  * Device completion (CUDA, `wait_on_completion` set): once the request's
//    device work is enqueued, the engine records a completion event on its
//    stream and calls wait_on_completion(event) on an engine thread; the
//    framework makes its own stream wait on the event inside that call (the
//    event is re-recorded after the call returns), and `done(OK)` follows at
//    once, with no host sync: the output is complete when the framework's
//    stream passes the wait. A failure the device reports later (a peer lost
//    inside a kernel's barrier) aborts the engine: every later collective on
//    every rank fails naming it.
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
  // CUDA only, optional (see the contract above). A non-OK return becomes the
  // status passed to `done`.
  std::function<Status(void* completion_event)> wait_on_completion;
};

struct EngineOptions {
  int64_t mpi_comm_fortran = -1;  // MPI_Comm_c2f of the communicator; -1 = COMM_WORLD
  // CUDA builds: create the CUDA communicator (its registered GPU memory) in
  // Init, on device local_rank % visible devices, before a framework reserves
  // the GPU's memory; else at the first CUDA collective. Init then fails on
  // every rank, naming the rank and the bytes, when the memory cannot be had.
  bool cuda_at_init = false;
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
