#include "device/peer_access_advice.h"

#include <set>

namespace nvgroup {

std::string NoPeerAccessWarning(int node_index, const std::vector<int>& visible_devices,
                                const std::vector<std::string>& bus_ids, const char* cuda_visible_devices) {
  const int n = static_cast<int>(visible_devices.size());
  bool each_sees_one = n > 1;
  for (int v : visible_devices) each_sees_one = each_sees_one && v == 1;
  const bool distinct = std::set<std::string>(bus_ids.begin(), bus_ids.end()).size() == bus_ids.size();
  const std::string head = "nvgroup WARNING: node " + std::to_string(node_index) + ": ";
  if (each_sees_one && distinct)
    return head + "each of the " + std::to_string(n) +
           " local ranks sees only its own GPU (CUDA_VISIBLE_DEVICES=" +
           (cuda_visible_devices != nullptr ? std::string(cuda_visible_devices) : "<unset>") +
           " here), so no NV-group can form and all reduction crosses MPI through host memory "
           "(slow). Launch so every rank sees all GPUs of its node: nvgrouprun does (jsrun: one "
           "resource set per node, e.g. jsrun -r1 -a6 -g6 -c42 -b packed:7; srun: no "
           "--gpus-per-task/--gpu-bind, or --gpu-bind=none; mpirun: do not set "
           "CUDA_VISIBLE_DEVICES per rank); the GPU is then picked by local rank.";
  const bool one_gpu = n > 1 && std::set<std::string>(bus_ids.begin(), bus_ids.end()).size() == 1;
  if (one_gpu)
    return head + "the " + std::to_string(n) + " local ranks share one GPU (" + bus_ids[0] +
           "), so each rank is its own group and all reduction crosses MPI through host memory "
           "(slow). Run one rank per GPU; for tests, NVGROUP_ONE_GPU_GROUP=1 (under MPS) makes "
           "the ranks of one GPU one NV-group.";
  return head + "the " + std::to_string(n) +
         " local GPUs lack mutual peer access (NVLink); using host-staged MPI between "
         "single-GPU groups (slow)";
}

}  // namespace nvgroup
