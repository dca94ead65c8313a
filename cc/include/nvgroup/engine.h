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
//    block); `done` runs after the output is complete on the device
//    (`completion_event_ready`, below, lets the framework go on earlier).
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
using AllocateOutputFn = std::function<Status(const std::vector<int64_t>& output_shape, void** out)>;

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
  int root_rank = 0;                // broadcast only (a rank of the process set)
  void* ready_event = nullptr;      // CUDA only: cudaEvent_t, may be nullptr
  DoneCallback done;
  // CUDA only, optional: called on an engine thread as soon as the
  // request's work is enqueued on the engine's stream, before `done`, with a
  // cudaEvent_t recorded after the request's output is written (one event per
  // bucket). It is valid only during the call: make the consumer's stream wait
  // on it there (cudaStreamWaitEvent captures the event at call time). An
  // adapter that lets its stream continue on this event need not block on
  // `done`, which still follows exactly once, after the host saw the bucket
  // complete, with OK or the device-side error (a peer lost mid-kernel); such
  // an error also aborts the engine, so every later collective fails.
  std::function<void(void* completion_event)> completion_event_ready;

  // --- reducescatter, alltoall, join (see types.h for their semantics). ---
  // reducescatter: allocate_output is called with this rank's share of
  // dimension 0 (Horovod's split); op Sum or Average, scale factors as allreduce.
  // alltoall: rows of dimension 0 sent to each rank of the process set (one
  // entry per rank, summing to shape[0]); empty = shape[0] split evenly (it must
  // divide). allocate_output is called with the received shape after
  // *received_splits (when non-null) holds the rows received from each rank.
  std::vector<int64_t> splits;
  std::vector<int64_t>* received_splits = nullptr;
  // join: `output` points to one int32 that receives the last rank to join.
  // Process set the collective runs in (0 = all ranks; see AddProcessSet).
  int32_t process_set_id = 0;
};

// Rows of dimension 0 that rank `rank` of `size` receives from a
// reducescatter of `dim0` rows (Horovod's split: ranks below dim0 % size get
// one more row). The engine's split; adapters that must know the output shape
// before the collective runs (the XLA lowering, ops/xla_lowering.cc) call it too.
int64_t ReducescatterRows(int64_t dim0, int rank, int size);

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

// MPI provides MPI_THREAD_MULTIPLE (Horovod's mpi_threads_supported): 1 or 0.
StatusOr<int> MpiThreadsSupported();
// Every node runs the same number of ranks (Horovod's is_homogeneous): 1 or 0,
// agreed by all ranks at Init.
StatusOr<int> IsHomogeneous();
// The value of the agreed setting `name` (a row of scope "agreed" in
// cc/common/env.cc) that every rank agreed at Init, normalized as AgreedKnobs
// writes it: the run-time source of the Python front end's agreed settings
// (the bucket cap). kFailedPrecondition before Init, kInvalidArgument for a
// name that is not an agreed setting.
StatusOr<std::string> AgreedSettingValue(const std::string& name);

// Run-time timeline control (Horovod's start_timeline/stop_timeline). Rank 0
// (the one that writes, as with NVGROUP_TIMELINE) opens `path`, replacing any
// open timeline; the other ranks return OK and write nothing. `mark_cycles`
// adds a CYCLE_START instant event for every cycle that executes collectives.
// Both return once the background loop has applied the change (the file is
// open, or closed and valid JSON), bounded by NVGROUP_TIMEOUT.
Status StartTimeline(const std::string& path, bool mark_cycles);
Status StopTimeline();

Status Enqueue(CollectiveRequest request);

// All requests are negotiated and fused as one unit: none runs until all are
// ready on every rank (Horovod's grouped_allreduce). All members must name the
// same process set.
Status EnqueueGroup(std::vector<CollectiveRequest> requests);

