#include "device/device_topology.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/cuda_checks.h"
#include "device/peer_access_advice.h"
#include "kernels/kernels.h"

namespace nvgroup {
namespace {

constexpr int kBusIdChars = 32;  // "0000:00:00.0" plus room, NUL-padded

struct LocalGpu {
  int ordinal;
  int visible_devices;  // cudaGetDeviceCount() of that rank (for the warning)
  char bus_id[kBusIdChars];
};

// Largest divisor of n that is <= kMaxGroupSize.
int LargestGroupDividing(int n) {
  for (int g = kMaxGroupSize; g > 1; --g)
    if (n % g == 0) return g;
  return 1;
}

}  // namespace

Status ResolveDeviceTopology(MPI_Comm comm, int device_ordinal, int requested_group_size, bool one_gpu_group,
                             Topology* topo, TopologyComms* comms, int* device_out, int* ranks_on_device) {
  NVG_RETURN_IF_ERROR_CTX(SplitNodes(comm, topo, comms), "splitting ranks into nodes");

  int device_count = 0;
  NVG_CUDA_CHECK(cudaGetDeviceCount(&device_count));
  const int device = device_ordinal >= 0 ? device_ordinal : topo->local_rank % device_count;
  if (device >= device_count)
    return Status::InvalidArgument("device cuda:" + std::to_string(device) + " requested but only " +
                                   std::to_string(device_count) + " CUDA devices are visible");
  NVG_CUDA_CHECK(cudaSetDevice(device));
  *device_out = device;

  // Every local rank's GPU, then every local rank's row of the access matrix.
  const int n = topo->local_size;
  LocalGpu mine{};
  mine.ordinal = device;
  mine.visible_devices = device_count;
  NVG_CUDA_CHECK(cudaDeviceGetPCIBusId(mine.bus_id, kBusIdChars, device));
  std::vector<LocalGpu> gpus(n);
  NVG_MPI_CHECK(MPI_Allgather(&mine, sizeof(LocalGpu), MPI_BYTE, gpus.data(), sizeof(LocalGpu), MPI_BYTE,
                              comms->local));
  std::vector<int> row(n, 0), matrix(static_cast<size_t>(n) * n, 0);
  for (int j = 0; j < n; ++j) {
    if (j == topo->local_rank) {
      row[j] = 1;
    } else if (std::strncmp(gpus[j].bus_id, mine.bus_id, kBusIdChars) == 0) {
      row[j] = one_gpu_group ? 1 : 0;  // one-GPU group mode: the same GPU counts as reachable
    } else {
      NVG_CUDA_CHECK(cudaDeviceCanAccessPeer(&row[j], device, gpus[j].ordinal));
    }
  }
  NVG_MPI_CHECK(MPI_Allgather(row.data(), n, MPI_INT, matrix.data(), n, MPI_INT, comms->local));
  auto blocks_connected = [&](int g) {
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j)
        if (i / g == j / g && !(matrix[i * n + j] && matrix[j * n + i])) return false;
    return true;
  };

  // This rank's view: [requested G or detected G, "requested G lacks access"].
  int g = requested_group_size;
  int requested_bad = 0;
  if (g > 0) {
    if (g > kMaxGroupSize) requested_bad = 2;
    else if (n % g == 0 && !blocks_connected(g)) requested_bad = 1;
  } else {
    g = LargestGroupDividing(n);
    if (!blocks_connected(g)) {
      if (topo->local_rank == 0) {
        std::vector<int> visible(n);
        std::vector<std::string> bus(n);
        for (int i = 0; i < n; ++i) {
          visible[i] = gpus[i].visible_devices;
          bus[i] = std::string(gpus[i].bus_id, strnlen(gpus[i].bus_id, kBusIdChars));
        }
        std::fprintf(stderr, "%s\n",
                     NoPeerAccessWarning(topo->node_index, visible, bus, std::getenv("CUDA_VISIBLE_DEVICES"))
                         .c_str());
      }
      g = 1;
    }
  }
  // One agreement round: smallest detected G, worst verdict on the requested G.
  // The verdict travels negated so one MPI_MIN does both.
  int view[2] = {requested_group_size > 0 ? 0 : g, -requested_bad};
  int agreed[2];
  NVG_MPI_CHECK(MPI_Allreduce(view, agreed, 2, MPI_INT, MPI_MIN, comm));
  const int worst_bad = -agreed[1];
  if (worst_bad == 2)
    return Status::InvalidArgument("NVGROUP_GROUP_SIZE=" + std::to_string(requested_group_size) +
                                   " exceeds the largest NV-group the kernels support (" +
                                   std::to_string(kMaxGroupSize) + ")");
  if (worst_bad == 1)
    return Status::InvalidArgument(
        "NVGROUP_GROUP_SIZE=" + std::to_string(requested_group_size) +
        ": some group's GPUs lack mutual peer access (cudaDeviceCanAccessPeer); choose a size "
        "whose groups are NVLink-connected, or leave it unset to detect");
  if (requested_group_size <= 0) g = agreed[0];  // the smallest detected G holds everywhere
  NVG_RETURN_IF_ERROR(SplitGroups(comm, requested_group_size > 0 ? requested_group_size : g,
                                  requested_group_size > 0 ? "NVGROUP_GROUP_SIZE" : "detected NV-group size",
                                  topo, comms));
  // Local ranks that drive the same GPU (this rank included), whatever their
  // group: their kernels share the GPU's multiprocessors at the same time (the
  // members of one group in the same launch; two groups on one GPU, e.g. 2x2
  // in one-GPU group mode, each in its own), so every one of their grids must
  // fit beside the others for the spinning barriers to complete.
  *ranks_on_device = 0;
  for (const LocalGpu& m : gpus)
    if (std::strncmp(m.bus_id, mine.bus_id, kBusIdChars) == 0) ++*ranks_on_device;
  return Status::Ok();
}

}  // namespace nvgroup
