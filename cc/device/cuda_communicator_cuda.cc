// CudaCommunicator: owns the device state (topology, IPC region, streams,
// control words) and runs every Allreduce through the one hierarchical
// skeleton with DevicePrimitives. See cuda_communicator.h for the overview and
// cc/kernels/p2p_allreduce.cuh for the NVLink protocol.
//
// Note [Internal stream]. All per-communicator state (barrier counters, the
// one-shot epoch, the registered buffers, cross-step events and buffers) is
// used by one call at a time because every call runs on the communicator's
// own stream `work_`: a call on another stream S first makes work_ wait for
// S (event), runs on work_, then makes S wait for work_ (event), as NCCL
// does. So calls on several caller streams serialize, and a call captured in
// a CUDA graph forks work_ into the capture and joins it back. A graph's
// replay runs outside work_: it must be ordered with the communicator's other
// calls by the caller (same stream, or events), as NCCL requires.
//
// Note [Peer processes]. Members of a group share a node, so each rank knows
// its members' pids. Synchronize and WaitRecordedEvent poll their event and
// look, every kLivenessCheck, whether the members' processes still exist; a
// CUDA error (a fault from a mapping whose owner exited) or a timeout is
// reported as kUnavailable naming the member whose process is gone. A communicator that saw a failure
// never frees its own region: a peer kernel that timed out or is still
// spinning may yet store flags into it; the process exit frees it.
#include "device/cuda_communicator.h"

#include <cuda_runtime.h>
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <thread>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "algorithms/hierarchical_allreduce.h"
#include "common/collective_args.h"
#include "common/cuda_checks.h"
#include "common/env.h"
#include "device/device_primitives.h"
#include "device/device_topology.h"
#include "kernels/reduce_scatter.h"

#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>
#endif

namespace nvgroup {
namespace {

// Staging half of the one-shot kernel, bytes: caps oneshot_max_bytes.
// TensorRT-LLM uses one-shot up to 16 MB on <= 2 GPUs (ANCHORS.md §2), so the
// measured threshold cannot usefully exceed that.
constexpr size_t kOneShotStagingBytes = 16u << 20;
// Default registered buffer: the engine's fusion threshold or 64 MiB, whichever
// is larger (communicator.h).
constexpr size_t kMinRegisteredBytes = 64u << 20;
// Launch defaults, measured on 2x H200 with allreduce_perf --sweep (see
// docs/PERFORMANCE.md "Tuning"): for 2 GPUs one-shot is faster than two-shot
// up to 8 MiB (its remote traffic, (G-1) S, equals two-shot's 2 (G-1)/G S
// when G = 2, and it has one barrier instead of three); a grid cap of 128
// blocks was the fastest for both kernels from 1 MiB up (two-shot with its
// 4-unit batches: 192 and 256 blocks were 5-20% slower at 64-256 MiB; since the
// two-shot kernel runs one block per SM, 132 is the most that is resident). For larger
// groups one-shot moves (G-1) S against 2 (G-1)/G S, so it pays only where
// latency dominates: 512 KiB, between PyTorch's 256 KB and vLLM's 512 KB-1 MB
// one-shot limits (ANCHORS.md §2) -- not measured here (2 GPUs only).
constexpr size_t kDefaultOneShotMaxBytesTwoGpus = 8u << 20;
constexpr size_t kDefaultOneShotMaxBytesLarger = 512u << 10;
constexpr int kDefaultOneShotBlocks = 128;
constexpr int kDefaultTwoShotBlocks = 128;
// Two-shot on user buffers: pipeline chunk per slice (Note [Two-shot
// schedule] in p2p_allreduce.cuh), measured with allreduce_perf --pipeline_sweep
// (docs/PERFORMANCE.md "Pipelined two-shot").
constexpr size_t kDefaultTwoShotChunkBytes = 8u << 20;
// BatchedScaledCopy descriptor slots in flight (pinned host + device each).
// A fused bucket takes two (copy in, copy out): 16 keep eight buckets in
// flight before the host waits for the oldest slot's kernel.
constexpr int kCopySlots = 16;
// Synchronize: how often it looks at the members' processes while it waits,
// and how long it still waits for the kernels to give up after an abort.
constexpr auto kLivenessCheck = std::chrono::milliseconds(2);
constexpr auto kAbortDrain = std::chrono::seconds(10);

// Whether process `pid` (same node) still runs: kill(pid, 0) finds it and it
// is no zombie (an exited child not yet reaped by its launcher).
bool ProcessAlive(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == EPERM;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;  // no procfs: trust kill()
  char state = 'R';
  const int got = std::fscanf(f, "%*d (%*[^)]) %c", &state);
  std::fclose(f);
  return got != 1 || (state != 'Z' && state != 'X');
}

bool MpiIsCudaAware() {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;
#else
  return false;  // no compile-time support: never hand MPI device pointers
#endif
}

bool MpiFinalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

class CudaCommunicator final : public Communicator {
 public:
  static StatusOr<std::unique_ptr<Communicator>> Create(MPI_Comm comm, int device_ordinal,
                                                        const CommunicatorOptions& options,
                                                        const Topology& host_topology);
  ~CudaCommunicator() override;

  const Topology& topology() const override { return group_.topo; }
  Device device() const override { return Device::Cuda(group_.device); }
  Status Allreduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                   void* stream) override;
  Status Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes_per_rank,
                    void* stream) override;
  Status Broadcast(void* buf, size_t bytes, int root, void* stream) override;
  Status ReduceScatter(const void* in, void* out, const std::vector<size_t>& counts, DataType dtype,
                       ReduceOp op, void* stream) override;
  Status Alltoallv(const void* in, const std::vector<size_t>& send_bytes, void* out,
                   const std::vector<size_t>& recv_bytes, void* stream) override;
  void* registered_buffer() override { return group_.region->data(group_.topo.group_rank); }
  size_t registered_capacity() const override { return group_.region->data_bytes(); }
  Status WaitEvent(void* event, void* stream) override;
  Status BatchedScaledCopy(const CopySpec* copies, size_t num_copies, DataType dtype,
                           double scale, void* stream) override;
  Status FusedAllreduce(const FusedMember* members, size_t num_members, size_t bytes, DataType dtype,
                        ReduceOp op, double prescale, double postscale, void* stream,
                        const PhaseObserver& observer) override;
  Status Synchronize(void* stream) override;
  // Synchronize and WaitRecordedEvent: polls `event`, watching the members'
  // processes (Note [Peer processes]).
  Status WaitForEvent(cudaEvent_t event);
  Status RecordEvent(void* event, void* stream) override;
  Status WaitRecordedEvent(void* event) override;
  void Abort() override;

  Status SetTuning(const KernelTuning& tuning);
  const KernelTuning& tuning() const { return group_.tuning; }
  Status SetTwoShotChunk(size_t chunk_bytes);

