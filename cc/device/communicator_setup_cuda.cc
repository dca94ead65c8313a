// CudaCommunicator (cuda_communicator_impl.h): creation and teardown -- the
// GPU topology, the members' pids, the grid caps, the launch defaults, the
// IPC registration of the registered buffers, the control words, the streams
// and events, the cross-step buffers -- and the stream plumbing every call
// goes through (Note [Internal stream]), the stream helpers (WaitEvent,
// RecordEvent, BatchedScaledCopy) and the tuning overrides.
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
#include <cuda_runtime.h>
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common/checks.h"
#include "common/cuda_checks.h"
#include "common/collective_args.h"
#include "common/env.h"
#include "device/cuda_communicator_impl.h"
#include "device/device_topology.h"
#include "kernels/kernels.h"
#include "kernels/reduce_scatter.h"

#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>
#endif

namespace nvgroup {
namespace {

// Staging half of the one-shot kernel, bytes: caps oneshot_max_bytes.
// TensorRT-LLM's custom allreduce uses one-shot up to 16 MB on <= 2 GPUs, so
// the measured threshold cannot usefully exceed that.
constexpr size_t kOneShotStagingBytes = 16u << 20;
// Launch defaults, measured on 2x H200 with allreduce_perf --sweep (see
// docs/PERFORMANCE.md "Tuning"): for 2 GPUs one-shot is faster than two-shot
// up to 8 MiB (its remote traffic, (G-1) S, equals two-shot's 2 (G-1)/G S
// when G = 2, and it has one barrier instead of three); a grid cap of 128
// blocks was the fastest for both kernels from 1 MiB up (two-shot with its
// 4-unit batches: 192 and 256 blocks were 5-20% slower at 64-256 MiB; since the
// two-shot kernel runs one block per SM, 132 is the most that is resident). For larger
// groups one-shot moves (G-1) S against 2 (G-1)/G S, so it pays only where
// latency dominates: 512 KiB, between the one-shot limits of PyTorch's
// intra-node allreduce (256 KB) and vLLM's custom allreduce (512 KB-1 MB) --
// not measured here (2 GPUs only).
constexpr size_t kDefaultOneShotMaxBytesTwoGpus = 8u << 20;
constexpr size_t kDefaultOneShotMaxBytesLarger = 512u << 10;
constexpr int kDefaultOneShotBlocks = 128;
constexpr int kDefaultTwoShotBlocks = 128;
// Two-shot on user buffers: pipeline chunk per slice (Note [Two-shot
// schedule] in p2p_allreduce.cuh), measured with allreduce_perf --pipeline_sweep
// (docs/PERFORMANCE.md "Pipelined two-shot").
constexpr size_t kDefaultTwoShotChunkBytes = 8u << 20;

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

}  // namespace

Status CudaCommunicator::Init(MPI_Comm comm, int device_ordinal, const Knobs& k,
                              const CommunicatorOptions& options, const Topology& host_topology) {
  NVG_MPI_CHECK(MPI_Comm_dup(comm, &comm_));

  int ranks_on_device = 1;
  NVG_RETURN_IF_ERROR_CTX(ResolveDeviceTopology(comm_, device_ordinal, k.group_size, k.one_gpu_group,
                                                &group_.topo, &group_.comms, &group_.device,
                                                &ranks_on_device),
                          "resolving the GPU topology");
  if (group_.topo.rank != host_topology.rank || group_.topo.size != host_topology.size ||
      group_.topo.local_rank != host_topology.local_rank)
    return Status::Internal("CUDA topology disagrees with the host topology passed in (rank " +
                            std::to_string(host_topology.rank) + "/" + std::to_string(host_topology.size) +
                            " vs " + std::to_string(group_.topo.rank) + "/" +
                            std::to_string(group_.topo.size) + ")");
  const Topology& topo = group_.topo;
  member_ranks_.resize(topo.group_size);
  NVG_MPI_CHECK(MPI_Allgather(&topo.rank, 1, MPI_INT, member_ranks_.data(), 1, MPI_INT, group_.comms.group));
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

  group_.tuning.oneshot_max_bytes = k.oneshot_max_bytes > 0 ? k.oneshot_max_bytes
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
  group_.timeout_ns = static_cast<uint64_t>(k.peer_timeout_s * 1e9);
  // Every rank takes the same cross-step path (device or host fold): the
  // ranks agree, CUDA-aware only if all of them are.
  int cuda_aware = MpiIsCudaAware() ? 1 : 0, all_cuda_aware = 0;
  NVG_MPI_CHECK(MPI_Allreduce(&cuda_aware, &all_cuda_aware, 1, MPI_INT, MPI_MIN, comm_));
  group_.cuda_aware_mpi = all_cuda_aware == 1;
  chunking_.max_bytes = k.pipeline_chunk;
  chunking_.min_bytes = k.pipeline_min_chunk;
  force_hierarchy_ = k.algorithm == AllreduceAlgorithm::kHierarchical;

  const size_t registered = RegisteredBytes(options, k);
  auto region = IpcRegion::Create(group_.comms.group, registered,
                                  topo.group_size > 1 ? kOneShotStagingBytes : 0);
  if (!region.ok()) return region.status().WithContext("registering the IPC buffers");
  group_.region = region.consume();

  NVG_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&group_.control_host), sizeof(DeviceControl),
                               cudaHostAllocMapped | cudaHostAllocPortable));
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
  for (CopySlot& s : slots_) NVG_CUDA_CHECK(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));

  if (topo.group_count > 1) {
    CrossExchange::Options cross_options;
    cross_options.allgather_max_bytes = k.cross_allgather_max_bytes;
    cross_options.host_memory = !group_.cuda_aware_mpi;  // host-staged: pinned host buffers
    StatusOr<std::unique_ptr<CrossExchange>> cross = CrossExchange::Create(group_.comms.cross, cross_options);
    if (!cross.ok()) return cross.status().WithContext("setting up the cross-group exchange");
    group_.cross = cross.consume();
    // A slice is at most ceil(chunk / G) rounded up to 16 bytes; the receive
    // buffer holds what either variant of the exchange receives for it
    // (CrossExchange::MaxRecvBytes: group_count parts, or group_count slices
    // when it is small enough for the allgather).
    group_.slice_capacity = (chunking_.max_bytes / topo.group_size + 16 + 255) / 256 * 256;
    const size_t recv = group_.cross->MaxRecvBytes(group_.slice_capacity);
    group_.recv_capacity = recv;
    for (int k2 = 0; k2 < 2; ++k2) {
      if (group_.cuda_aware_mpi) {
        NVG_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&group_.device_recv[k2]), recv));
      } else {
        NVG_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&group_.host_send[k2]),
                                      group_.slice_capacity));
        NVG_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&group_.host_recv[k2]), recv));
        NVG_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&group_.host_result[k2]),
                                      group_.slice_capacity));
      }
      NVG_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&group_.row_send[k2]), group_.slice_capacity));
    }
    NVG_RETURN_IF_ERROR_CTX(RowOwners::Gather(comm_, topo, &group_.row_owners),
                            "placing the ranks in their groups");
  }
  return Status::Ok();
}

