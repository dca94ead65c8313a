// The settings table (env.h) and its parsers.
#include "common/env.h"

#include <arpa/inet.h>

#include <cctype>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdlib>

namespace nvgroup {
namespace {

const char* Get(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && v[0] != '\0') ? v : nullptr;
}

Status Malformed(const char* name, const std::string& value, const std::string& expected) {
  return Status::InvalidArgument(std::string("environment variable ") + name + "='" + value +
                                 "' is not valid: expected " + expected);
}

Status SizeInto(const char* name, const std::string& value, size_t* out) {
  StatusOr<int64_t> r = ParseInt64Knob(name, value, 0);
  if (!r.ok()) return r.status();
  *out = static_cast<size_t>(r.value());
  return Status::Ok();
}

// The settings table's range "bytes (> 0)".
Status PositiveSizeInto(const char* name, const std::string& value, size_t* out) {
  size_t bytes = 0;
  Status s = SizeInto(name, value, &bytes);
  if (!s.ok()) return s;
  if (bytes == 0) return Malformed(name, value, "a positive byte count");
  *out = bytes;
  return Status::Ok();
}

Status IntInto(const char* name, const std::string& value, int* out) {
  StatusOr<int64_t> r = ParseInt64Knob(name, value, 0);
  if (!r.ok()) return r.status();
  if (r.value() > INT_MAX) return Malformed(name, value, "an integer <= " + std::to_string(INT_MAX));
  *out = static_cast<int>(r.value());
  return Status::Ok();
}

// The settings table's type "milliseconds" (a number >= 0).
Status MillisecondsInto(const char* name, const std::string& value, double* out) {
  StatusOr<double> r = ParseDoubleKnob(name, value, 0.0);
  if (!r.ok()) return r.status();
  *out = r.value();
  return Status::Ok();
}

// The settings table's type "seconds" (a number >= 0).
Status SecondsInto(const char* name, const std::string& value, double* out) {
  StatusOr<double> r = ParseDoubleKnob(name, value, 0.0);
  if (!r.ok()) return r.status();
  *out = r.value();
  return Status::Ok();
}

// The settings table's range "seconds (> 0)", in every refusal's message.
Status PositiveSecondsInto(const char* name, const std::string& value, double* out) {
  StatusOr<double> r = ParseDoubleKnob(name, value, 0.0);
  if (!r.ok() || !(r.value() > 0)) return Malformed(name, value, "a number of seconds > 0");
  *out = r.value();
  return Status::Ok();
}

// Paths the elastic driver hands to ranks on other hosts, and that ranks with
// other working directories use: only absolute ones mean the same everywhere.
Status AbsolutePathInto(const char* name, const std::string& value, std::string* out) {
  if (value[0] != '/') return Malformed(name, value, "an absolute path (starting with /)");
  *out = value;
  return Status::Ok();
}

Status BoolInto(const char* name, const std::string& value, bool* out) {
  if (value != "0" && value != "1") return Malformed(name, value, "0 or 1");
  *out = value == "1";
  return Status::Ok();
}

const char* const kAlgorithms[] = {"auto", "mpi", "hierarchical"};
const char* const kLogLevels[] = {"trace", "debug", "info", "warning", "error"};

const char* const kBucketCapExpected = "a non-negative number of MiB (0 disables fusion)";

// Columns: name, scope, type, default, read by, nvgrouprun flag, help, parse, value.
std::vector<Setting> MakeSettings() {
  using S = SettingScope;
  using K = Knobs;
  return {
      // ---- agreed across ranks (AgreedKnobs, in this order)
      {"NVGROUP_FUSION_THRESHOLD", S::kAgreed, "bytes", "67108864 (64 MiB)", "engine",
       "--fusion-threshold-mb",
       "Largest fused buffer: ready allreduces of one dtype, op and device are packed into one buffer of up "
       "to this many bytes and reduced by one collective. 0 disables fusion.",
       +[](const char* n, const std::string& v, K* k) { return SizeInto(n, v, &k->fusion_threshold); },
       +[](const K& k) { return std::to_string(k.fusion_threshold); }},
      {"NVGROUP_CACHE_CAPACITY", S::kAgreed, "entries", "1024", "engine", "",
       "Response-cache entries: a collective seen before is negotiated by a bit instead of its full "
       "description. 0 disables the cache.",
       +[](const char* n, const std::string& v, K* k) { return IntInto(n, v, &k->cache_capacity); },
       +[](const K& k) { return std::to_string(k.cache_capacity); }},
      {"NVGROUP_ALLREDUCE_ALGORITHM", S::kAgreed, "auto, mpi or hierarchical", "auto", "engine", "",
       "auto: the hierarchical NV-group allreduce when it applies; mpi: the flat MPI reference path; "
       "hierarchical: the NV-group skeleton even with one group.",
       +[](const char* n, const std::string& v, K* k) -> Status {
    for (int i = 0; i < 3; ++i)
      if (v == kAlgorithms[i]) {
        k->algorithm = static_cast<AllreduceAlgorithm>(i);
        return Status::Ok();
      }
    return Malformed(n, v, "one of auto, mpi, hierarchical");
  }, +[](const K& k) { return std::string(kAlgorithms[static_cast<int>(k.algorithm)]); }},
      {"NVGROUP_PIPELINE_CHUNK", S::kAgreed, "bytes (> 0)", "4194304 (4 MiB)", "engine", "",
       "Chunk of the pipelined hierarchical allreduce.",
       +[](const char* n, const std::string& v, K* k) { return PositiveSizeInto(n, v, &k->pipeline_chunk); },
       +[](const K& k) { return std::to_string(k.pipeline_chunk); }},
      {"NVGROUP_PIPELINE_MIN_CHUNK", S::kAgreed, "bytes (> 0)", "1048576 (1 MiB)", "engine", "",
       "Smallest chunk of the pipelined hierarchical allreduce: a message is cut into 4 chunks, but none "
       "smaller than this nor larger than NVGROUP_PIPELINE_CHUNK, so the copies and the MPI exchange of "
       "consecutive chunks overlap (a value above NVGROUP_PIPELINE_CHUNK means NVGROUP_PIPELINE_CHUNK).",
       +[](const char* n, const std::string& v, K* k) {
    return PositiveSizeInto(n, v, &k->pipeline_min_chunk);
  }, +[](const K& k) { return std::to_string(k.pipeline_min_chunk); }},
      {"NVGROUP_CROSS_ALLGATHER_MAX_BYTES", S::kAgreed, "bytes", "32768 (32 KiB)", "engine", "",
       "Cross-group step between NV-groups: a slice whose allgather sends at most this many bytes in all "
       "((groups - 1) x the slice; with two groups twice this many, as both ways send the same bytes there) "
       "is exchanged in one allgather and folded locally; larger ones by reduce-scatter + allgather. 0 "
       "always takes reduce-scatter + allgather. Results are the same bits either way.",
       +[](const char* n, const std::string& v, K* k) {
    return SizeInto(n, v, &k->cross_allgather_max_bytes);
  }, +[](const K& k) { return std::to_string(k.cross_allgather_max_bytes); }},
      {"NVGROUP_ONESHOT_MAX_BYTES", S::kAgreed, "bytes", "0 (the measured default)", "engine (CUDA)", "",
       "CUDA: allreduces up to this size use the one-shot kernel, larger ones the two-shot kernel; 0 keeps "
       "the measured default (docs/PERFORMANCE.md).",
       +[](const char* n, const std::string& v, K* k) { return SizeInto(n, v, &k->oneshot_max_bytes); },
       +[](const K& k) { return std::to_string(k.oneshot_max_bytes); }},
      {"NVGROUP_GROUP_SIZE", S::kAgreed, "ranks", "0 (detect)", "engine", "",
       "NV-group size override; it must divide the ranks per node (2 on 4 ranks per node: 2 groups of 2).",
       +[](const char* n, const std::string& v, K* k) { return IntInto(n, v, &k->group_size); },
       +[](const K& k) { return std::to_string(k.group_size); }},
      {"NVGROUP_BUCKET_CAP_MB", S::kAgreed, "MiB", "25", "Python front end", "",
       "Cap of one gradient fusion bucket of DistributedOptimizer and DistributedGradientTape: the "
       "gradients of one bucket are one grouped allreduce (the first bucket is 1 MiB, so communication "
       "starts early). 0 puts every gradient in a bucket of its own. The constructor's bucket_cap_bytes "
       "wins. Read when the optimizer or tape is made.",
       +[](const char* n, const std::string& v, K* k) -> Status {
    if (v.find_first_not_of(" \t\n\v\f\r\x1c\x1d\x1e\x1f") == std::string::npos)
      return Status::Ok();  // only whitespace counts as unset
    StatusOr<double> r = ParseNonNegativeDecimal(n, v, kBucketCapExpected);
    if (!r.ok()) return r.status();
    k->bucket_cap_mb = r.value();
    return Status::Ok();
  }, +[](const K& k) { return ShortestDouble(k.bucket_cap_mb); }},
      // ---- per process
      {"NVGROUP_CYCLE_TIME", S::kPerProcess, "milliseconds", "1.0", "engine", "--cycle-time-ms",
       "How long the background loop waits for more requests when nothing is ready (it wakes at once on "
       "an enqueue).",
       +[](const char* n, const std::string& v, K* k) { return MillisecondsInto(n, v, &k->cycle_time_ms); },
       +[](const K& k) { return ShortestDouble(k.cycle_time_ms); }},
      {"NVGROUP_TIMEOUT", S::kPerProcess, "seconds (> 0)", "30", "engine", "",
       "A collective or barrier that cannot progress for this long because a peer is gone fails with "
       "UnavailableError naming it; bounds every wait of the engine.",
       +[](const char* n, const std::string& v, K* k) {
    return PositiveSecondsInto(n, v, &k->peer_timeout_s);
  }, +[](const K& k) { return ShortestDouble(k.peer_timeout_s); }},
      {"NVGROUP_INIT_TIMEOUT", S::kPerProcess, "seconds (> 0)", "120", "engine", "",
       "How long init() and process-set registration wait for every rank (the larger of this and "
       "NVGROUP_TIMEOUT): a rank that has not reached init() by then is named in the error of every rank "
       "that did; a phase of init() stuck this long plus 5 s in MPI (a peer stopped or died inside a "
       "blocking MPI call) logs the phase at error level and ends the process with exit code 70.",
       +[](const char* n, const std::string& v, K* k) {
    return PositiveSecondsInto(n, v, &k->init_timeout_s);
  }, +[](const K& k) { return ShortestDouble(k.init_timeout_s); }},
      {"NVGROUP_STALL_WARNING_TIME", S::kPerProcess, "seconds", "60", "engine", "",
       "Rank 0 warns about ranks missing tensors after this long. 0 turns the warning off.",
       +[](const char* n, const std::string& v, K* k) { return SecondsInto(n, v, &k->stall_warning_s); },
       +[](const K& k) { return ShortestDouble(k.stall_warning_s); }},
      {"NVGROUP_STALL_SHUTDOWN_TIME", S::kPerProcess, "seconds", "0 (never)", "engine", "",
       "Stalled requests fail with DeadlineExceededError after this long. 0 = never.",
       +[](const char* n, const std::string& v, K* k) { return SecondsInto(n, v, &k->stall_shutdown_s); },
       +[](const K& k) { return ShortestDouble(k.stall_shutdown_s); }},
      {"NVGROUP_TIMELINE", S::kPerProcess, "file path", "off", "engine", "--timeline-filename",
       "Chrome-trace timeline file, written by rank 0.",
       +[](const char*, const std::string& v, K* k) {
    k->timeline_path = v;
    return Status::Ok();
  }, +[](const K& k) { return k.timeline_path; }},
      {"NVGROUP_LOG_LEVEL", S::kPerProcess, "trace, debug, info, warning or error", "warning", "engine",
       "--log-level", "Least severe message the engine prints; every line starts with the rank.",
       +[](const char* n, const std::string& v, K* k) -> Status {
    for (int i = 0; i < 5; ++i)
      if (v == kLogLevels[i]) {
        k->log_level = i;
        return Status::Ok();
      }
    return Malformed(n, v, "one of trace, debug, info, warning, error");
  }, +[](const K& k) { return std::string(kLogLevels[k.log_level]); }},
      {"NVGROUP_LIVENESS_ADDR", S::kPerProcess, "IPv4 address a.b.c.d",
       "unset (chosen as NVGROUP_LIVENESS_IFACE says)", "engine", "",
       "The only address of rank 0 the other ranks use for the dead-rank connections (read on rank 0). "
       "Wins over NVGROUP_LIVENESS_IFACE.",
       +[](const char* n, const std::string& v, K* k) -> Status {
    in_addr a{};
    if (inet_pton(AF_INET, v.c_str(), &a) != 1) return Malformed(n, v, "an IPv4 address (a.b.c.d)");
    k->liveness_address = v;
    return Status::Ok();
  }, +[](const K& k) { return k.liveness_address; }},
      {"NVGROUP_LIVENESS_IFACE", S::kPerProcess, "interface name", "unset (chosen automatically)", "engine",
       "",
       "Rank 0's interface whose addresses the dead-rank connections use (read on rank 0). Unset: every "
       "address of rank 0, best first: on an interface MPI was told to use, then its host name's "
       "addresses, then the rest, container and VM bridges last.",
       +[](const char*, const std::string& v, K* k) {
    k->liveness_interface = v;
    return Status::Ok();
  }, +[](const K& k) { return k.liveness_interface; }},
      {"NVGROUP_XLA_ASYNC", S::kPerProcess, "0 or 1", "0", "TF ops (XLA on CPU)", "",
       "1 lowers the collectives of XLA programs on the CPU to the custom call that returns a future "
       "instead of waiting (docs/XLA.md). Read once per process, at the first compilation.",
       +[](const char* n, const std::string& v, K* k) { return BoolInto(n, v, &k->xla_async); },
       +[](const K& k) { return std::string(k.xla_async ? "1" : "0"); }},
      {"NVGROUP_XLA_CUDA_WAIT", S::kPerProcess, "stream or host", "stream", "TF ops (XLA on GPU)", "",
       "stream: the XLA custom call returns once the engine enqueued the collective, XLA's stream waiting "
       "on the engine's completion event; host: it waits on the host until the result is complete "
       "(docs/XLA.md). Read once per process, at the first call.",
       +[](const char* n, const std::string& v, K* k) -> Status {
    if (v != "stream" && v != "host") return Malformed(n, v, "stream or host");
    k->xla_cuda_wait_on_stream = v == "stream";
    return Status::Ok();
  }, +[](const K& k) { return std::string(k.xla_cuda_wait_on_stream ? "stream" : "host"); }},
      {"NVGROUP_TF_CUDA_WAIT", S::kPerProcess, "stream or host", "host", "TF ops (GPU, no XLA)", "",
       "host: a TF GPU collective op finishes when the host saw the collective complete, and only the "
       "kernels that use its outputs wait, so the rest of backward runs meanwhile; stream: it finishes "
       "once the engine enqueued it, TF's compute stream waiting on the engine's completion event (no "
       "host round trip, but every kernel TF queues after that waits for the collective) (docs/XLA.md, "
       "The TF graph path). Read once per process, at the first GPU op.",
       +[](const char* n, const std::string& v, K* k) -> Status {
    if (v != "stream" && v != "host") return Malformed(n, v, "stream or host");
    k->tf_cuda_wait_on_stream = v == "stream";
    return Status::Ok();
  }, +[](const K& k) { return std::string(k.tf_cuda_wait_on_stream ? "stream" : "host"); }},
      {"NVGROUP_TF_REGISTERED_GROUPS", S::kPerProcess, "0 or 1", "1", "TF ops and XLA", "",
       "1: a grouped allreduce op or XLA call (the DistributedOptimizer's buckets) registers its group "
       "with the engine at its first step and launches it afterwards with only the step's buffers; 0: it "
       "submits every member by name at every step. The same collective either way "
       "(docs/ARCHITECTURE.md). Read once per process, at the first grouped allreduce.",
       +[](const char* n, const std::string& v, K* k) { return BoolInto(n, v, &k->tf_registered_groups); },
       +[](const K& k) { return std::string(k.tf_registered_groups ? "1" : "0"); }},
      {"NVGROUP_XLA_START_DONE", S::kPerProcess, "auto, 0 or 1", "auto", "TF ops (XLA)", "",
       "1 lowers every collective of an XLA program to a start/done pair of custom calls, so XLA schedules "
       "the program's independent work (the rest of backprop) between them and the collective runs "
       "meanwhile; 0 lowers each to one call that returns when the collective was enqueued (GPU) or "
       "complete (CPU); auto is the pair in programs compiled for a GPU and one call on the CPU, where "
       "the pair measured within the launches' spread (docs/XLA.md). Read once per process, at the first "
       "compilation.",
       +[](const char* n, const std::string& v, K* k) -> Status {
    if (v == "auto") k->xla_start_done = -1;
    else if (v == "1") k->xla_start_done = 1;
    else if (v == "0") k->xla_start_done = 0;
    else return Malformed(n, v, "auto, 0 or 1");
    return Status::Ok();
  }, +[](const K& k) { return std::string(k.xla_start_done < 0 ? "auto"
                                          : k.xla_start_done   ? "1"
                                                               : "0"); }},
      {"NVGROUP_ELASTIC_BASE", S::kPerProcess, "absolute directory path",
       "unset (the system's temporary "
       "directory: $TMPDIR, else /tmp)",
       "nvgrouprun (elastic mode)", "",
       "Where nvgrouprun's elastic driver makes each job's directory nvgroup_elastic_<job id>: on every host "
       "the newest commit of that host's ranks, on the driver's host also the file that tells rank 0 of a "
       "change of hosts. Rank 0 must see the driver's file: list the driver's host first in the discovery "
       "script, or give a directory shared by the hosts (docs/MIGRATION.md, Elastic training). The driver "
       "removes the job's directory on its host when it ends.",
       +[](const char* n, const std::string& v, K* k) { return AbsolutePathInto(n, v, &k->elastic_base); },
       +[](const K& k) { return k.elastic_base; }},
      {"NVGROUP_ELASTIC_JOB", S::kPerProcess, "32 lowercase hexadecimal digits", "unset (not elastic)",
       "Python front end (nvgroup_tf/elastic.py)", "",
       "Set by nvgrouprun's elastic driver for the ranks it launches, not by hand: the job's identity, "
       "which tags every commit. When set, hvd.elastic.run keeps commits on disk and resumes from the "
       "newest after a relaunch, and commit() raises HostsUpdatedInterrupt when the driver reports new "
       "hosts; NVGROUP_ELASTIC_DIR, NVGROUP_ELASTIC_NOTIFY and NVGROUP_ELASTIC_LAUNCH must be set with it.",
       +[](const char* n, const std::string& v, K* k) -> Status {
    if (v.size() != 32 || v.find_first_not_of("0123456789abcdef") != std::string::npos)
      return Malformed(n, v, "32 lowercase hexadecimal digits (the job identity nvgrouprun sets)");
    k->elastic_job = v;
    return Status::Ok();
  }, +[](const K& k) { return k.elastic_job; }},
      {"NVGROUP_ELASTIC_DIR", S::kPerProcess, "absolute directory path", "unset",
       "Python front end (nvgroup_tf/elastic.py)", "",
       "Set by nvgrouprun's elastic driver: the job's directory on each host; each host's local rank 0 "
       "writes the newest commit there (file commit, written to a temporary name and renamed).",
       +[](const char* n, const std::string& v, K* k) { return AbsolutePathInto(n, v, &k->elastic_dir); },
       +[](const K& k) { return k.elastic_dir; }},
      {"NVGROUP_ELASTIC_NOTIFY", S::kPerProcess, "absolute file path", "unset",
       "Python front end (nvgroup_tf/elastic.py)", "",
       "Set by nvgrouprun's elastic driver: the file it writes when the hosts change; rank 0 looks for it "
       "at every commit() and check_host_updates().",
       +[](const char* n, const std::string& v, K* k) { return AbsolutePathInto(n, v, &k->elastic_notify); },
       +[](const K& k) { return k.elastic_notify; }},
      {"NVGROUP_ELASTIC_LAUNCH", S::kPerProcess, "integer >= 0", "unset",
       "Python front end (nvgroup_tf/elastic.py)", "",
       "Set by nvgrouprun's elastic driver: the launch's number (0, then 1, 2, ... after each relaunch), "
       "printed when a launch resumes from a commit.",
       +[](const char* n, const std::string& v, K* k) { return IntInto(n, v, &k->elastic_launch); },
       +[](const K& k) { return k.elastic_launch < 0 ? std::string() : std::to_string(k.elastic_launch); }},
      // ---- tests
      {"NVGROUP_TEST_BUCKET_DELAY_US", S::kTests, "microseconds", "0", "engine", "",
       "Adds this delay to every allreduce bucket on the engine's stream (CUDA: a device-side spin before the "
       "bucket completes; CPU: the engine's thread sleeps): the simulated link of "
       "benchmarks/xla_overlap_bench.py.",
       +[](const char* n, const std::string& v, K* k) -> Status {
    StatusOr<double> r = ParseNonNegativeDecimal(n, v, "a number of microseconds >= 0");
    if (!r.ok()) return r.status();
    k->test_bucket_delay_us = r.value();
    return Status::Ok();
  }, +[](const K& k) { return ShortestDouble(k.test_bucket_delay_us); }},
      {"NVGROUP_ONE_GPU_GROUP", S::kTests, "0 or 1", "0", "engine (CUDA)", "",
       "1 lets ranks on one GPU form an NV-group (run under MPS), so the group kernels can be checked on a "
       "one-GPU machine.",
       +[](const char* n, const std::string& v, K* k) { return BoolInto(n, v, &k->one_gpu_group); },
       +[](const K& k) { return std::string(k.one_gpu_group ? "1" : "0"); }},
      {"NVGROUP_TEST_GPU_MB", S::kTests, "MiB", "6144", "tests/gpu/workers/gpu_common.py", "",
       "GPU memory each GPU test process lets TensorFlow take.", nullptr, nullptr},
      {"NVGROUP_TEST_TF_GPU_DENSE", S::kTests, "0 or 1", "0", "tests/gpu/test_tf_gpu.py", "",
       "1 adds the GPU tests that need cuDNN (Keras fit, examples/resnet50 on the GPU).", nullptr, nullptr},
      {"NVGROUP_TEST_CPU_DRY_RUN", S::kTests, "0 or 1", "0", "tests/gpu/workers/gpu_common.py", "",
       "1 lets the GPU test workers run on a machine without a GPU (to check the workers themselves).",
       nullptr, nullptr},
      {"NVGROUP_TEST_XLA_FOUR_RANKS", S::kTests, "0 or 1", "0", "tests/tf/test_xla_scatter_alltoall.py", "",
       "1 adds the 4-rank runs of the XLA collective checks.", nullptr, nullptr},
      {"NVGROUP_TEST_DUMP_AFTER", S::kTests, "seconds", "200", "tests/tf/workers/common.py", "",
       "A TF test worker still running after this long prints every thread's stack.", nullptr, nullptr},
      // ---- build
      {"NVGROUP_WITH_CUDA", S::kBuild, "0 or 1", "0", "setup.py", "",
       "1 builds the CUDA engine and the DEVICE_GPU kernels (needs CUDA_HOME or nvcc on PATH).", nullptr,
       nullptr},
      {"NVGROUP_CUDA_ARCH", S::kBuild, "compute capabilities", "90", "setup.py, scripts/check_gpu_build.sh",
       "", "GPU architectures to compile for: one or a list such as 70;80;90 (80 = A100, 90 = H100/H200).",
       nullptr, nullptr},
      {"NVGROUP_BUILD_JOBS", S::kBuild, "count", "the number of cores", "setup.py", "",
       "Compiles run in parallel.", nullptr, nullptr},
      {"NVGROUP_WITHOUT_TF", S::kBuild, "0 or 1", "0", "setup.py", "",
       "1 builds only the pybind11 module nvgroup_tf._engine (no TensorFlow needed).", nullptr, nullptr},
      {"NVGROUP_PYTHON", S::kBuild, "path", ".venv/bin/python",
       "scripts/bazel_build.sh, bazel/local_deps.bzl", "",
       "The Python whose TensorFlow the Bazel build compiles against.", nullptr, nullptr},
  };
}

}  // namespace