 private:
  CudaCommunicator() = default;
  Status Init(MPI_Comm comm, int device_ordinal, const CommunicatorOptions& options,
              const Topology& host_topology);
  Status CheckHealthy() const;
  Status CheckDevicePointer(const void* p, const char* what);
  // Allgatherv/Broadcast go through the registered buffers (peer copies) when
  // all ranks form one NV-group and on no rank the buffers a and b overlap the
  // registered buffer; else host staging through MPI. Collective.
  StatusOr<bool> UsePeerCopies(const void* a, size_t a_bytes, const void* b, size_t b_bytes);
  // The caller's stream (nullptr: the communicator's own stream work_).
  cudaStream_t StreamOf(void* stream) const {
    return stream != nullptr ? static_cast<cudaStream_t>(stream) : work_;
  }
  // Note [Internal stream]: work_ waits for `caller`, and `caller` for work_.
  Status EnterWork(cudaStream_t caller);
  Status LeaveWork(cudaStream_t caller);
  StatusOr<bool> Capturing(cudaStream_t stream) const;
  Status AllreduceOnWork(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                         cudaStream_t caller);
  Status AllreducePiece(const void* in, void* out, size_t count, bool in_registered,
                        size_t offset, DataType dtype, ReduceOp op);
  // ReduceScatter's two paths (see there) and Alltoallv's peer path.
  Status GroupRowReduceScatter(const void* in, void* out, size_t total, size_t my_offset, size_t mine,
                               bool in_registered, DataType dtype, ReduceOp op);
  Status HierarchicalReduceScatter(const void* in, void* out, const std::vector<size_t>& counts,
                                   bool in_registered, DataType dtype, ReduceOp op);
  Status PeerAlltoallv(const void* in, size_t send_total, void* out, const std::vector<size_t>& recv_bytes,
                       const std::vector<uint64_t>& incoming, cudaStream_t caller);
  // Note [Peer processes]: the first member whose process is gone, or -1.
  int DeadMember();
  std::string MemberName(int p) const;
  // A failure `s` becomes kUnavailable naming the member when a member's
  // process is gone (its CUDA error is then a consequence).
  Status Diagnose(Status s);

  MPI_Comm comm_ = MPI_COMM_NULL;  // dup of the caller's communicator
  DeviceGroup group_;
  std::vector<int> member_ranks_;  // global rank of each group_rank, for messages
  std::vector<pid_t> member_pids_;  // pid of each group_rank (same node)
  std::vector<bool> pid_visible_;   // kill(pid, 0) could see it at creation
  int dead_member_ = -1;            // a member found gone (sticky)
  cudaStream_t work_ = nullptr;     // Note [Internal stream]
  cudaEvent_t enter_ = nullptr, leave_ = nullptr, sync_ = nullptr;
  size_t chunk_bytes_ = 0;
  bool force_hierarchy_ = false;
  int row_scatter_block_cap_ = 1;  // grid cap of the row reduce-scatter kernel (Init)
  std::atomic<bool> aborted_{false};
  bool initialized_ = false;  // Init completed on every rank (destructor barrier)

  // BatchedScaledCopy: descriptors go pinned host -> device; a slot is reused
  // once the kernel that read it (event) is done.
  struct CopySlot {
    DeviceCopySpec* host = nullptr;
    DeviceCopySpec* device = nullptr;
    size_t capacity = 0;
    cudaEvent_t done = nullptr;
  };
  CopySlot slots_[kCopySlots];
  int next_slot_ = 0;
  // Pointers recently found to be device memory of this GPU: the check costs a
  // driver call (cudaPointerGetAttributes), repeated calls reuse buffers.
  static constexpr int kCheckedPointers = 8;
  const void* checked_[kCheckedPointers] = {};
  int next_checked_ = 0;
};

Status CudaCommunicator::Init(MPI_Comm comm, int device_ordinal, const CommunicatorOptions& options,
                              const Topology& host_topology) {
  // The engine passes its parsed, cross-rank agreed knobs (CommunicatorOptions::knobs).
  auto knobs = options.knobs != nullptr ? StatusOr<Knobs>(*options.knobs) : ParseKnobsFromEnvironment();
  if (!knobs.ok()) return knobs.status();
  const Knobs& k = knobs.value();
  NVG_MPI_CHECK(MPI_Comm_dup(comm, &comm_));

  const int requested = options.group_size > 0 ? options.group_size : k.group_size;
  int ranks_on_device = 1;
  NVG_RETURN_IF_ERROR_CTX(
      ResolveDeviceTopology(comm_, device_ordinal, requested,
                            options.one_gpu_group || k.one_gpu_group, &group_.topo, &group_.comms,
                            &group_.device, &ranks_on_device),
      "resolving the GPU topology");
  if (group_.topo.rank != host_topology.rank || group_.topo.size != host_topology.size ||
      group_.topo.local_rank != host_topology.local_rank)
    return Status::Internal("CUDA topology disagrees with the host topology passed in (rank " +
                            std::to_string(host_topology.rank) + "/" +
                            std::to_string(host_topology.size) + " vs " +
                            std::to_string(group_.topo.rank) + "/" +
                            std::to_string(group_.topo.size) + ")");
  const Topology& topo = group_.topo;
  member_ranks_.resize(topo.group_size);
  NVG_MPI_CHECK(MPI_Allgather(&topo.rank, 1, MPI_INT, member_ranks_.data(), 1, MPI_INT,
                              group_.comms.group));
  std::vector<int> pids(topo.group_size);
  const int my_pid = static_cast<int>(getpid());
  NVG_MPI_CHECK(MPI_Allgather(&my_pid, 1, MPI_INT, pids.data(), 1, MPI_INT, group_.comms.group));
  for (int p : pids) {
    member_pids_.push_back(static_cast<pid_t>(p));
    pid_visible_.push_back(kill(static_cast<pid_t>(p), 0) == 0);
  }
  if (topo.group_size > 1) {
    // Every block of a launch must be resident at once, on every member, with
    // the grids of every rank that shares this GPU (one-GPU group mode: the
    // members of this group and of any other group on the same GPU).
    auto resident = ResidentP2pBlocks(group_.device, topo.group_size);
    if (!resident.ok()) return resident.status();
    int cap = std::max(1, resident.value() / ranks_on_device);
    NVG_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &cap, 1, MPI_INT, MPI_MIN, group_.comms.group));
    group_.block_cap = cap;
    // The same for the row reduce-scatter kernel (its own occupancy).
    auto row_resident = ResidentRowScatterBlocks(group_.device, topo.group_size);
    if (!row_resident.ok()) return row_resident.status();
    int row_cap = std::max(1, row_resident.value() / ranks_on_device);
    NVG_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &row_cap, 1, MPI_INT, MPI_MIN, group_.comms.group));
    row_scatter_block_cap_ = row_cap;
  }

  group_.tuning.oneshot_max_bytes =
      k.oneshot_max_bytes > 0 ? k.oneshot_max_bytes
      : topo.group_size == 2  ? kDefaultOneShotMaxBytesTwoGpus
                              : kDefaultOneShotMaxBytesLarger;
  if (group_.tuning.oneshot_max_bytes > kOneShotStagingBytes)
    return Status::InvalidArgument("NVGROUP_ONESHOT_MAX_BYTES=" +
                                   std::to_string(group_.tuning.oneshot_max_bytes) +
                                   " exceeds the one-shot staging buffer of " +
                                   std::to_string(kOneShotStagingBytes) + " bytes");
  group_.tuning.oneshot_blocks = kDefaultOneShotBlocks;
  group_.tuning.twoshot_blocks = kDefaultTwoShotBlocks;
  group_.tuning.twoshot_chunk_bytes = kDefaultTwoShotChunkBytes;
  group_.timeout_ns = static_cast<uint64_t>(options.timeout_seconds * 1e9);
  // Every rank takes the same cross-step path (device or host fold): the
  // ranks agree, CUDA-aware only if all of them are.
  int cuda_aware = MpiIsCudaAware() ? 1 : 0, all_cuda_aware = 0;
  NVG_MPI_CHECK(MPI_Allreduce(&cuda_aware, &all_cuda_aware, 1, MPI_INT, MPI_MIN, comm_));
  group_.cuda_aware_mpi = all_cuda_aware == 1;
  chunk_bytes_ = options.pipeline_chunk_bytes > 0 ? options.pipeline_chunk_bytes : k.pipeline_chunk;
  force_hierarchy_ = k.algorithm == AllreduceAlgorithm::kHierarchical;

  const size_t registered = options.registered_bytes > 0
                                ? options.registered_bytes
                                : std::max(k.fusion_threshold, kMinRegisteredBytes);
  auto region = IpcRegion::Create(group_.comms.group, registered,
                                  topo.group_size > 1 ? kOneShotStagingBytes : 0);
  if (!region.ok()) return region.status().WithContext("registering the IPC buffers");
  group_.region = region.consume();

  NVG_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&group_.control_host),
                               sizeof(DeviceControl), cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(const_cast<DeviceControl*>(group_.control_host), 0, sizeof(DeviceControl));
  NVG_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&group_.control_device),
                                          group_.control_host, 0));
  NVG_CUDA_CHECK(cudaStreamCreateWithFlags(&work_, cudaStreamNonBlocking));
  for (cudaEvent_t* e : {&enter_, &leave_, &sync_})
    NVG_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  NVG_CUDA_CHECK(cudaStreamCreateWithFlags(&group_.cross_stream, cudaStreamNonBlocking));
  NVG_CUDA_CHECK(cudaStreamCreateWithFlags(&group_.h2d_stream, cudaStreamNonBlocking));
  NVG_CUDA_CHECK(cudaStreamCreateWithFlags(&group_.fold_stream, cudaStreamNonBlocking));
  for (int k2 = 0; k2 < 2; ++k2) {
    NVG_CUDA_CHECK(cudaEventCreateWithFlags(&group_.reduce_scattered[k2], cudaEventDisableTiming));
    NVG_CUDA_CHECK(cudaEventCreateWithFlags(&group_.staged[k2], cudaEventDisableTiming));
    NVG_CUDA_CHECK(cudaEventCreateWithFlags(&group_.returned[k2], cudaEventDisableTiming));
  }
  for (CopySlot& s : slots_)
    NVG_CUDA_CHECK(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));

  if (topo.group_count > 1) {
    // A slice is at most ceil(chunk / G) rounded up to 16 bytes; the receive
    // buffer holds group_count parts of it, each rounded up to 16 bytes.
    group_.slice_capacity = (chunk_bytes_ / topo.group_size + 16 + 255) / 256 * 256;
    const size_t recv = group_.slice_capacity + 16 * static_cast<size_t>(topo.group_count);
    for (int k2 = 0; k2 < 2; ++k2) {
      if (group_.cuda_aware_mpi) {
        NVG_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&group_.device_recv[k2]), recv));
      } else {
        NVG_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&group_.host_send[k2]), group_.slice_capacity));
        NVG_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&group_.host_recv[k2]), recv));
        NVG_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&group_.host_result[k2]), group_.slice_capacity));
      }
      NVG_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&group_.row_send[k2]), group_.slice_capacity));
    }
    NVG_RETURN_IF_ERROR_CTX(RowOwners::Gather(comm_, topo, &group_.row_owners), "placing the ranks in their groups");
    StatusOr<std::unique_ptr<CrossExchange>> cross = CrossExchange::Create(group_.comms.cross);
    if (!cross.ok()) return cross.status().WithContext("setting up the cross-group exchange");
    group_.cross = cross.consume();
  }
  return Status::Ok();
}