// --- Registered groups: a grouped allreduce registered once, launched each step ---
//
// A training step submits the same grouped allreduce every time (the
// DistributedOptimizer's buckets): the same names, shapes, dtypes and scales,
// only the pointers change. RegisterGroup takes that group once (its members'
// `input`, `output`, `ready_event`, `done` and `completion_event_ready` are
// ignored) and validates it; EnqueueRegisteredGroup then submits it with only
// the step's pointers, one readiness event and one `done`, with no per-member
// validation, name building or hashing (Note [Registered groups] in
// cc/engine/registered_groups.h).
//
// Contract:
//  * A launch is EnqueueGroup of the registered requests with the launch's
//    pointers: the same negotiation, response cache, plan, fusion and
//    results, bit for bit. Ranks are matched by the members' names as
//    always, so a rank that launches a registered group and a rank that
//    calls EnqueueGroup with the same requests work together; a rank whose
//    group differs (a shape, a name) fails on every rank as EnqueueGroup does.
//  * Registration is local to the rank (not collective). Members are
//    allreduces of one process set with distinct names; the process set
//    must exist and this rank must be a member. Until UnregisterGroup, the
//    members' names belong to the group on this rank, and registering one of
//    them in another group fails. Between launches they are lent: Enqueue or
//    EnqueueGroup of one of them runs as if it were not registered, and
//    until it completes the name is in flight (a launch of the group then
//    fails like a name in flight, as a second Enqueue of it does); while a
//    launch is in flight, Enqueue or EnqueueGroup of a member's name fails
//    like a name in flight (and, as that does, on every rank that submitted
//    it). So a caller can register where it can and submit by name where it
//    cannot (the TF kernels, ops/adapter.h) without the ranks telling apart.
//  * A change of shapes, names or anything else is a new registration
//    (UnregisterGroup, then RegisterGroup).
//  * EnqueueRegisteredGroup fails synchronously (and `done` is never called)
//    for an unknown handle, a handle registered before the last Shutdown or
//    whose process set was removed, a wrong number of pointers, a null
//    pointer of a member with elements, a missing `done`, or while the
//    group's previous launch or a member's name lent to Enqueue or
//    EnqueueGroup is still in flight (its names are in flight: as for
//    EnqueueGroup, the refusal also fails that launch on the ranks that
//    submitted it). Otherwise `done` runs exactly once, after every
//    member completed, with OK or the first member's error.
//  * UnregisterGroup fails with kFailedPrecondition while a launch is in
//    flight. Shutdown forgets every registration.
struct GroupLaunch {
  // One pointer per member, in the order the members were registered;
  // outputs[i] may equal inputs[i]. The arrays are read during the call only.
  const void* const* inputs = nullptr;
  void* const* outputs = nullptr;
  size_t count = 0;             // the number of pointers in each array: the group's member count
  void* ready_event = nullptr;  // CUDA only: cudaEvent_t after every input was produced, may be nullptr
  DoneCallback done;
  // CUDA only, optional: completion_event_ready of CollectiveRequest for the
  // whole launch: called once, when every member's work is enqueued on the
  // engine's stream, with an event recorded after the last of it (the
  // engine runs a launch's buckets in order on one stream, so it covers them
  // all). Not called when some member fails or completes without one.
  std::function<void(void* completion_event)> completion_event_ready;
};

// Defined where this header declares registered groups: tools built against
// older engines too (cc/tools/engine_perf.cc) test for it.
#define NVG_HAS_REGISTERED_GROUPS 1

// Registers `members` (allreduces, see above) and returns the group's handle
// (never 0, unique in the process). kFailedPrecondition before Init;
// kInvalidArgument for a member EnqueueGroup would refuse, a type other than
// allreduce, members of several process sets, repeated names, or a name that
// is in flight or belongs to another registered group.
StatusOr<uint64_t> RegisterGroup(std::vector<CollectiveRequest> members);
// Submits one launch of the registered group `group`.
Status EnqueueRegisteredGroup(uint64_t group, GroupLaunch launch);
// Forgets the registration; its names become free again.
Status UnregisterGroup(uint64_t group);
// Whether `group` can be launched: registered and not unregistered, not from
// before the last Shutdown, its process set's engine running. A caller that
// keeps a handle across a framework's steps (ops/adapter.h) asks before a
// launch and registers again when it says no.
bool RegisteredGroupUsable(uint64_t group);

// Blocking form, for callers that cannot take a callback (XLA custom calls,
// ops/xla_*.cc): submits `requests` (one: Enqueue; several: EnqueueGroup) with
// done callbacks of its own (any `done` set by the caller is replaced) and
// returns once every request has completed, with the first error. The wait is
// bounded by the engine's own bounds (NVGROUP_TIMEOUT, dead-rank detection,
// shutdown): every accepted request's done runs in bounded time. Must not be
// called from an engine thread (a done callback or allocate_output).
Status EnqueueAndWait(std::vector<CollectiveRequest> requests);
// Join (Horovod's hvd.join()): submit a CollectiveRequest of type kJoin. Until
// every rank of the process set has joined, the allreduces and reducescatters
// the other ranks submit complete with this rank contributing zeros (Average
// still divides by the full size); any other collective submitted meanwhile
// fails with kFailedPrecondition on every rank. The join's `done` runs once
// every rank joined; `output` then holds the last rank to join.

