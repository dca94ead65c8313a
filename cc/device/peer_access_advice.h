// The one-line warning a node prints when its local GPUs cannot form an
// NV-group (no mutual peer access), with the likely cause and its fix.
// Host-only (no CUDA): device_topology_cuda.cc gathers the facts, this words them.
#pragma once

#include <string>
#include <vector>

namespace nvgroup {

// `visible_devices[i]`: cudaGetDeviceCount() of local rank i; `bus_ids[i]`: the
// PCI bus id of its GPU; `cuda_visible_devices`: this rank's
// CUDA_VISIBLE_DEVICES (null when unset). When every local rank sees exactly
// one GPU and the GPUs differ, the launcher restricted visibility (jsrun -g1
// resource sets, srun --gpus-per-task/--gpu-bind, a per-rank
// CUDA_VISIBLE_DEVICES): the message says so and how to launch instead.
// When all local ranks share one GPU (one bus id), it says so. Otherwise it is
// the generic "lack mutual peer access" warning.
std::string NoPeerAccessWarning(int node_index, const std::vector<int>& visible_devices,
                                const std::vector<std::string>& bus_ids, const char* cuda_visible_devices);

}  // namespace nvgroup