CudaCommunicator::~CudaCommunicator() {
  (void)cudaSetDevice(group_.device);
  const bool healthy = initialized_ && !aborted_ && dead_member_ < 0 &&
                       group_.control_host != nullptr && group_.control_host->failure == 0;
  // Unhealthy: make every spin of this rank's kernels give up first.
  if (!healthy && group_.control_host != nullptr) group_.control_host->abort = 1;
  group_.cross.reset();  // completes the cross exchanges in flight (they use the buffers below)
  if (work_ != nullptr) (void)cudaStreamSynchronize(work_);
  if (group_.cross_stream != nullptr) (void)cudaStreamSynchronize(group_.cross_stream);
  if (group_.h2d_stream != nullptr) (void)cudaStreamSynchronize(group_.h2d_stream);
  // Every member must be done with every region before any member frees its
  // own: a barrier, unless a peer is known lost (it would never arrive). Then
  // a peer kernel may still store flags into this rank's region: keep it
  // allocated (Note [Peer processes]).
  if (healthy && group_.comms.group != MPI_COMM_NULL && !MpiFinalized())
    (void)MPI_Barrier(group_.comms.group);
  if (!healthy && group_.region != nullptr) group_.region->KeepOwnAllocation();
  group_.region.reset();
  for (CopySlot& s : slots_) {
    if (s.host != nullptr) (void)cudaFreeHost(s.host);
    if (s.device != nullptr) (void)cudaFree(s.device);
    if (s.done != nullptr) (void)cudaEventDestroy(s.done);
  }
  for (int k = 0; k < 2; ++k) {
    for (char* h : {group_.host_send[k], group_.host_recv[k], group_.host_result[k]})
      if (h != nullptr) (void)cudaFreeHost(h);
    if (group_.device_recv[k] != nullptr) (void)cudaFree(group_.device_recv[k]);
    if (group_.row_send[k] != nullptr) (void)cudaFree(group_.row_send[k]);
    for (cudaEvent_t e : {group_.reduce_scattered[k], group_.staged[k], group_.returned[k]})
      if (e != nullptr) (void)cudaEventDestroy(e);
  }
  for (cudaStream_t st : {group_.cross_stream, group_.h2d_stream, group_.fold_stream})
    if (st != nullptr) (void)cudaStreamDestroy(st);
  for (cudaEvent_t e : {enter_, leave_, sync_})
    if (e != nullptr) (void)cudaEventDestroy(e);
  if (work_ != nullptr) (void)cudaStreamDestroy(work_);
  if (group_.control_host != nullptr) (void)cudaFreeHost(const_cast<DeviceControl*>(group_.control_host));
  (void)cudaGetLastError();
  if (comm_ != MPI_COMM_NULL && !MpiFinalized()) (void)MPI_Comm_free(&comm_);
}

std::string CudaCommunicator::MemberName(int p) const {
  const bool known = p >= 0 && p < static_cast<int>(member_ranks_.size());
  return "group rank " + std::to_string(p) + " (rank " +
         std::to_string(known ? member_ranks_[p] : -1) + ", pid " +
         std::to_string(known && p < static_cast<int>(member_pids_.size()) ? member_pids_[p] : -1) +
         ")";
}

int CudaCommunicator::DeadMember() {
  if (dead_member_ >= 0) return dead_member_;
  for (int p = 0; p < static_cast<int>(member_pids_.size()); ++p) {
    if (p == group_.topo.group_rank || !pid_visible_[p]) continue;
    if (!ProcessAlive(member_pids_[p])) {
      dead_member_ = p;
      // this rank's kernels still spinning on the member give up
      if (group_.control_host != nullptr) group_.control_host->abort = 1;
      break;
    }
  }
  return dead_member_;
}

Status CudaCommunicator::Diagnose(Status s) {
  if (s.ok() || s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kInvalidArgument)
    return s;
  const int p = DeadMember();
  if (p < 0) return s;
  return Status::Unavailable(MemberName(p) + " exited while its memory was mapped here (" +
                             s.ToString() + "). This communicator cannot be used any more.");
}