const char* SettingScopeName(SettingScope scope) {
  switch (scope) {
    case SettingScope::kAgreed: return "agreed";
    case SettingScope::kPerProcess: return "per process";
    case SettingScope::kTests: return "tests";
    case SettingScope::kBuild: return "build";
  }
  return "?";
}

const std::vector<Setting>& Settings() {
  static const std::vector<Setting> settings = MakeSettings();
  return settings;
}

const Setting* FindSetting(const std::string& name) {
  for (const Setting& s : Settings())
    if (name == s.name) return &s;
  return nullptr;
}

StatusOr<int64_t> ParseInt64Knob(const char* name, const std::string& value, int64_t min_value) {
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(value.c_str(), &end, 10);
  if (errno != 0 || end == value.c_str() || *end != '\0') return Malformed(name, value, "an integer");
  if (v < min_value) return Malformed(name, value, "an integer >= " + std::to_string(min_value));
  return static_cast<int64_t>(v);
}

StatusOr<double> ParseDoubleKnob(const char* name, const std::string& value, double min_value) {
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(value.c_str(), &end);
  if (errno != 0 || end == value.c_str() || *end != '\0' || !std::isfinite(v))
    return Malformed(name, value, "a number");
  if (v < min_value) return Malformed(name, value, "a number >= " + std::to_string(min_value));
  return v;
}

