// Communicator: the NV-group collectives on raw buffers, NCCL-style.
//
// This is the layer the C++ benchmark (cc/tools/allreduce_perf) times against
// NCCL, and the layer the engine (engine.h) runs its fused buffers through.
// It knows nothing about tensor names, negotiation or frameworks.
//
// Groups. Ranks are partitioned into *groups* of equal size G: the ranks of one
// node whose devices reach each other directly (CPU: ranks sharing memory; CUDA:
// GPUs with NVLink peer access, queried, never assumed). NVGROUP_GROUP_SIZE
// overrides G (it must divide the node's rank count) so the hierarchy can be
// exercised on one machine, e.g. 4 ranks as 2 groups x 2. group_index identifies
// the group, group_rank the rank's position in it. Ranks with the same
// group_rank in different groups are *peers*: they form the cross communicator.
//
// Allreduce (see cc/algorithms/hierarchical_allreduce.h for the skeleton):
//   1. group reduce-scatter: each group rank reduces its slice of the buffer by
//      reading its group members' registered buffers directly (CUDA IPC over
//      NVLink, or POSIX shared memory on the CPU), in fixed rank order;
//   2. cross-group allreduce of that slice among peers (MPI; pinned host staging
//      when MPI is not CUDA-aware);
//   3. group allgather of the slices.
// Large buffers are cut into chunks and pipelined through the three steps.
// With one group, step 2 vanishes and small messages take the one-shot path.
//
// Determinism: the reduction order is fixed (group members in group_rank order,
// then groups in group_index order), so every rank gets bitwise identical results.
//
// Registered buffer: inputs that already lie in registered_buffer() skip a copy
// (the engine fuses tensors straight into it). Any other input pointer works and
// is copied in first, in chunks of registered_capacity() bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "nvgroup/status.h"
#include "nvgroup/types.h"

namespace nvgroup {

struct Topology {
  int rank = 0;           // in the communicator's MPI communicator
  int size = 1;
  int local_rank = 0;     // among the ranks of this node (MPI_COMM_TYPE_SHARED)
  int local_size = 1;
  int node_index = 0;     // Horovod's cross_rank: index of this node
  int node_count = 1;     // Horovod's cross_size
  int group_index = 0;    // which NV-group this rank belongs to
  int group_count = 1;
  int group_rank = 0;     // position inside the group
  int group_size = 1;
};

// Settings. A communicator reads every NVGROUP_* setting from one place, the
// Knobs (cc/common/env.h) it is created with: the group size (group_size,
// 0 = detect), the pipeline chunk (pipeline_chunk), the algorithm, the
// one-shot limit, the one-GPU group mode (one_gpu_group, CUDA tests only; see
// cc/device/device_topology.h), the fusion threshold (which sizes the default
// registered buffer) and the peer timeout (peer_timeout_s: a call whose
// kernels or barriers cannot finish because a peer does not arrive gives up
// after this long, from the call's start, with kUnavailable naming the peer).
// Callers start from ParseKnobsFromEnvironment() (the engine: its knobs,
// agreed across ranks at Init) and override fields there before creating it.
struct Knobs;

// What a communicator needs besides the settings.
struct CommunicatorOptions {
  // Bytes of the registered buffer per rank; 0 = Knobs::fusion_threshold or
  // 64 MiB, whichever is larger. Not an NVGROUP_* setting: tests and
  // benchmarks size it per communicator.
  size_t registered_bytes = 0;
};

// The collectives: every rank calls them in the same order. Per-call state
// (barrier counters, the one-shot staging epoch, copy slots, cross-step
// events) belongs to the implementation and lives where the work runs (CUDA:
// in device memory, used by one call at a time on the communicator's own
// stream), so none of it shows here.
class Collectives {
 public:
  virtual ~Collectives() = default;

  // out[i] = op over ranks of in[i], i < count. in == out is allowed.
  // CPU: host pointers, complete on return. CUDA: device pointers of device(),
  // ordered after prior work on `stream` (a cudaStream_t, nullptr = the
  // communicator's own stream), returns once enqueued; results are valid when
  // `stream` reaches this point. Calls on different streams are serialized by
  // the communicator; a call may be captured in a CUDA graph (one NV-group),
  // whose replays the caller orders with the communicator's other calls.
  virtual Status Allreduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                           void* stream) = 0;

