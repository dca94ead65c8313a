// The Python engine bindings' handles: every asynchronous collective
// returns an integer handle that wait()/wait_all()/poll() resolve.
//
// A handle is shared between the engine's `done` callback (background thread,
// no GIL) and wait()/poll() (Python thread). The callback only stores the
// Status and signals a condition variable; wait() releases the GIL while it
// blocks. Allgather outputs are allocated by the binding, off the GIL: host
// memory handed to numpy without a copy at wait(), or cudaMalloc'd memory
// returned as (address, shape) and released with free_cuda().
#pragma once

#include <pybind11/pybind11.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "nvgroup/engine.h"
#include "nvgroup/status.h"
#include "nvgroup/types.h"

namespace nvgroup {

// WaitAll's one wake-up for many handles: each handle not yet done when
// wait_all looked counts it down once (under the latch's mutex), and only the
// last one signals, so a step's 214 completions wake the waiting thread once
// instead of up to 214 times (each a context switch on a loaded machine).
struct Latch {
  std::mutex mu;
  std::condition_variable cv;
  size_t remaining = 0;
};

struct Handle {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
  std::shared_ptr<Latch> latch;  // set by WaitAll (under mu) while it waits
  // Allgather output (allocated by AllocateOutput on the background thread).
  bool is_allgather = false;
  DataType dtype = DataType::kFloat32;
  Device device;
  std::vector<int64_t> out_shape;
  std::shared_ptr<std::vector<char>> host_out;
  void* cuda_out = nullptr;
  // Alltoall: rows received from each rank (filled before the output is
  // allocated); join: the last rank to join.
  bool is_alltoall = false;
  std::vector<int64_t> received_splits;
  bool is_join = false;
  int32_t join_result = -1;
};

// A request whose output the engine asks us to allocate (allgather,
// reducescatter, alltoall), into `h`.
CollectiveRequest MakeAllocated(CollectiveType type, const std::string& name, uintptr_t in,
                                std::vector<int64_t> shape, const std::string& dtype,
                                const std::string& device, uintptr_t ready_event, int32_t process_set,
                                const std::shared_ptr<Handle>& h);

// Enqueues `q` (or the group `qs`, request i resolving handle i) and returns
// its handle id(s); `keepalive` (may be None) lives until the handle is waited for.
int64_t SubmitOne(CollectiveRequest q, std::shared_ptr<Handle> h, pybind11::object keepalive);
std::vector<int64_t> SubmitGroup(std::vector<CollectiveRequest> qs, std::vector<std::shared_ptr<Handle>> hs,
                                 pybind11::object keepalive);

// Launches registered group `group` (EnqueueRegisteredGroup) with `launch`'s
// pointers, resolving one handle when the whole group is done; returns its id.
int64_t SubmitRegistered(uint64_t group, GroupLaunch launch, pybind11::object keepalive);

// Waits (GIL released); returns None, or the allgather output. Raises on error.
pybind11::object Wait(int64_t id, pybind11::object timeout);
// Waits for every handle with one release of the GIL, then resolves them in order like Wait().
pybind11::list WaitAll(const std::vector<int64_t>& ids);
bool Poll(int64_t id);
// Testing: the next `count` output allocations of this process (allgather,
// reducescatter, alltoall: allocate_output) fail, so the engine's path for an
// output this rank cannot have runs (Note [Outputs sized by negotiation],
// cc/engine/execution.cc).
void RefuseOutputAllocationsForTesting(int count);
// Testing: whether the requests submitted from here on carry a
// completion_event_ready (engine.h) that counts the events it hears, and
// resets the counts; CompletionEventsHeardForTesting returns (events heard,
// of them heard after their `done` or without an event).
void AnnounceCompletionEventsForTesting(bool on);
std::pair<int64_t, int64_t> CompletionEventsHeardForTesting();

}  // namespace nvgroup