StatusOr<double> ParseNonNegativeDecimal(const char* name, const std::string& value,
                                         const std::string& expected) {
  // Python's str.strip() whitespace (the ASCII part: \t..\r, \x1c..\x1f, space).
  auto space = [](char c) { return c == ' ' || (c >= '\t' && c <= '\r') || (c >= '\x1c' && c <= '\x1f'); };
  size_t begin = 0, end = value.size();
  while (begin < end && space(value[begin])) ++begin;
  while (end > begin && space(value[end - 1])) --end;
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  std::string text;
  for (size_t i = begin; i < end; ++i) {
    const char c = value[i];
    if (c == '_') {  // Python: one '_' between two digits
      if (i == begin || i + 1 == end || !digit(value[i - 1]) || !digit(value[i + 1]))
        return Malformed(name, value, expected);
      continue;
    }
    // Decimal syntax only (no hex, inf or nan: Python rejects those or they fail the range check).
    if (!digit(c) && c != '+' && c != '-' && c != '.' && c != 'e' && c != 'E')
      return Malformed(name, value, expected);
    text += c;
  }
  errno = 0;
  char* stop = nullptr;
  const double v = std::strtod(text.c_str(), &stop);
  // Underflow (ERANGE with a finite result) reads as Python reads it: 0 or a subnormal.
  if (text.empty() || stop != text.c_str() + text.size() || !std::isfinite(v) || !(v >= 0.0))
    return Malformed(name, value, expected);
  return v;
}