  // out = concatenation over ranks of each rank's `bytes_per_rank[r]` bytes.
  virtual Status Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes_per_rank,
                            void* stream) = 0;

  // buf on every rank = buf on `root`.
  virtual Status Broadcast(void* buf, size_t bytes, int root, void* stream) = 0;

  // Reduce-scatter: the reduction over ranks (op as Allreduce; Average divides
  // by size, integers truncating) of the sum(counts) elements of `in`, of which
  // this rank receives elements [sum(counts[:rank]), sum(counts[:rank+1])) into
  // `out`. Every element gets the bits Allreduce would give it (same fold
  // order). CPU and CUDA: with one group of several ranks this is the
  // skeleton's group reduce-scatter step itself (each rank folds only its own
  // rows, reading the members' registered buffers: shared memory, or CUDA IPC
  // in the row reduce-scatter kernel, cc/kernels/reduce_scatter.cu); over
  // several groups the hierarchical reduce-scatter (that group step for every
  // group's rows, then a reduce-scatter-only cross step:
  // cc/algorithms/hierarchical_reduce_scatter.h); CPU with
  // NVGROUP_ALLREDUCE_ALGORITHM=mpi the flat allreduce, then the rank's rows.
  // `out` must not overlap the registered buffer; `in` may be the registered
  // buffer from its start (it is left unchanged).
  virtual Status ReduceScatter(const void* in, void* out, const std::vector<size_t>& counts, DataType dtype,
                               ReduceOp op, void* stream) = 0;

  // All-to-all on bytes: send_bytes[r] bytes (consecutive in `in`, rank order)
  // go to rank r; recv_bytes[r] bytes from rank r land consecutively in `out`.
  // The ranks' counts are cross-checked first: a disagreement is the same
  // kInvalidArgument on every rank.
  virtual Status Alltoallv(const void* in, const std::vector<size_t>& send_bytes, void* out,
                           const std::vector<size_t>& recv_bytes, void* stream) = 0;

  // Registered buffer of this rank (see header comment). Stable for the
  // communicator's lifetime.
  virtual void* registered_buffer() = 0;
  virtual size_t registered_capacity() const = 0;
};

// Local stream helpers the engine runs around the collectives on the same
// stream (nothing collective about them).
class StreamHelpers {
 public:
  virtual ~StreamHelpers() = default;

  // Makes later work on `stream` wait for `event` (a cudaEvent_t recorded by the
  // framework) without blocking the host. CPU: no-op. nullptr event: no-op.
  virtual Status WaitEvent(void* event, void* stream) = 0;

  // dst_i[j] = src_i[j] * scale for every copy i, j < count_i elements of
  // `dtype`, as one batched operation (CUDA: one kernel launch for all copies;
  // fp16/bf16 scaled in fp32). scale == 1.0 copies bit for bit. Used to fuse
  // tensors into registered_buffer() with the prescale, and out again with the
  // postscale: the only two copies fusion adds.
  struct CopySpec {
    const void* src;
    void* dst;
    size_t count;  // elements
  };
  virtual Status BatchedScaledCopy(const CopySpec* copies, size_t num_copies, DataType dtype, double scale,
                                   void* stream) = 0;

  // Blocks the calling host thread until all work on `stream` is done; reports
  // a failure of the collectives queued on it (a dead or hung peer) as their
  // Status.
  virtual Status Synchronize(void* stream) = 0;
};

// One communicator = the collectives + the helpers on one device, plus what
// both need to know. Callers use it from one host thread at a time.
class Communicator : public Collectives, public StreamHelpers {
 public:
  ~Communicator() override = default;

  virtual const Topology& topology() const = 0;
  virtual Device device() const = 0;

  // Per-bucket completion (lets the engine hand a bucket over before the host
  // waited for it). RecordEvent records `event` (a cudaEvent_t of device()) on `stream` after the work
  // enqueued there so far; WaitRecordedEvent blocks the host until that point
  // is reached, then reports a device-side failure (abort, barrier timeout)
  // as Synchronize does. Unlike Synchronize it does not wait for work enqueued
  // after the event (the next bucket). CPU: work is complete on return, both
  // are no-ops.
  virtual Status RecordEvent(void* /*event*/, void* /*stream*/) { return Status::Ok(); }
  virtual Status WaitRecordedEvent(void* /*event*/) { return Status::Ok(); }

  // Tests and benchmarks only (NVGROUP_TEST_BUCKET_DELAY_US, the simulated
  // link): delays the work enqueued on `stream` after this call by
  // `microseconds`. CUDA: a one-thread kernel spinning on the GPU's global
  // timer, so the host is not held; CPU (work completes on return): the
  // calling thread sleeps.
  virtual Status DelayStream(double microseconds, void* stream);

