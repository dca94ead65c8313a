// Every NVGROUP_* knob in one table, parsed once (at Init) with validation:
// a malformed value is an error naming the variable, never a silent default.
// Add a knob here, nowhere else. The README's knob table mirrors this one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "nvgroup/status.h"

namespace nvgroup {

enum class AllreduceAlgorithm { kAuto, kMpi, kHierarchical };

struct Knobs {
  // Largest fused buffer, bytes; 0 disables fusion. Default 64 MiB: see the
  // Note [Fusion threshold] in cc/engine/fusion.h for the measurement behind it.
  size_t fusion_threshold = 64u << 20;
  // How long the background loop waits for more requests before negotiating
  // when it has nothing ready, milliseconds (it wakes at once on an enqueue).
  double cycle_time_ms = 1.0;
  // NV-group size override (0 = detect). Must divide the ranks per node.
  int group_size = 0;
  // Chunk of the pipelined hierarchical allreduce, bytes.
  size_t pipeline_chunk = 4u << 20;
  // "auto" (hierarchical when it applies), "mpi" (flat MPI reference path),
  // "hierarchical" (force the NV-group skeleton even with one group).
  AllreduceAlgorithm algorithm = AllreduceAlgorithm::kAuto;
  // CUDA: messages up to this size use the one-shot kernel, above it two-shot.
  // 0 = the measured default of cc/kernels (see docs/PERFORMANCE.md).
  size_t oneshot_max_bytes = 0;
  // A collective or barrier that cannot progress for this long because a peer
  // is gone fails with kUnavailable naming the peer, seconds.
  double peer_timeout_s = 30.0;
  // Rank 0 warns about ranks missing tensors after this long, seconds (0 = off).
  double stall_warning_s = 60.0;
  // Stalled requests fail with kDeadlineExceeded after this long (0 = never).
  double stall_shutdown_s = 0.0;
  // Response cache entries (0 disables the cache).
  int cache_capacity = 1024;
  // Chrome-trace timeline file written by rank 0 ("" = off).
  std::string timeline_path;
  // trace, debug, info, warning, error (default warning).
  int log_level = 3;
  // CUDA, tests only: ranks on one GPU may form an NV-group (under MPS), so the
  // group kernels can be checked on a one-GPU machine (cc/device/device_topology.h).
  bool one_gpu_group = false;
  // NVGROUP_BUCKET_CAP_MB as set ("" = unset). Parsed and used by the Python
  // side (nvgroup_tf/_keras_impl/reduce.py: which gradients form one grouped
  // allreduce); the engine only makes the ranks agree on it (AgreedKnobs).
  std::string bucket_cap_mb_text;
};

// The knobs every rank must share, as (variable, value) pairs in a fixed order:
// they decide which requests share a collective (fusion threshold, cache
// capacity, the Python bucket cap) and how a collective computes (algorithm,
// pipeline chunk, one-shot limit, group size: fold order and kernel; one rank
// on one-shot and another on two-shot is a silent wrong answer). Init
// compares them across ranks and fails on every rank, naming the variable
// and each rank's value, when they differ. Values are normalized (parsed
// numbers, algorithm names), so "65536" and "0065536" agree.
std::vector<std::pair<std::string, std::string>> AgreedKnobs(const Knobs& knobs);

// Parses the environment. Fails with kInvalidArgument naming the variable, the
// value and what was expected.
StatusOr<Knobs> ParseKnobsFromEnvironment();

// Helpers shared by other parsers (exposed for tests).
StatusOr<int64_t> ParseInt64Knob(const char* name, const std::string& value, int64_t min_value);
StatusOr<double> ParseDoubleKnob(const char* name, const std::string& value, double min_value);

}  // namespace nvgroup
