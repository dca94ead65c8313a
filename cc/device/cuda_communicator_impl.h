// CudaCommunicator, the Communicator behind CreateCudaCommunicator
// (cuda_communicator.h): its state and its members, declared once for the
// files that implement it, one concept each:
//   communicator_setup_cuda.cc       creation (topology, IPC registration,
//                                    streams, buffers), teardown, tuning,
//                                    the internal stream (Note [Internal
//                                    stream]) and the stream helpers;
//   communicator_liveness_cuda.cc    the members' processes and the host
//                                    waits that watch them (Note [Peer
//                                    processes]);
//   communicator_reductions_cuda.cc  Allreduce, FusedAllreduce,
//                                    ReduceScatter (the skeletons over
//                                    the device primitives);
//   communicator_transfers_cuda.cc   Allgatherv, Broadcast, Alltoallv
//                                    (peer copies or host staging).
// See cuda_communicator.h for the overview and cc/kernels/p2p_allreduce.cuh
// for the NVLink protocol. Included by those files only (CUDA build).
#pragma once

#include <cuda_runtime.h>
#include <mpi.h>
#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "device/cuda_communicator.h"
#include "device/device_primitives.h"
#include "nvgroup/communicator.h"
#include "nvgroup/status.h"

namespace nvgroup {

// BatchedScaledCopy descriptor slots in flight (pinned host + device each).
// A fused bucket takes two (copy in, copy out): 16 keep eight buckets in
// flight before the host waits for the oldest slot's kernel.
constexpr int kCopySlots = 16;

class CudaCommunicator final : public Communicator {
 public:
  static StatusOr<std::unique_ptr<Communicator>> Create(MPI_Comm comm, int device_ordinal, const Knobs& knobs,
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
  Status BatchedScaledCopy(const CopySpec* copies, size_t num_copies, DataType dtype, double scale,
                           void* stream) override;
  Status FusedAllreduce(const FusedMember* members, size_t num_members, size_t bytes, DataType dtype,
                        ReduceOp op, double prescale, double postscale, void* stream,
                        const PhaseObserver& observer) override;
  Status Synchronize(void* stream) override;
  // Synchronize and WaitRecordedEvent: polls `event`, watching the members'
  // processes (Note [Peer processes]).
  Status WaitForEvent(cudaEvent_t event);
  Status RecordEvent(void* event, void* stream) override;
  Status WaitRecordedEvent(void* event) override;
  Status DelayStream(double microseconds, void* stream) override;
  void Abort() override;

  Status SetTuning(const KernelTuning& tuning);
  const KernelTuning& tuning() const { return group_.tuning; }
  Status SetTwoShotChunk(size_t chunk_bytes);

 private:
  CudaCommunicator() = default;
  Status Init(MPI_Comm comm, int device_ordinal, const Knobs& knobs, const CommunicatorOptions& options,
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
  Status AllreducePiece(const void* in, void* out, size_t count, bool in_registered, size_t offset,
                        DataType dtype, ReduceOp op);
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
  PipelineChunking chunking_;  // the hierarchical allreduce's chunks (Note [Chunk size])
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

}  // namespace nvgroup
