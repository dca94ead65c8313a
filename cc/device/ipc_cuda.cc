#include "device/ipc.h"

#include <string>

#include "common/cuda_checks.h"

namespace nvgroup {
namespace {

constexpr size_t kRegionAlign = 256;  // cudaMalloc's alignment; keeps every piece 16-byte aligned

size_t RoundUp(size_t n) { return (n + kRegionAlign - 1) / kRegionAlign * kRegionAlign; }

}  // namespace

size_t IpcRegion::FlagsBytes() { return RoundUp(sizeof(BarrierFlags)); }

StatusOr<std::unique_ptr<IpcRegion>> IpcRegion::Create(MPI_Comm group_comm, size_t data_bytes,
                                                       size_t staging_bytes) {
  std::unique_ptr<IpcRegion> r(new IpcRegion());
  NVG_MPI_CHECK(MPI_Comm_size(group_comm, &r->group_size_));
  NVG_MPI_CHECK(MPI_Comm_rank(group_comm, &r->group_rank_));
  if (r->group_size_ > kMaxGroupSize)
    return Status::InvalidArgument("NV-group of " + std::to_string(r->group_size_) +
                                   " GPUs exceeds the kernels' maximum of " + std::to_string(kMaxGroupSize));
  r->data_bytes_ = RoundUp(data_bytes);
  r->staging_bytes_ = RoundUp(staging_bytes);
  const size_t total = FlagsBytes() + r->data_bytes_ + 2 * r->staging_bytes_;

  char* own = nullptr;
  const cudaError_t malloc_error = cudaMalloc(reinterpret_cast<void**>(&own), total);
  if (malloc_error != cudaSuccess) (void)cudaGetLastError();
  else r->base_[r->group_rank_] = own;  // freed by the destructor from here on
  // Every member learns whether every member got its region, so that a rank
  // whose GPU memory is taken fails here with the others instead of leaving
  // them blocked in the handle exchange below.
  int got = malloc_error == cudaSuccess ? 1 : 0, all_got = 0;
  NVG_MPI_CHECK(MPI_Allreduce(&got, &all_got, 1, MPI_INT, MPI_MIN, group_comm));
  if (malloc_error != cudaSuccess)
    return Status::Unavailable("cudaMalloc of " + std::to_string(total >> 20) +
                               " MiB of GPU memory for "
                               "nvgroup_tf's registered buffers failed: " +
                               cudaGetErrorString(malloc_error) +
                               ". Initialize nvgroup_tf before TensorFlow reserves the GPU's memory, turn on "
                               "memory growth, or lower NVGROUP_FUSION_THRESHOLD (README 'GPU memory')");
  if (all_got == 0)
    return Status::Unavailable("another member of this rank's NV-group could not allocate its " +
                               std::to_string(total >> 20) + " MiB of registered GPU memory");
  NVG_CUDA_CHECK(cudaMemset(own, 0, FlagsBytes()));
  NVG_CUDA_CHECK(cudaDeviceSynchronize());  // flags are zero before any peer can see them

  cudaIpcMemHandle_t mine;
  NVG_CUDA_CHECK(cudaIpcGetMemHandle(&mine, own));
  cudaIpcMemHandle_t all[kMaxGroupSize];
  NVG_MPI_CHECK(MPI_Allgather(&mine, sizeof(mine), MPI_BYTE, all, sizeof(mine), MPI_BYTE, group_comm));
  for (int p = 0; p < r->group_size_; ++p) {
    if (p == r->group_rank_) continue;
    void* mapped = nullptr;
    cudaError_t err = cudaIpcOpenMemHandle(&mapped, all[p], cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::Internal(std::string("cudaIpcOpenMemHandle of group rank ") + std::to_string(p) +
                              "'s buffer failed: " + cudaGetErrorString(err) +
                              " (are both GPUs visible to this process and peer-capable?)");
    }
    r->base_[p] = static_cast<char*>(mapped);
  }
  return r;
}

IpcRegion::~IpcRegion() {
  // Destructors cannot return a Status: errors here (a peer already gone)
  // leave nothing to clean up beyond what the driver frees at exit.
  for (int p = 0; p < group_size_; ++p) {
    if (base_[p] == nullptr) continue;
    if (p == group_rank_) {
      if (!keep_own_) (void)cudaFree(base_[p]);
    } else {
      (void)cudaIpcCloseMemHandle(base_[p]);
    }
  }
  (void)cudaGetLastError();
}

BarrierFlags* IpcRegion::flags(int p) const { return reinterpret_cast<BarrierFlags*>(base_[p]); }
char* IpcRegion::data(int p) const { return base_[p] + FlagsBytes(); }
char* IpcRegion::staging(int p, int half) const {
  return base_[p] + FlagsBytes() + data_bytes_ + half * staging_bytes_;
}

}  // namespace nvgroup