std::string ShortestDouble(double value) {
  char buf[64];
  std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), value);
  return std::string(buf, r.ptr);
}

Status ParseSettingFromEnvironment(const std::string& name, Knobs* knobs) {
  const Setting* s = FindSetting(name);
  if (s == nullptr || s->parse == nullptr)
    return Status::InvalidArgument("'" + name + "' is not a setting the library parses (cc/common/env.h)");
  const char* v = Get(s->name);
  return v == nullptr ? Status::Ok() : s->parse(s->name, v, knobs);
}

StatusOr<Knobs> ParseKnobsFromEnvironment() {
  Knobs k;
  for (const Setting& s : Settings()) {
    if (s.parse == nullptr) continue;
    if (const char* v = Get(s.name)) {
      Status status = s.parse(s.name, v, &k);
      if (!status.ok()) return status;
    }
  }
  return k;
}

StatusOr<std::string> SettingValueFromEnvironment(const std::string& name) {
  Knobs k;
  Status s = ParseSettingFromEnvironment(name, &k);
  if (!s.ok()) return s;
  return FindSetting(name)->value(k);
}

std::vector<std::pair<std::string, std::string>> AgreedKnobs(const Knobs& k) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Setting& s : Settings())
    if (s.scope == SettingScope::kAgreed) out.emplace_back(s.name, s.value(k));
  return out;
}

}  // namespace nvgroup
