// CUDA IPC registration: every member of an NV-group allocates one region and
// maps every other member's region, so kernels load peers' memory directly.
//
// How it works. Each rank cudaMallocs one region, laid out as
//   | BarrierFlags | data (registered buffer) | staging half 0 | staging half 1 |
// zeroes the flags, waits for the memset, takes cudaIpcGetMemHandle of the
// region and MPI_Allgathers the 64-byte handles over the group communicator.
// Every rank then opens its peers' handles (cudaIpcOpenMemHandle with lazy
// peer access) once; the mappings stay cached for the region's lifetime and are
// closed in the destructor. The allgather also orders the flag memset before
// any peer kernel can write the flags (peers launch only after it returns).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <memory>

#include "kernels/kernels.h"
#include "nvgroup/status.h"

namespace nvgroup {

class IpcRegion {
 public:
  // Collective over `group_comm` (rank == group_rank). The device must be
  // current. `data_bytes`/`staging_bytes` are rounded up to 256 bytes.
  static StatusOr<std::unique_ptr<IpcRegion>> Create(MPI_Comm group_comm, size_t data_bytes,
                                                     size_t staging_bytes);
  IpcRegion(const IpcRegion&) = delete;
  IpcRegion& operator=(const IpcRegion&) = delete;
  // Closes the peers' mappings and frees this rank's region. The owner must
  // make sure no kernel still uses them (see CudaCommunicator's destructor).
  ~IpcRegion();
  // The destructor then leaves this rank's own allocation alone (a peer kernel
  // may still write into it after a failure); the process exit frees it.
  void KeepOwnAllocation() { keep_own_ = true; }

  size_t data_bytes() const { return data_bytes_; }
  size_t staging_bytes() const { return staging_bytes_; }
  // Member p's pieces as mapped into this process (own for p == group_rank).
  BarrierFlags* flags(int p) const;
  char* data(int p) const;
  char* staging(int p, int half) const;

 private:
  IpcRegion() = default;
  static size_t FlagsBytes();

  int group_size_ = 1;
  int group_rank_ = 0;
  size_t data_bytes_ = 0;
  size_t staging_bytes_ = 0;
  char* base_[kMaxGroupSize] = {};  // region bases; own one allocated, others opened
  bool keep_own_ = false;
};

}  // namespace nvgroup
