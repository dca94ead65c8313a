#include "common/env.h"

#include <cerrno>
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

}  // namespace

StatusOr<int64_t> ParseInt64Knob(const char* name, const std::string& value, int64_t min_value) {
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(value.c_str(), &end, 10);
  if (errno != 0 || end == value.c_str() || *end != '\0')
    return Malformed(name, value, "an integer");
  if (v < min_value)
    return Malformed(name, value, "an integer >= " + std::to_string(min_value));
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

StatusOr<Knobs> ParseKnobsFromEnvironment() {
  Knobs k;
  auto size_knob = [](const char* name, size_t* out) -> Status {
    if (const char* v = Get(name)) {
      auto r = ParseInt64Knob(name, v, 0);
      if (!r.ok()) return r.status();
      *out = static_cast<size_t>(r.value());
    }
    return Status::Ok();
  };
  auto double_knob = [](const char* name, double* out) -> Status {
    if (const char* v = Get(name)) {
      auto r = ParseDoubleKnob(name, v, 0.0);
      if (!r.ok()) return r.status();
      *out = r.value();
    }
    return Status::Ok();
  };
  Status s;
  if (!(s = size_knob("NVGROUP_FUSION_THRESHOLD", &k.fusion_threshold)).ok()) return s;
  if (!(s = double_knob("NVGROUP_CYCLE_TIME", &k.cycle_time_ms)).ok()) return s;
  size_t group_size = 0;
  if (!(s = size_knob("NVGROUP_GROUP_SIZE", &group_size)).ok()) return s;
  k.group_size = static_cast<int>(group_size);
  if (!(s = size_knob("NVGROUP_PIPELINE_CHUNK", &k.pipeline_chunk)).ok()) return s;
  if (k.pipeline_chunk == 0) return Malformed("NVGROUP_PIPELINE_CHUNK", "0", "a positive byte count");
  if (!(s = size_knob("NVGROUP_ONESHOT_MAX_BYTES", &k.oneshot_max_bytes)).ok()) return s;
  if (!(s = double_knob("NVGROUP_TIMEOUT", &k.peer_timeout_s)).ok()) return s;
  if (k.peer_timeout_s <= 0) return Malformed("NVGROUP_TIMEOUT", "0", "a positive number of seconds");
  if (!(s = double_knob("NVGROUP_STALL_WARNING_TIME", &k.stall_warning_s)).ok()) return s;
  if (!(s = double_knob("NVGROUP_STALL_SHUTDOWN_TIME", &k.stall_shutdown_s)).ok()) return s;
  size_t cache = static_cast<size_t>(k.cache_capacity);
  if (!(s = size_knob("NVGROUP_CACHE_CAPACITY", &cache)).ok()) return s;
  k.cache_capacity = static_cast<int>(cache);
  if (const char* v = Get("NVGROUP_TIMELINE")) k.timeline_path = v;
  if (const char* v = Get("NVGROUP_ALLREDUCE_ALGORITHM")) {
    std::string a = v;
    if (a == "auto") k.algorithm = AllreduceAlgorithm::kAuto;
    else if (a == "mpi") k.algorithm = AllreduceAlgorithm::kMpi;
    else if (a == "hierarchical") k.algorithm = AllreduceAlgorithm::kHierarchical;
    else return Malformed("NVGROUP_ALLREDUCE_ALGORITHM", a, "one of auto, mpi, hierarchical");
  }
  if (const char* v = Get("NVGROUP_ONE_GPU_GROUP")) {
    const std::string b = v;
    if (b != "0" && b != "1") return Malformed("NVGROUP_ONE_GPU_GROUP", b, "0 or 1");
    k.one_gpu_group = b == "1";
  }
  if (const char* v = Get("NVGROUP_LOG_LEVEL")) {
    static const char* kLevels[] = {"trace", "debug", "info", "warning", "error"};
    std::string l = v;
    int found = -1;
    for (int i = 0; i < 5; ++i)
      if (l == kLevels[i]) found = i;
    if (found < 0) return Malformed("NVGROUP_LOG_LEVEL", l, "one of trace, debug, info, warning, error");
    k.log_level = found;
  }
  if (const char* v = Get("NVGROUP_BUCKET_CAP_MB")) k.bucket_cap_mb_text = v;
  return k;
}

std::vector<std::pair<std::string, std::string>> AgreedKnobs(const Knobs& k) {
  static const char* kAlgorithms[] = {"auto", "mpi", "hierarchical"};
  return {
      {"NVGROUP_FUSION_THRESHOLD", std::to_string(k.fusion_threshold)},
      {"NVGROUP_CACHE_CAPACITY", std::to_string(k.cache_capacity)},
      {"NVGROUP_ALLREDUCE_ALGORITHM", kAlgorithms[static_cast<int>(k.algorithm)]},
      {"NVGROUP_PIPELINE_CHUNK", std::to_string(k.pipeline_chunk)},
      {"NVGROUP_ONESHOT_MAX_BYTES", std::to_string(k.oneshot_max_bytes)},
      {"NVGROUP_GROUP_SIZE", std::to_string(k.group_size)},
      {"NVGROUP_BUCKET_CAP_MB", k.bucket_cap_mb_text.empty() ? "unset" : "'" + k.bucket_cap_mb_text + "'"},
  };
}

}  // namespace nvgroup