Status CudaCommunicator::CheckHealthy() const {
  const DeviceControl* c = group_.control_host;
  if (dead_member_ >= 0)
    return Status::Unavailable(MemberName(dead_member_) +
                               " exited while its memory was mapped here. This communicator "
                               "cannot be used any more.");
  if (c->failure == kFailureTimeout) {
    const int p = c->failed_peer;
    const bool alive = p >= 0 && p < static_cast<int>(member_pids_.size()) &&
                       ProcessAlive(member_pids_[p]);
    return Status::Unavailable(
        "NV-group barrier timed out: " + MemberName(p) + " did not arrive within " +
        std::to_string(group_.timeout_ns / 1e9) + " s of the call's start (block " +
        std::to_string(c->failed_block) + "); its process " +
        (alive ? "still runs (it hung or does not take part in this call)" : "is gone") +
        ". This communicator cannot be used any more.");
  }
  if (c->failure == kFailureAborted || aborted_ || c->abort)
    return Status::Aborted("the CUDA communicator was aborted");
  return Status::Ok();
}

Status CudaCommunicator::CheckDevicePointer(const void* p, const char* what) {
  for (const void* c : checked_)
    if (c == p) return Status::Ok();
  cudaPointerAttributes attr;
  cudaError_t err = cudaPointerGetAttributes(&attr, p);
  if (err != cudaSuccess) (void)cudaGetLastError();
  const bool ok = err == cudaSuccess &&
                  ((attr.type == cudaMemoryTypeDevice && attr.device == group_.device) ||
                   attr.type == cudaMemoryTypeManaged);
  if (!ok)
    return Status::InvalidArgument(std::string(what) + " pointer is not device memory of cuda:" +
                                   std::to_string(group_.device));
  checked_[next_checked_] = p;
  next_checked_ = (next_checked_ + 1) % kCheckedPointers;
  return Status::Ok();
}

Status CudaCommunicator::EnterWork(cudaStream_t caller) {
  if (caller == work_) return Status::Ok();
  NVG_CUDA_CHECK(cudaEventRecord(enter_, caller));
  NVG_CUDA_CHECK(cudaStreamWaitEvent(work_, enter_, 0));
  return Status::Ok();
}

Status CudaCommunicator::LeaveWork(cudaStream_t caller) {
  if (caller == work_) return Status::Ok();
  NVG_CUDA_CHECK(cudaEventRecord(leave_, work_));
  NVG_CUDA_CHECK(cudaStreamWaitEvent(caller, leave_, 0));
  return Status::Ok();
}

StatusOr<bool> CudaCommunicator::Capturing(cudaStream_t stream) const {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  NVG_CUDA_CHECK(cudaStreamIsCapturing(stream, &st));
  return st != cudaStreamCaptureStatusNone;
}

Status CudaCommunicator::Allreduce(const void* in, void* out, size_t count, DataType dtype,
                                   ReduceOp op, void* stream_arg) {
  NVG_RETURN_IF_ERROR(CheckHealthy());
  if (!SupportsReduction(dtype))
    return Status::InvalidArgument(std::string("allreduce: dtype ") + DataTypeName(dtype) +
                                   " cannot be reduced");
  if (static_cast<int>(op) < 0 || static_cast<int>(op) > static_cast<int>(ReduceOp::kProduct))
    return Status::InvalidArgument("allreduce: unknown reduce op " +
                                   std::to_string(static_cast<int>(op)));
  if (count == 0) return Status::Ok();
  if (in == nullptr || out == nullptr)
    return Status::InvalidArgument("allreduce: null input or output pointer with count " +
                                   std::to_string(count));
  NVG_RETURN_IF_ERROR(CheckDevicePointer(in, "allreduce: input"));
  NVG_RETURN_IF_ERROR(CheckDevicePointer(out, "allreduce: output"));
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  const cudaStream_t caller = StreamOf(stream_arg);
  NVG_RETURN_IF_ERROR(Diagnose(EnterWork(caller)));
  group_.call_started = false;  // the call's first kernel starts its deadline
  Status s = AllreduceOnWork(in, out, count, dtype, op, caller);
  Status left = LeaveWork(caller);  // also after a failure: a capture must be joined
  return Diagnose(s.ok() ? left : s);
}

Status CudaCommunicator::AllreduceOnWork(const void* in, void* out, size_t count, DataType dtype,
                                         ReduceOp op, cudaStream_t caller) {
  const size_t esize = DataTypeSize(dtype);
  const size_t bytes = count * esize;

  if (group_.topo.size == 1) {  // Average over one rank is the identity
    if (in != out) NVG_CUDA_CHECK(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, work_));
    return Status::Ok();
  }
  if (group_.topo.group_count > 1 || force_hierarchy_) {
    auto capturing = Capturing(caller);
    if (!capturing.ok()) return capturing.status();
    if (capturing.value())
      return Status::InvalidArgument(
          "allreduce: the hierarchical path (several NV-groups, or "
          "NVGROUP_ALLREDUCE_ALGORITHM=hierarchical) waits for MPI between its kernels and "
          "cannot be captured in a CUDA graph");
  }

  // Inputs inside the registered buffer are used in place (the engine fuses
  // there at the same offset on every rank); see communicator.h.
  const char* reg = static_cast<const char*>(group_.region->data(group_.topo.group_rank));
  const size_t capacity = group_.region->data_bytes();
  const char* in_c = static_cast<const char*>(in);
  const char* out_c = static_cast<const char*>(out);
  const bool in_reg = in_c >= reg && in_c < reg + capacity;
  const bool out_reg = out_c + bytes > reg && out_c < reg + capacity;
  if (out_reg && out != in)
    return Status::InvalidArgument(
        "allreduce: the output overlaps the registered buffer but is not the input "
        "(only in-place use of the registered buffer is supported)");
  if (in_reg) {
    const size_t offset = in_c - reg;
    if (offset % 16 != 0 || offset + bytes > capacity)
      return Status::InvalidArgument("allreduce: input at offset " + std::to_string(offset) +
                                     " of the registered buffer with " + std::to_string(bytes) +
                                     " bytes is misaligned or exceeds its " +
                                     std::to_string(capacity) + " bytes");
    return AllreducePiece(in, out, count, true, offset, dtype, op);
  }
  // Any other input: pieces of at most the registered capacity (whole 16-byte
  // units per group member so every piece stays aligned).
  const size_t unit = std::max<size_t>(1, 16 / esize) * group_.topo.group_size;
  const size_t piece = std::max(unit, capacity / esize / unit * unit);
  for (size_t first = 0; first < count; first += piece) {
    const size_t n = std::min(piece, count - first);
    NVG_RETURN_IF_ERROR_CTX(
        AllreducePiece(in_c + first * esize, static_cast<char*>(out) + first * esize, n, false, 0,
                       dtype, op),
        "allreduce of elements " + std::to_string(first) + ".." + std::to_string(first + n));
  }
  return Status::Ok();
}

Status CudaCommunicator::AllreducePiece(const void* in, void* out, size_t count,
                                        bool in_registered, size_t offset, DataType dtype,
                                        ReduceOp op) {
  const bool flat = group_.topo.group_count == 1 && !force_hierarchy_;
  if (!flat && !in_registered) {  // the skeleton starts from the registered buffer
    NVG_CUDA_CHECK(cudaMemcpyAsync(registered_buffer(), in, count * DataTypeSize(dtype),
                                   cudaMemcpyDeviceToDevice, work_));
    in = registered_buffer();
    in_registered = true;
  }
  DevicePrimitives prims(&group_, in, in_registered, offset, dtype, op, work_);
  NVG_RETURN_IF_ERROR(RunHierarchicalAllreduce(prims, count, out, chunk_bytes_, force_hierarchy_));
  return Status::Ok();
}

