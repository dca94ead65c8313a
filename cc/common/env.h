// The settings table: every NVGROUP_* environment variable of nvgroup_tf, one
// row each (name, scope, type, default, help, and the parse into a Knobs
// field), and the one route by which the C++ library and the Python front end
// read them. A malformed value is an error naming the variable, never a silent
// default. Add a variable here, nowhere else: docs/SETTINGS.md is generated
// from this table (scripts/settings_doc.py) and tests/settings/ checks both
// that it is current and that no other file reads an NVGROUP_* variable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "nvgroup/status.h"

namespace nvgroup {

enum class AllreduceAlgorithm { kAuto, kMpi, kHierarchical };

// The parsed values of the rows that have a parse (defaults when unset).
struct Knobs {
  // Largest fused buffer, bytes; 0 disables fusion. Default 64 MiB: see the
  // Note [Fusion threshold] in cc/engine/fusion.h for the measurement behind it.
  size_t fusion_threshold = 64u << 20;
  // How long the background loop waits for more requests before negotiating
  // when it has nothing ready, milliseconds (it wakes at once on an enqueue).
  double cycle_time_ms = 1.0;
  // NV-group size override (0 = detect). Must divide the ranks per node.
  int group_size = 0;
  // Chunk of the pipelined hierarchical allreduce, bytes: the largest, and the
  // smallest one a message is cut into so it has several chunks to overlap
  // (Note [Chunk size] in cc/algorithms/hierarchical_allreduce.h).
  size_t pipeline_chunk = 4u << 20;
  size_t pipeline_min_chunk = 1u << 20;
  // Cross-group slices whose allgather sends at most this many bytes per peer
  // take the one-round allgather + fold instead of reduce-scatter + allgather
  // (cc/algorithms/cross_exchange.h); 0 = never. On the 2-core VM
  // (scripts/cross_exchange_cost.sh, host buffers, 2 ranks, load 5-8) the one
  // round saved 2-3 us at 16 KiB, lost 1-2 us at 4 KiB, was even at 64 KiB
  // and lost from 256 KiB (folding the whole slice instead of one part); at
  // 3-4 ranks (oversubscribed) it was 1-5 us behind up to 16 KiB. On a GPU
  // host (cross_step_bench's allgather and rsag columns, H200 and H100, 5
  // runs, docs/PERFORMANCE.md) a 64 KiB message took 5-17% less by the
  // allgather with 2 ranks (32 KiB to the one peer), 10-40% more with 4
  // (48 KiB: 3 x 16 KiB), 3 ranks (43.7 KiB) either way: hence 32 KiB. With
  // two groups the limit is twice this (CrossExchange::AllgatherLimitBytes:
  // both variants send the same bytes there).
  size_t cross_allgather_max_bytes = 32u << 10;
  // "auto" (hierarchical when it applies), "mpi" (flat MPI reference path),
  // "hierarchical" (force the NV-group skeleton even with one group).
  AllreduceAlgorithm algorithm = AllreduceAlgorithm::kAuto;
  // CUDA: messages up to this size use the one-shot kernel, above it two-shot.
  // 0 = the measured default of cc/kernels (see docs/PERFORMANCE.md).
  size_t oneshot_max_bytes = 0;
  // A collective or barrier that cannot progress for this long because a peer
  // is gone fails with kUnavailable naming the peer, seconds.
  double peer_timeout_s = 30.0;
  // init() and process-set registration wait the larger of this and
  // peer_timeout_s for every rank (ranks reach init() after importing
  // TensorFlow, which takes tens of seconds on a loaded host), seconds;
  // engine/init_watchdog.h bounds each of init()'s phases by it.
  double init_timeout_s = 120.0;
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
  // Cap of one gradient fusion bucket of the Python front end
  // (nvgroup_tf/gradient_reducer.py: which gradients form one grouped
  // allreduce), MiB; 0 = every gradient alone. The engine only makes the
  // ranks agree on it (AgreedKnobs). Default 25 MiB: measured with
  // examples/resnet50 (2 ranks, CPU, 64x64 images, batch 8 per rank), see the
  // bucket-cap table in examples/resnet50/README.md.
  double bucket_cap_mb = 25.0;
  // Rank 0's address / interface for the dead-rank connections
  // (cc/transport/liveness_address.h); "" = chosen automatically.
  std::string liveness_address;
  std::string liveness_interface;
  // XLA on CPU: lower the collectives to the custom call that returns a
  // future (ops/xla_host_handlers.cc) instead of the synchronous one.
  bool xla_async = false;
  // XLA on GPU: the custom call returns once the engine enqueued the
  // collective, XLA's stream waiting on the engine's event (true, "stream"), or
  // waits on the host until the result is complete (false, "host")
  // (ops/xla_ops_gpu.cc).
  bool xla_cuda_wait_on_stream = true;
  // TF GPU ops (no XLA): the op finishes when the host saw the collective
  // complete (false, "host", the default), so TF's later kernels are not
  // queued behind it, or once the engine enqueued the collective, TF's compute
  // stream waiting on the engine's completion event (true, "stream")
  // (ops/nvgroup_ops_gpu.cc). Host is the default because backward hides the
  // communication only that way: Keras ResNet-50 as a TF graph on one H100 at
  // 5cc5219, a simulated link of 2000 us per bucket, exposed 0.27 / 0.29 of
  // it (fp32 / mixed) against 0.74 / 0.80 on the stream, the step without
  // the link within 1.6% (docs/XLA.md, The TF graph path).
  bool tf_cuda_wait_on_stream = false;
  // TF grouped allreduce kernels and XLA calls: register their group with
  // the engine and launch it each step (true), or submit it by name every
  // step (ops/adapter.h, Note [Grouped kernels launch a registered group];
  // ops/xla_ops.h, Note [Calls launch registered groups]).
  bool tf_registered_groups = true;
  // XLA: lower each collective to a start/done pair of custom calls
  // (ops/xla_ops.h, Note [Start and done]) rather than one call: 1 always,
  // 0 never, -1 ("auto", the default) in programs compiled for a GPU only.
  int xla_start_done = -1;
  // Tests and benchmarks only: a delay of this many microseconds added to
  // every allreduce bucket on the engine's stream (CUDA: a device-side spin
  // before the bucket's completion; CPU: the loop's thread sleeps), the
  // simulated link of benchmarks/xla_overlap_bench.py. 0 = none.
  double test_bucket_delay_us = 0.0;
  // nvgrouprun's elastic mode (nvgroup_tf/runner/elastic_driver.py has the
  // protocol): the directory under which the driver makes each job's
  // directory ("" = the system's temporary directory), and what the driver
  // sets for the ranks it launches: the job's identity ("" = not elastic), the
  // job's directory on each host (the newest commit), the file the driver
  // writes when the hosts change, and the launch's number (-1 = unset).
  std::string elastic_base;
  std::string elastic_job;
  std::string elastic_dir;
  std::string elastic_notify;
  int elastic_launch = -1;
};

// Who must agree on a variable and who reads it.
enum class SettingScope {
  kAgreed,      // the same on every rank: Init compares the parsed values and fails on a mismatch
  kPerProcess,  // each process uses its own value
  kTests,       // only for checks on the test machines (the library may read it)
  kBuild,       // read by setup.py / scripts/bazel_build.sh when the library is built
};
const char* SettingScopeName(SettingScope scope);  // "agreed", "per process", "tests", "build"

struct Setting {
  const char* name;           // NVGROUP_...
  SettingScope scope;
  const char* type;           // what a value looks like ("bytes", "seconds", "stream or host", ...)
  const char* default_value;  // what holds when the variable is unset or empty
  const char* read_by;        // "engine", "TF ops (XLA)", "Python front end", "setup.py", "tests"
  const char* launcher_flag;  // the nvgrouprun flag that sets it for every rank, "" = none
  const char* help;           // one paragraph for users (docs/SETTINGS.md)
  // Parses a set (non-empty) value into its Knobs field; kInvalidArgument
  // naming the variable, the value and what was expected. nullptr for rows the
  // library does not read (scope build, tests read by the test files).
  Status (*parse)(const char* name, const std::string& value, Knobs* knobs);
  // The field's value, normalized ("0065536" and "65536" give "65536"; doubles
  // in their shortest round-trip form). nullptr iff parse is.
  std::string (*value)(const Knobs& knobs);
};

// Every row, the agreed ones first, in the order AgreedKnobs lists them.
const std::vector<Setting>& Settings();
// The row of `name`, or nullptr.
const Setting* FindSetting(const std::string& name);

// Walks the table once: every row with a parse whose variable is set and
// non-empty. Fails with the first malformed value's error.
StatusOr<Knobs> ParseKnobsFromEnvironment();
// Parses one row (`name` must have a parse) from the environment into
// *knobs, leaving the other fields as they are.
Status ParseSettingFromEnvironment(const std::string& name, Knobs* knobs);
// `name`'s normalized value as parsed from the environment now (its default
// when unset): what the Python front end reads (nvgroup_tf.basics.setting_value).
StatusOr<std::string> SettingValueFromEnvironment(const std::string& name);

// The knobs every rank must share (the rows of scope kAgreed), as (variable,
// normalized value) pairs in table order: they decide which requests share a
// collective (fusion threshold, cache capacity, the Python bucket cap) and how
// a collective computes (algorithm, pipeline chunk, one-shot limit, group
// size: fold order and kernel; one rank on one-shot and another on two-shot is
// a silent wrong answer). Init compares them across ranks and fails on every
// rank, naming the variable and each rank's value, when they differ. Values
// are normalized, so "65536" and "0065536" agree.
std::vector<std::pair<std::string, std::string>> AgreedKnobs(const Knobs& knobs);

// Parsers shared by the rows (exposed for tests).
StatusOr<int64_t> ParseInt64Knob(const char* name, const std::string& value, int64_t min_value);
StatusOr<double> ParseDoubleKnob(const char* name, const std::string& value, double min_value);
// A non-negative number with Python float()'s syntax (surrounding whitespace,
// '_' between digits; decimal only); nan and inf are rejected.
StatusOr<double> ParseNonNegativeDecimal(const char* name, const std::string& value,
                                         const std::string& expected);
// The shortest text that reads back as `value` (Python's repr of a float).
std::string ShortestDouble(double value);

}  // namespace nvgroup