  // The engine's fused bucket: for every member k,
  //   output_k = postscale * (op over ranks of (prescale * input_k))
  // computed bit for bit as the three-step reference below does: each input
  // scaled into registered_buffer() at byte `offset` (ascending, 16-byte
  // aligned, the same on every rank, all within registered_capacity()), one
  // in-place Allreduce of the buffer's first `bytes` bytes, each member's
  // result scaled out of the buffer into its output. Overrides skip the
  // buffer where no peer needs it (one rank: the scaled copies alone; CPU
  // with one group: only what the group members read goes through it, the
  // results are gathered straight into the outputs). Same stream and
  // completion rules as Allreduce. `observer`, when set, hears the host-side
  // begin and end of the copy-in, reduction and copy-out phases (the
  // timeline's FUSION_COPY_IN / ALLREDUCE / FUSION_COPY_OUT).
  struct FusedMember {
    const void* input;
    void* output;  // may equal input
    size_t count;  // elements
    size_t offset;  // bytes into registered_buffer()
  };
  enum class FusedPhase { kCopyIn = 0, kReduce = 1, kCopyOut = 2 };
  struct PhaseObserver {
    void (*mark)(void* context, FusedPhase phase, bool begin) = nullptr;
    void* context = nullptr;
    void operator()(FusedPhase phase, bool begin) const {
      if (mark != nullptr) mark(context, phase, begin);
    }
  };
  virtual Status FusedAllreduce(const FusedMember* members, size_t num_members, size_t bytes, DataType dtype,
                                ReduceOp op, double prescale, double postscale, void* stream,
                                const PhaseObserver& observer) {
    return FusedAllreduceThroughBuffer(members, num_members, bytes, dtype, op, prescale, postscale, stream,
                                       observer);
  }

 protected:
  // The three-step reference of FusedAllreduce (every member through the
  // registered buffer); implementations fall back to it where they have no
  // shorter path.
  Status FusedAllreduceThroughBuffer(const FusedMember* members, size_t num_members, size_t bytes,
                                     DataType dtype, ReduceOp op, double prescale, double postscale,
                                     void* stream, const PhaseObserver& observer) {
    char* buffer = static_cast<char*>(registered_buffer());
    std::vector<CopySpec> in(num_members), out(num_members);
    for (size_t k = 0; k < num_members; ++k) {
      in[k] = {members[k].input, buffer + members[k].offset, members[k].count};
      out[k] = {buffer + members[k].offset, members[k].output, members[k].count};
    }
    if (bytes == 0) return Status::Ok();
    const size_t element = DataTypeSize(dtype);
    observer(FusedPhase::kCopyIn, true);
    Status s = BatchedScaledCopy(in.data(), in.size(), dtype, prescale, stream);
    observer(FusedPhase::kCopyIn, false);
    if (!s.ok()) return s;
    observer(FusedPhase::kReduce, true);
    s = Allreduce(buffer, buffer, bytes / element, dtype, op, stream);
    observer(FusedPhase::kReduce, false);
    if (!s.ok()) return s;
    observer(FusedPhase::kCopyOut, true);
    s = BatchedScaledCopy(out.data(), out.size(), dtype, postscale, stream);
    observer(FusedPhase::kCopyOut, false);
    return s;
  }

  // FusedAllreduce on a communicator of one rank: any op over one rank is the
  // identity, so output = postscale * (prescale * input), rounded after each
  // factor as the reference rounds into and out of the buffer. No buffer: one
  // batched scaled copy input -> output (two when both factors are not 1;
  // none for an in-place member when both are 1).
  Status FusedAllreduceOneRank(const FusedMember* members, size_t num_members, DataType dtype,
                               double prescale, double postscale, void* stream,
                               const PhaseObserver& observer) {
    const bool pre = prescale != 1.0, post = postscale != 1.0;
    std::vector<CopySpec> first, second;
    first.reserve(num_members);
    for (size_t k = 0; k < num_members; ++k) {
      const FusedMember& m = members[k];
      if (m.count == 0 || (!pre && !post && m.input == m.output)) continue;
      first.push_back({m.input, m.output, m.count});
      if (pre && post) second.push_back({m.output, m.output, m.count});
    }
    observer(FusedPhase::kCopyIn, true);
    observer(FusedPhase::kCopyIn, false);
    observer(FusedPhase::kReduce, true);
    observer(FusedPhase::kReduce, false);
    observer(FusedPhase::kCopyOut, true);
    Status s;
    if (!first.empty())
      s = BatchedScaledCopy(first.data(), first.size(), dtype, pre ? prescale : postscale, stream);
    if (s.ok() && !second.empty())
      s = BatchedScaledCopy(second.data(), second.size(), dtype, postscale, stream);
    observer(FusedPhase::kCopyOut, false);
    return s;
  }

 public:

  // Makes every spin wait in flight or started later return kAborted promptly.
  // Safe to call from any thread (used on shutdown and when a peer is lost).
  virtual void Abort() = 0;
};

// Creates the communicator over the MPI communicator given by its Fortran handle
// (MPI_Comm_c2f; -1 = MPI_COMM_WORLD) for `device`, with the settings `knobs`
// (see Settings above; read during the call only). Collective over that
// communicator: every rank must call it. MPI must already be initialized.
StatusOr<std::unique_ptr<Communicator>> CreateCommunicator(int64_t mpi_comm_fortran, Device device,
                                                           const Knobs& knobs,
                                                           const CommunicatorOptions& options =
                                                               CommunicatorOptions());

}  // namespace nvgroup