StatusOr<bool> CudaCommunicator::UsePeerCopies(const void* a, size_t a_bytes, const void* b,
                                               size_t b_bytes) {
  const char* reg = static_cast<const char*>(group_.region->data(group_.topo.group_rank));
  auto overlaps = [&](const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    return n > 0 && c < reg + group_.region->data_bytes() && c + n > reg;
  };
  int ok = group_.topo.group_count == 1 && group_.topo.group_size > 1 && !overlaps(a, a_bytes) &&
           !overlaps(b, b_bytes);
  int all_ok = 0;  // the choice is collective: pointers differ per rank
  NVG_MPI_CHECK(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, comm_));
  return all_ok == 1;
}

// Within one NV-group: peer copies through the registered buffers. Otherwise
// host staging through MPI. Correct and simple, not tuned paths.
Status CudaCommunicator::Allgatherv(const void* in, void* out,
                                    const std::vector<size_t>& bytes_per_rank, void* stream_arg) {
  NVG_RETURN_IF_ERROR(CheckHealthy());
  const int size = group_.topo.size;
  if (static_cast<int>(bytes_per_rank.size()) != size)
    return Status::InvalidArgument("allgatherv: " + std::to_string(bytes_per_rank.size()) +
                                   " byte counts given for " + std::to_string(size) + " ranks");
  std::vector<int> counts(size), displs(size);
  size_t total = 0;
  for (int r = 0; r < size; ++r) {
    if (total > static_cast<size_t>(INT_MAX) || bytes_per_rank[r] > static_cast<size_t>(INT_MAX))
      return Status::InvalidArgument("allgatherv: more than 2^31-1 bytes in total");
    counts[r] = static_cast<int>(bytes_per_rank[r]);
    displs[r] = static_cast<int>(total);
    total += bytes_per_rank[r];
  }
  const size_t mine = bytes_per_rank[group_.topo.rank];
  if ((mine > 0 && in == nullptr) || (total > 0 && out == nullptr))
    return Status::InvalidArgument("allgatherv: null input or output pointer");
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  // Runs on work_ (Note [Internal stream]) and returns with work_ drained, so
  // the caller's stream needs no join; host waits cannot be captured.
  auto capturing = Capturing(StreamOf(stream_arg));
  if (!capturing.ok()) return capturing.status();
  if (capturing.value())
    return Status::InvalidArgument("allgatherv/broadcast wait on the host between steps and "
                                   "cannot be captured in a CUDA graph");
  NVG_RETURN_IF_ERROR(EnterWork(StreamOf(stream_arg)));
  cudaStream_t stream = work_;
  StatusOr<bool> peer = total <= registered_capacity()
                            ? UsePeerCopies(in, mine, out, total)
                            : StatusOr<bool>(false);
  if (!peer.ok()) return peer.status();
  if (peer.value()) {
    // One NV-group: every rank puts its part into its registered buffer at its
    // displacement, then copies every member's part out of the member's buffer
    // (peer copies over NVLink). MPI barriers on the group order the steps.
    char* own = static_cast<char*>(registered_buffer());
    const int me = group_.topo.rank;
    if (mine > 0)
      NVG_CUDA_CHECK(cudaMemcpyAsync(own + displs[me], in, mine, cudaMemcpyDeviceToDevice, stream));
    NVG_CUDA_CHECK(cudaStreamSynchronize(stream));
    NVG_MPI_CHECK(MPI_Barrier(group_.comms.group));  // orders: every part is in place
    for (int p = 0; p < group_.topo.group_size; ++p) {
      const int r = member_ranks_[p];
      if (counts[r] > 0)
        NVG_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(out) + displs[r],
                                       group_.region->data(p) + displs[r], counts[r],
                                       cudaMemcpyDefault, stream));
    }
    NVG_CUDA_CHECK(cudaStreamSynchronize(stream));
    NVG_MPI_CHECK(MPI_Barrier(group_.comms.group));  // orders: reads done before reuse
    return Status::Ok();
  }
  std::vector<char> send(mine), recv(total);
  NVG_CUDA_CHECK(cudaStreamSynchronize(stream));  // orders: `in` is produced
  if (mine > 0) NVG_CUDA_CHECK(cudaMemcpy(send.data(), in, mine, cudaMemcpyDeviceToHost));
  NVG_MPI_CHECK(MPI_Allgatherv(send.data(), static_cast<int>(mine), MPI_BYTE, recv.data(),
                               counts.data(), displs.data(), MPI_BYTE, comm_));
  if (total > 0) {
    NVG_CUDA_CHECK(cudaMemcpyAsync(out, recv.data(), total, cudaMemcpyHostToDevice, stream));
    NVG_CUDA_CHECK(cudaStreamSynchronize(stream));  // recv is freed on return
  }
  return Status::Ok();
}

// ReduceScatter on the device. All ranks in one NV-group of several GPUs: the
// group reduce-scatter phase itself with the caller's row split
// (GroupRowReduceScatter: the row reduce-scatter kernel, protocol in
// cc/kernels/reduce_scatter.cu): each GPU folds only its own elements over the
// members' registered buffers and writes them straight into `out`. Several
// groups: the hierarchical reduce-scatter (HierarchicalReduceScatter; the
// skeleton of cc/algorithms/hierarchical_reduce_scatter.h over
// DeviceScatterPrimitives): the same kernel folds, for this group rank, the
// rows of every group's rank of that group rank, and the cross step
// reduce-scatters them among the peers through pinned host memory. Either
// way nothing is allocated per call and every element gets the allreduce's
// bits (the same fold order).
Status CudaCommunicator::ReduceScatter(const void* in, void* out, const std::vector<size_t>& counts,
                                       DataType dtype, ReduceOp op, void* stream_arg) {
  NVG_RETURN_IF_ERROR(CheckHealthy());
  if (!SupportsReduction(dtype))
    return Status::InvalidArgument(std::string("reducescatter: dtype ") + DataTypeName(dtype) +
                                   " cannot be reduced");
  if (static_cast<int>(op) < 0 || static_cast<int>(op) > static_cast<int>(ReduceOp::kProduct))
    return Status::InvalidArgument("reducescatter: unknown reduce op " +
                                   std::to_string(static_cast<int>(op)));
  const int size = group_.topo.size;
  const size_t esize = DataTypeSize(dtype);
  ReduceScatterSplit split;
  NVG_RETURN_IF_ERROR(CheckReduceScatter(in, out, counts, esize, group_.topo.rank, size, registered_buffer(),
                                         registered_capacity(), &split));
  const size_t total = split.total, my_offset = split.offset, mine = split.mine;
  const bool in_registered = split.in_registered;
  if (total == 0) return Status::Ok();
  NVG_RETURN_IF_ERROR(CheckDevicePointer(in, "reducescatter: input"));
  if (mine > 0) NVG_RETURN_IF_ERROR(CheckDevicePointer(out, "reducescatter: output"));
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  const cudaStream_t caller = StreamOf(stream_arg);
  const bool one_group = group_.topo.group_count == 1 && group_.topo.group_size > 1;
  if (!one_group && size > 1) {
    auto capturing = Capturing(caller);
    if (!capturing.ok()) return capturing.status();
    if (capturing.value())
      return Status::InvalidArgument(
          "reducescatter over several NV-groups waits for MPI between its kernels and cannot be "
          "captured in a CUDA graph");
  }
  NVG_RETURN_IF_ERROR(Diagnose(EnterWork(caller)));
  group_.call_started = false;  // the call's first kernel starts its deadline
  Status s;
  if (size == 1) {  // every op over one rank is the identity
    cudaError_t e = cudaMemcpyAsync(out, in, total * esize, cudaMemcpyDeviceToDevice, work_);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      s = Status::Internal(std::string("cudaMemcpyAsync (reducescatter on one rank) failed: ") +
                           cudaGetErrorString(e));
    }
  } else if (one_group) {
    s = GroupRowReduceScatter(in, out, total, my_offset, mine, in_registered, dtype, op);
  } else {
    s = HierarchicalReduceScatter(in, out, counts, in_registered, dtype, op);
  }
  Status left = LeaveWork(caller);  // also after a failure: a capture must be joined
  return Diagnose(s.ok() ? left : s);
}