// Process sets (Horovod's ProcessSet). Set 0 is every rank. Each added set
// gets its own engine over an MPI sub-communicator: its own background
// thread, negotiation, response cache, communicators and NV-groups. Both calls
// are collective over ALL ranks of the job (every rank passes the same ranks,
// members and non-members alike; a disagreement fails on every rank naming
// each rank's list). `ranks` are ranks of set 0, sorted and unique. Returns the
// new set's id (the same on every rank: ids count registrations).
StatusOr<int32_t> AddProcessSet(const std::vector<int>& ranks);
// Stops the set's engine (its in-flight requests fail with kAborted) and frees
// its communicators. Collective over all ranks.
Status RemoveProcessSet(int32_t process_set_id);
// Ranks of a registered set (ranks of set 0), or kInvalidArgument.
StatusOr<std::vector<int>> ProcessSetRanks(int32_t process_set_id);
// Ids of the registered sets, ascending (0 first).
std::vector<int32_t> ProcessSetIds();
// This rank's rank/size within a set; rank is -1 when this rank is not a member.
StatusOr<int> ProcessSetRank(int32_t process_set_id);
StatusOr<int> ProcessSetSize(int32_t process_set_id);

}  // namespace nvgroup

// --- Engine counters (for benchmarks and tests; never needed for correctness) ---
namespace nvgroup {

// Cumulative since Init, read without stopping the engine (each field is read
// atomically; fields are not a consistent snapshot of one instant).
struct EngineStats {
  uint64_t cycles = 0;                // background-loop cycles (one agreement each)
  uint64_t negotiation_rounds = 0;    // cycles that went through rank 0 (gather + broadcast)
  uint64_t cached_responses = 0;      // requests agreed through the response cache
  uint64_t negotiated_responses = 0;  // requests (and errors) decided by rank 0
  uint64_t plan_launches = 0;         // grouped collectives run from a cached plan
  uint64_t buckets = 0;               // allreduce buckets run (fused or one tensor)
  uint64_t bucket_tensors = 0;        // tensors in those buckets
  uint64_t ready_event_waits = 0;     // CUDA: WaitEvent calls (one per distinct event per bucket)
  uint64_t agreement_allreduces = 0;  // cycles' agreement allreduces run over MPI (none with one rank)
  uint64_t quick_cycles = 0;          // cycles started early for leftover requests (background_loop.cc)
  // Group-level bookkeeping (Note [Cached groups], cc/engine/plan_cache.h):
  uint64_t queue_entries = 0;            // submissions the loop took (one per Enqueue or EnqueueGroup)
  uint64_t admitted_entries = 0;         // requests admitted one by one (name lookups, a Pending each)
  uint64_t cached_group_admissions = 0;  // groups admitted whole (one plan lookup, no per-member state)
  uint64_t cached_group_runs = 0;        // of those, groups run whole from their plan
  uint64_t cached_group_demotions = 0;   // groups turned back into entries (a round, a stall, a join)
  uint64_t groups_not_batched =
      0;       // admission batching ended at once by a grouped collective (tensor_queue.h)
  uint64_t lone_requests_not_batched =
      0;  // lone requests taken without waiting out the admission gap (tensor_queue.h)
  uint64_t bursts_ended_at_size = 0;  // takes ended at a repeated burst's size (tensor_queue.h)
  // Seconds the background thread spent, per phase.
  double idle_s = 0;       // waiting for requests (the cycle wait and admission batching)
  double agree_s = 0;      // the cycle's agreement allreduce (cache bits, plan ids, flags)
  double negotiate_s = 0;  // negotiation rounds through rank 0
  double execute_s = 0;    // communicator calls, fusion copies and done callbacks
  // Parts of the phases above (background thread):
  double admit_s = 0;      // admitting the cycle's submissions (in agree_s)
  double lookup_s =
      0;     // cache lookups: this rank's cache bits (in agree_s) and taking the hits (in negotiate_s)
  double complete_s = 0;   // completions: in-flight names released, done callbacks run (in execute_s; CPU)
};

// Fails with kFailedPrecondition before Init.
StatusOr<EngineStats> GetEngineStats();

}  // namespace nvgroup