CudaCommunicator::~CudaCommunicator() {
  (void)cudaSetDevice(group_.device);
  const bool healthy = initialized_ && !aborted_ && dead_member_ < 0 && group_.control_host != nullptr &&
                       group_.control_host->failure == 0;
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

Status CudaCommunicator::WaitEvent(void* event, void* stream) {
  if (event == nullptr) return Status::Ok();
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  NVG_CUDA_CHECK(cudaStreamWaitEvent(StreamOf(stream), static_cast<cudaEvent_t>(event), 0));
  return Status::Ok();
}

Status CudaCommunicator::BatchedScaledCopy(const CopySpec* copies, size_t num_copies, DataType dtype,
                                           double scale, void* stream_arg) {
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
      return Status::InvalidArgument("batched copy: copy " + std::to_string(i) + " has a null pointer");
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

Status CudaCommunicator::RecordEvent(void* event, void* stream) {
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  NVG_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), StreamOf(stream)));
  return Status::Ok();
}

Status CudaCommunicator::DelayStream(double microseconds, void* stream) {
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  return LaunchStreamDelay(microseconds, StreamOf(stream));
}

Status CudaCommunicator::SetTuning(const KernelTuning& t) {
  if (t.oneshot_max_bytes > group_.region->staging_bytes() || t.oneshot_blocks < 1 ||
      t.oneshot_blocks > kMaxBlocks || t.twoshot_blocks < 1 || t.twoshot_blocks > kMaxBlocks)
    return Status::InvalidArgument("kernel tuning out of range: one-shot max " +
                                   std::to_string(t.oneshot_max_bytes) + " bytes (staging " +
                                   std::to_string(group_.region->staging_bytes()) + "), blocks " +
                                   std::to_string(t.oneshot_blocks) + "/" + std::to_string(t.twoshot_blocks) +
                                   " (1.." + std::to_string(kMaxBlocks) + ")");
  group_.tuning = t;
  return Status::Ok();
}

Status CudaCommunicator::SetTwoShotChunk(size_t chunk_bytes) {
  group_.tuning.twoshot_chunk_bytes = chunk_bytes;
  return Status::Ok();
}

StatusOr<std::unique_ptr<Communicator>> CudaCommunicator::Create(MPI_Comm comm, int device_ordinal,
                                                                 const Knobs& knobs,
                                                                 const CommunicatorOptions& options,
                                                                 const Topology& host_topology) {
  std::unique_ptr<CudaCommunicator> c(new CudaCommunicator());
  Status s = c->Init(comm, device_ordinal, knobs, options, host_topology);
  // Agreement: a local failure (e.g. cudaMalloc) fails creation on every rank.
  int ok = s.ok() ? 1 : 0, all_ok = 0;
  if (c->comm_ != MPI_COMM_NULL) NVG_MPI_CHECK(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, c->comm_));
  if (!s.ok()) return s.WithContext("creating the CUDA communicator");
  if (all_ok == 0)
    return Status::Internal("creating the CUDA communicator failed on another rank (see its error)");
  c->initialized_ = true;
  return std::unique_ptr<Communicator>(std::move(c));
}

StatusOr<std::unique_ptr<Communicator>> CreateCudaCommunicator(MPI_Comm comm, int device_ordinal,
                                                               const Knobs& knobs,
                                                               const CommunicatorOptions& options,
                                                               const Topology& host_topology) {
  return CudaCommunicator::Create(comm, device_ordinal, knobs, options, host_topology);
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