// One launch of the row reduce-scatter kernel per piece of at most the
// registered capacity (whole 16-byte units, so each piece starts aligned);
// every member launches the same pieces with the same grid.
Status CudaCommunicator::GroupRowReduceScatter(const void* in, void* out, size_t total, size_t my_offset,
                                               size_t mine, bool in_registered, DataType dtype, ReduceOp op) {
  const size_t esize = DataTypeSize(dtype);
  const size_t unit = std::max<size_t>(1, 16 / esize);
  const size_t piece = in_registered ? total : std::max(unit, registered_capacity() / esize / unit * unit);
  const int g = group_.topo.group_size;
  const int cap = std::max(1, std::min(group_.tuning.twoshot_blocks, row_scatter_block_cap_));
  for (size_t p0 = 0; p0 < total; p0 += piece) {
    const size_t n = std::min(piece, total - p0);
    RowScatterLaunch l;
    P2pLaunch& a = l.base;
    for (int p = 0; p < g; ++p) {
      a.peers.flags[p] = group_.region->flags(p);
      a.peers.data[p] = group_.region->data(p);
    }
    a.group_size = g;
    a.group_rank = group_.topo.group_rank;
    a.dtype = dtype;
    a.op = op;
    a.divisor = op == ReduceOp::kAverage ? group_.topo.size : 1;
    a.count = n;
    a.in = in_registered ? nullptr : static_cast<const char*>(in) + p0 * esize;
    // One thread per 16-byte unit of the piece, capped (the same on every member).
    const size_t units = (n * esize + 15) / 16;
    const size_t want = (units + kThreadsPerBlock - 1) / kThreadsPerBlock;
    a.blocks = static_cast<int>(std::max<size_t>(1, std::min<size_t>(want, cap)));
    a.control = group_.control_device;
    a.timeout_ns = group_.timeout_ns;
    a.starts_call = !group_.call_started;
    group_.call_started = true;
    const size_t lo = std::max(p0, my_offset), hi = std::min(p0 + n, my_offset + mine);
    l.num_ranges = 1;
    if (lo < hi) {
      l.ranges[0].lo = lo - p0;
      l.ranges[0].hi = hi - p0;
      l.ranges[0].out = static_cast<char*>(out) + (lo - my_offset) * esize;
    }
    NVG_RETURN_IF_ERROR_CTX(LaunchRowReduceScatter(l, work_),
                            "row reduce-scatter of elements " + std::to_string(p0) + ".." +
                                std::to_string(p0 + n));
  }
  return Status::Ok();
}

// Several groups: pieces of the registered capacity (whole 16-byte units, so
// each piece starts aligned) when G > 1, the whole message with groups of one
// GPU (nothing is read from a peer); a rank's parts of one chunk fit the
// cross step's buffers (slice_capacity bytes; the receive buffer P copies of
// one part). The plan is the same on every rank (same counts, owner table,
// pieces and capacities).
Status CudaCommunicator::HierarchicalReduceScatter(const void* in, void* out, const std::vector<size_t>& counts,
                                                   bool in_registered, DataType dtype, ReduceOp op) {
  const Topology& topo = group_.topo;
  const size_t esize = DataTypeSize(dtype);
  size_t total = 0;
  for (size_t c : counts) total += c;
  const size_t unit = std::max<size_t>(1, 16 / esize);
  const size_t piece = topo.group_size == 1 || in_registered
                           ? total
                           : std::max(unit, registered_capacity() / esize / unit * unit);
  const size_t send_capacity = group_.slice_capacity / esize;
  const size_t recv_capacity = (group_.slice_capacity + 16 * static_cast<size_t>(topo.group_count)) / esize;
  NVG_RETURN_IF_ERROR(group_.row_plan.Build(counts, group_.row_owners, topo.group_rank, topo.group_index, piece,
                                            send_capacity, recv_capacity));
  DeviceScatterPrimitives prims(&group_, in, in_registered, out, dtype, op, row_scatter_block_cap_, work_);
  return RunHierarchicalReduceScatter(prims, group_.row_plan);
}

// Alltoallv on the device, after the same count cross-check as the CPU path.
// All ranks in one NV-group of several GPUs and every rank's send data fits
// its registered buffer: peer copies (PeerAlltoallv). Otherwise staged through
// host memory and MPI_Alltoallv (correct, not tuned); that path touches no
// per-communicator device state (Note [Internal stream]): only the caller's
// stream, which it drains, and MPI on comm_.
Status CudaCommunicator::Alltoallv(const void* in, const std::vector<size_t>& send_bytes, void* out,
                                   const std::vector<size_t>& recv_bytes, void* stream_arg) {
  NVG_RETURN_IF_ERROR(CheckHealthy());
  size_t send_total = 0;
  for (size_t b : send_bytes) send_total += b;
  size_t recv_total = 0;
  for (size_t b : recv_bytes) recv_total += b;
  const char* reg = static_cast<const char*>(registered_buffer());
  const bool peer_copies = group_.topo.group_count == 1 && group_.topo.group_size > 1 &&
                           send_total <= registered_capacity() &&
                           !Overlaps(in, send_total, reg, registered_capacity()) &&
                           !Overlaps(out, recv_total, reg, registered_capacity());
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  cudaStream_t stream = StreamOf(stream_arg);
  // Both paths wait on the host: not capturable. A capture on any rank is the
  // same error on every rank (part of the agreement), not a hang of the others.
  auto capturing = Capturing(stream);
  if (!capturing.ok()) return capturing.status();
  AlltoallvAgreement agreed;
  NVG_RETURN_IF_ERROR(AgreeAlltoallv(comm_, group_.topo.size, in, send_bytes, out, recv_bytes, peer_copies,
                                     capturing.value(), &agreed));
  if (agreed.fast_everywhere) return PeerAlltoallv(in, send_total, out, recv_bytes, agreed.incoming, stream);
  std::vector<int> sc, sd, rc, rd;
  MpiCountsAndDisplacements(send_bytes, &sc, &sd);
  MpiCountsAndDisplacements(recv_bytes, &rc, &rd);
  std::vector<char> send(std::max<size_t>(send_total, 1)), recv(std::max<size_t>(recv_total, 1));
  NVG_CUDA_CHECK(cudaStreamSynchronize(stream));  // orders: `in` is produced
  if (send_total > 0) NVG_CUDA_CHECK(cudaMemcpy(send.data(), in, send_total, cudaMemcpyDeviceToHost));
  NVG_MPI_CHECK(MPI_Alltoallv(send.data(), sc.data(), sd.data(), MPI_BYTE, recv.data(), rc.data(), rd.data(),
                              MPI_BYTE, comm_));
  if (recv_total > 0) {
    NVG_CUDA_CHECK(cudaMemcpyAsync(out, recv.data(), recv_total, cudaMemcpyHostToDevice, stream));
    NVG_CUDA_CHECK(cudaStreamSynchronize(stream));  // recv is freed on return
  }
  return Status::Ok();
}

// One NV-group: every rank copies its whole input into its registered buffer,
// then copies from each member p's registered buffer the bytes p sends it
// (at p's offset `incoming[2 r + 1]`, r = p's rank) into `out` (peer copies
// over NVLink / CUDA IPC). Ordering, on work_ (Note [Internal stream]):
//   * work_ first waits for the caller's stream (`in` is produced) and
//     everything earlier on work_ (a previous call's kernels, which end in a
//     barrier of the members: their loads of our registered buffer are done);
//     the copy-in follows on work_;
//   * cudaStreamSynchronize(work_) then MPI_Barrier(group): every member's
//     copy-in has completed before any member's peer copies are issued;
//   * the peer copies, cudaStreamSynchronize(work_), MPI_Barrier(group): every
//     member's reads of our registered buffer completed before we return, so
//     the next call may write it. work_ is drained, so the caller's stream
//     needs no join (as Allgatherv).
Status CudaCommunicator::PeerAlltoallv(const void* in, size_t send_total, void* out,
                                       const std::vector<size_t>& recv_bytes,
                                       const std::vector<uint64_t>& incoming, cudaStream_t caller) {
  NVG_RETURN_IF_ERROR(EnterWork(caller));
  char* own = static_cast<char*>(registered_buffer());
  if (send_total > 0) NVG_CUDA_CHECK(cudaMemcpyAsync(own, in, send_total, cudaMemcpyDeviceToDevice, work_));
  NVG_CUDA_CHECK(cudaStreamSynchronize(work_));
  NVG_MPI_CHECK(MPI_Barrier(group_.comms.group));  // orders: every member's input is in place
  std::vector<size_t> displ(recv_bytes.size());
  for (size_t r = 1; r < recv_bytes.size(); ++r) displ[r] = displ[r - 1] + recv_bytes[r - 1];
  for (int p = 0; p < group_.topo.group_size; ++p) {
    const int r = member_ranks_[p];
    if (recv_bytes[r] > 0)
      NVG_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(out) + displ[r],
                                     group_.region->data(p) + incoming[2 * r + 1], recv_bytes[r],
                                     cudaMemcpyDefault, work_));
  }
  NVG_CUDA_CHECK(cudaStreamSynchronize(work_));
  NVG_MPI_CHECK(MPI_Barrier(group_.comms.group));  // orders: reads done before the buffers are reused
  return Status::Ok();
}

Status CudaCommunicator::Broadcast(void* buf, size_t bytes, int root, void* stream_arg) {
  NVG_RETURN_IF_ERROR(CheckHealthy());
  if (root < 0 || root >= group_.topo.size)
    return Status::InvalidArgument("broadcast: root " + std::to_string(root) + " outside 0.." +
                                   std::to_string(group_.topo.size - 1));
  if (bytes > static_cast<size_t>(INT_MAX))
    return Status::InvalidArgument("broadcast: more than 2^31-1 bytes");
  if (bytes == 0) return Status::Ok();
  if (buf == nullptr) return Status::InvalidArgument("broadcast: null buffer");
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  // Runs on work_ (Note [Internal stream]) and returns with work_ drained, so
  // the caller's stream needs no join; host waits cannot be captured.
  auto capturing = Capturing(StreamOf(stream_arg));
  if (!capturing.ok()) return capturing.status();
  if (capturing.value())
    return Status::InvalidArgument("allgatherv/broadcast wait on the host between steps and "
                                   "cannot be captured in a CUDA graph");
  NVG_RETURN_IF_ERROR(EnterWork(StreamOf(stream_arg)));
  cudaStream_t stream = work_;
  StatusOr<bool> peer = UsePeerCopies(buf, bytes, nullptr, 0);
  if (!peer.ok()) return peer.status();
  if (peer.value()) {
    // One NV-group: the root stages each piece in its registered buffer, the
    // others copy it from there (peer copies over NVLink); MPI barriers on the
    // group order the steps. Pieces of the registered capacity.
    int root_member = 0;
    for (int p = 0; p < group_.topo.group_size; ++p)
      if (member_ranks_[p] == root) root_member = p;
    char* root_data = group_.region->data(root_member);
    const size_t cap = registered_capacity();
    for (size_t off = 0; off < bytes; off += cap) {
      const size_t n = std::min(cap, bytes - off);
      if (group_.topo.rank == root)
        NVG_CUDA_CHECK(cudaMemcpyAsync(root_data, static_cast<char*>(buf) + off, n,
                                       cudaMemcpyDeviceToDevice, stream));
      NVG_CUDA_CHECK(cudaStreamSynchronize(stream));
      NVG_MPI_CHECK(MPI_Barrier(group_.comms.group));  // orders: the piece is staged
      if (group_.topo.rank != root) {
        NVG_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(buf) + off, root_data, n,
                                       cudaMemcpyDefault, stream));
        NVG_CUDA_CHECK(cudaStreamSynchronize(stream));
      }
      NVG_MPI_CHECK(MPI_Barrier(group_.comms.group));  // orders: reads done before reuse
    }
    return Status::Ok();
  }
  std::vector<char> host(bytes);
  NVG_CUDA_CHECK(cudaStreamSynchronize(stream));  // orders: the root's buffer is produced
  if (group_.topo.rank == root)
    NVG_CUDA_CHECK(cudaMemcpy(host.data(), buf, bytes, cudaMemcpyDeviceToHost));
  NVG_MPI_CHECK(MPI_Bcast(host.data(), static_cast<int>(bytes), MPI_BYTE, root, comm_));
  if (group_.topo.rank != root) {
    NVG_CUDA_CHECK(cudaMemcpyAsync(buf, host.data(), bytes, cudaMemcpyHostToDevice, stream));
    NVG_CUDA_CHECK(cudaStreamSynchronize(stream));  // host is freed on return
  }
  return Status::Ok();
}

Status CudaCommunicator::WaitEvent(void* event, void* stream) {
  if (event == nullptr) return Status::Ok();
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  NVG_CUDA_CHECK(cudaStreamWaitEvent(StreamOf(stream), static_cast<cudaEvent_t>(event), 0));
  return Status::Ok();
}

Status CudaCommunicator::BatchedScaledCopy(const CopySpec* copies, size_t num_copies,
                                           DataType dtype, double scale, void* stream_arg) {
  NVG_RETURN_IF_ERROR(CheckHealthy());
  if (scale != 1.0 && !SupportsReduction(dtype))
    return Status::InvalidArgument(std::string("batched copy: dtype ") + DataTypeName(dtype) +
                                   " cannot be scaled");
  std::vector<DeviceCopySpec> specs;
  specs.reserve(num_copies);
  size_t blocks = 0;
  for (size_t i = 0; i < num_copies; ++i) {
    if (copies[i].count == 0) continue;
    if (copies[i].src == nullptr || copies[i].dst == nullptr)
      return Status::InvalidArgument("batched copy: copy " + std::to_string(i) +
                                     " has a null pointer");
    specs.push_back({copies[i].src, copies[i].dst, copies[i].count, blocks});
    blocks += CopyBlocksFor(copies[i].count);
  }
  if (specs.empty()) return Status::Ok();
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  cudaStream_t stream = StreamOf(stream_arg);
  CopySlot& slot = slots_[next_slot_];
  next_slot_ = (next_slot_ + 1) % kCopySlots;
  NVG_CUDA_CHECK(cudaEventSynchronize(slot.done));  // orders: the slot's last kernel read it
  if (slot.capacity < specs.size()) {
    if (slot.host != nullptr) NVG_CUDA_CHECK(cudaFreeHost(slot.host));
    if (slot.device != nullptr) NVG_CUDA_CHECK(cudaFree(slot.device));
    slot.host = nullptr;
    slot.device = nullptr;
    slot.capacity = 0;
    const size_t cap = std::max<size_t>(256, specs.size() * 2);
    NVG_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&slot.host), cap * sizeof(DeviceCopySpec)));
    NVG_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&slot.device), cap * sizeof(DeviceCopySpec)));
    slot.capacity = cap;
  }
  std::memcpy(slot.host, specs.data(), specs.size() * sizeof(DeviceCopySpec));
  NVG_CUDA_CHECK(cudaMemcpyAsync(slot.device, slot.host, specs.size() * sizeof(DeviceCopySpec),
                                 cudaMemcpyHostToDevice, stream));
  NVG_RETURN_IF_ERROR(LaunchBatchedScaledCopy(slot.device, specs.size(), blocks, dtype, scale, stream));
  NVG_CUDA_CHECK(cudaEventRecord(slot.done, stream));
  return Status::Ok();
}

// The engine's fused bucket (communicator.h; protocol in cc/kernels/batched_copy.cu,
// "Fused buckets"). One rank: no registered buffer, the members' scaled copy
// input -> output is one batched launch (none when every member is in place
// with unit scales). Several ranks: the members' copy into the registered
// buffer stays (the group's kernels read it over CUDA IPC), then the in-place
// allreduce, then one batched launch out of the buffer into the outputs.
Status CudaCommunicator::FusedAllreduce(const FusedMember* members, size_t num_members, size_t bytes,
                                        DataType dtype, ReduceOp op, double prescale, double postscale,
                                        void* stream, const PhaseObserver& observer) {
  NVG_RETURN_IF_ERROR(CheckHealthy());
  if (!SupportsReduction(dtype))
    return Status::InvalidArgument(std::string("allreduce: dtype ") + DataTypeName(dtype) +
                                   " cannot be reduced");
  if (static_cast<int>(op) < 0 || static_cast<int>(op) > static_cast<int>(ReduceOp::kProduct))
    return Status::InvalidArgument("allreduce: unknown reduce op " + std::to_string(static_cast<int>(op)));
  if (bytes > registered_capacity())
    return Status::InvalidArgument("fused allreduce of " + std::to_string(bytes) +
                                   " bytes exceeds the registered buffer (" +
                                   std::to_string(registered_capacity()) + " bytes)");
  if (group_.topo.size == 1)
    return FusedAllreduceOneRank(members, num_members, dtype, prescale, postscale, stream, observer);
  return FusedAllreduceThroughBuffer(members, num_members, bytes, dtype, op, prescale, postscale, stream,
                                     observer);
}

Status CudaCommunicator::Synchronize(void* stream) {
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  NVG_CUDA_CHECK(cudaEventRecord(sync_, StreamOf(stream)));
  return WaitForEvent(sync_);
}

Status CudaCommunicator::WaitForEvent(cudaEvent_t event) {
  // Polls instead of blocking, so that a member's exit is noticed while the
  // kernels wait for it (Note [Peer processes]).
  using Clock = std::chrono::steady_clock;
  auto next_look = Clock::now() + kLivenessCheck;
  Clock::time_point drain_until{};
  for (long polls = 0;; ++polls) {
    const cudaError_t q = cudaEventQuery(event);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) {
      (void)cudaGetLastError();
      return Diagnose(Status::Internal(std::string("waiting for the stream failed: ") +
                                       cudaGetErrorName(q) + ": " + cudaGetErrorString(q)));
    }
    if (polls < 64) continue;  // short waits: spin
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    const auto now = Clock::now();
    if (now < next_look) continue;
    next_look = now + kLivenessCheck;
    if (dead_member_ < 0 && DeadMember() >= 0) drain_until = now + kAbortDrain;
    if (dead_member_ >= 0 && now > drain_until) break;  // kernels aborted; do not wait forever
  }
  return CheckHealthy();
}

Status CudaCommunicator::RecordEvent(void* event, void* stream) {
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  NVG_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), StreamOf(stream)));
  return Status::Ok();
}

Status CudaCommunicator::WaitRecordedEvent(void* event) {
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  return WaitForEvent(static_cast<cudaEvent_t>(event));  // as Synchronize: a member's exit is noticed
}

void CudaCommunicator::Abort() {
  aborted_ = true;
  if (group_.control_host != nullptr) group_.control_host->abort = 1;
}

Status CudaCommunicator::SetTuning(const KernelTuning& t) {
  if (t.oneshot_max_bytes > group_.region->staging_bytes() ||
      t.oneshot_blocks < 1 || t.oneshot_blocks > kMaxBlocks || t.twoshot_blocks < 1 ||
      t.twoshot_blocks > kMaxBlocks)
    return Status::InvalidArgument("kernel tuning out of range: one-shot max " +
                                   std::to_string(t.oneshot_max_bytes) + " bytes (staging " +
                                   std::to_string(group_.region->staging_bytes()) + "), blocks " +
                                   std::to_string(t.oneshot_blocks) + "/" +
                                   std::to_string(t.twoshot_blocks) + " (1.." +
                                   std::to_string(kMaxBlocks) + ")");
  group_.tuning = t;
  return Status::Ok();
}

Status CudaCommunicator::SetTwoShotChunk(size_t chunk_bytes) {
  group_.tuning.twoshot_chunk_bytes = chunk_bytes;
  return Status::Ok();
}

StatusOr<std::unique_ptr<Communicator>> CudaCommunicator::Create(
    MPI_Comm comm, int device_ordinal, const CommunicatorOptions& options,
    const Topology& host_topology) {
  std::unique_ptr<CudaCommunicator> c(new CudaCommunicator());
  Status s = c->Init(comm, device_ordinal, options, host_topology);
  // Agreement: a local failure (e.g. cudaMalloc) fails creation on every rank.
  int ok = s.ok() ? 1 : 0, all_ok = 0;
  if (c->comm_ != MPI_COMM_NULL)
    NVG_MPI_CHECK(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, c->comm_));
  if (!s.ok()) return s.WithContext("creating the CUDA communicator");
  if (all_ok == 0)
    return Status::Internal("creating the CUDA communicator failed on another rank (see its error)");
  c->initialized_ = true;
  return std::unique_ptr<Communicator>(std::move(c));
}

}  // namespace

StatusOr<std::unique_ptr<Communicator>> CreateCudaCommunicator(MPI_Comm comm, int device_ordinal,
                                                               const CommunicatorOptions& options,
                                                               const Topology& host_topology) {
  return CudaCommunicator::Create(comm, device_ordinal, options, host_topology);
}

Status SetCudaKernelTuning(Communicator* comm, size_t oneshot_max_bytes, int oneshot_blocks,
                           int twoshot_blocks) {
  auto* cuda = dynamic_cast<CudaCommunicator*>(comm);
  if (cuda == nullptr) return Status::InvalidArgument("not a CUDA communicator");
  return cuda->SetTuning({oneshot_max_bytes, oneshot_blocks, twoshot_blocks,
                         cuda->tuning().twoshot_chunk_bytes});
}

Status SetCudaTwoShotChunk(Communicator* comm, size_t chunk_bytes) {
  auto* cuda = dynamic_cast<CudaCommunicator*>(comm);
  if (cuda == nullptr) return Status::InvalidArgument("not a CUDA communicator");
  return cuda->SetTwoShotChunk(chunk_bytes);
}

}  // namespace nvgroup
