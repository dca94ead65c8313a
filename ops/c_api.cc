// extern "C" entry points the Python layer (nvgroup_tf/basics.py) calls through
// ctypes on the op library itself, so that the ops and init/rank/... reach the
// same engine instance (one per process: the one linked into this .so).
//
// Every function returns the engine's StatusCode as an int (0 = OK) and, on
// error, writes the NUL-terminated message into `msg` (truncated to `msg_len`).
#include <cstdint>
#include <cstring>
#include <string>

#include "common/env.h"
#include "engine/engine_control.h"
#include "nvgroup/engine.h"
#include "ops/adapter.h"
#if GOOGLE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

int Report(const nvgroup::Status& status, char* msg, int msg_len) {
  if (msg != nullptr && msg_len > 0) {
    std::strncpy(msg, status.message().c_str(), static_cast<size_t>(msg_len) - 1);
    msg[msg_len - 1] = '\0';
  }
  return static_cast<int>(status.code());
}

int ReportValue(const nvgroup::StatusOr<int>& value, int* out, char* msg, int msg_len) {
  if (value.ok()) *out = value.value();
  return Report(value.status(), msg, msg_len);
}

// `text` into `value` (value_len bytes with its terminating NUL), else its error.
int ReportText(const nvgroup::StatusOr<std::string>& text, const char* name, char* value, int value_len,
               char* msg, int msg_len) {
  if (!text.ok()) return Report(text.status(), msg, msg_len);
  if (value == nullptr || value_len <= 0 || text.value().size() >= static_cast<size_t>(value_len))
    return Report(nvgroup::Status::InvalidArgument(std::string(name) + "'s value does not fit in " +
                                                   std::to_string(value_len) + " bytes"),
                  msg, msg_len);
  std::memcpy(value, text.value().c_str(), text.value().size() + 1);
  return 0;
}

}  // namespace

extern "C" {

int nvgroup_tf_init(int64_t mpi_comm_fortran, char* msg, int msg_len) {
  nvgroup::EngineOptions options;
  options.mpi_comm_fortran = mpi_comm_fortran;
#if GOOGLE_CUDA
  // With a GPU visible, the registered GPU memory is taken now, before
  // TensorFlow reserves the GPU's memory (README 'GPU memory'). No GPU (or a
  // CUDA error while looking): the first GPU collective creates it, if any.
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) options.cuda_at_init = true;
  else (void)cudaGetLastError();
#endif
  return Report(nvgroup::Init(options), msg, msg_len);
}

int nvgroup_tf_shutdown(char* msg, int msg_len) { return Report(nvgroup::Shutdown(), msg, msg_len); }

int nvgroup_tf_finalize_mpi(char* msg, int msg_len) { return Report(nvgroup::FinalizeMpi(), msg, msg_len); }

int nvgroup_tf_is_initialized() { return nvgroup::IsInitialized() ? 1 : 0; }

int nvgroup_tf_rank(int* out, char* msg, int len) { return ReportValue(nvgroup::Rank(), out, msg, len); }
int nvgroup_tf_size(int* out, char* msg, int len) { return ReportValue(nvgroup::Size(), out, msg, len); }
int nvgroup_tf_local_rank(int* out, char* msg, int len) {
  return ReportValue(nvgroup::LocalRank(), out, msg, len);
}
int nvgroup_tf_local_size(int* out, char* msg, int len) {
  return ReportValue(nvgroup::LocalSize(), out, msg, len);
}
int nvgroup_tf_cross_rank(int* out, char* msg, int len) {
  return ReportValue(nvgroup::CrossRank(), out, msg, len);
}
int nvgroup_tf_cross_size(int* out, char* msg, int len) {
  return ReportValue(nvgroup::CrossSize(), out, msg, len);
}

// Counters of the GPU kernels' event pool (ops/adapter.h GpuEventStats).
void nvgroup_tf_gpu_event_stats(int64_t* created, int64_t* recorded) {
  nvgroup::tf_adapter::GpuEventStats stats = nvgroup::tf_adapter::GetGpuEventStats();
  *created = stats.created;
  *recorded = stats.recorded;
}

// What the grouped allreduces did (ops/grouped_submissions.h).
void nvgroup_tf_grouped_submission_stats(int64_t* registrations, int64_t* launches, int64_t* by_name) {
  nvgroup::tf_adapter::GroupedSubmissionStats stats = nvgroup::tf_adapter::GetGroupedSubmissionStats();
  *registrations = stats.registrations;
  *launches = stats.launches;
  *by_name = stats.by_name;
}

int nvgroup_tf_mpi_threads_supported(int* out, char* msg, int len) {
  return ReportValue(nvgroup::MpiThreadsSupported(), out, msg, len);
}
int nvgroup_tf_is_homogeneous(int* out, char* msg, int len) {
  return ReportValue(nvgroup::IsHomogeneous(), out, msg, len);
}

// Horovod's start_timeline(file_path, mark_cycles) / stop_timeline().
int nvgroup_tf_start_timeline(const char* path, int mark_cycles, char* msg, int msg_len) {
  return Report(nvgroup::StartTimeline(path == nullptr ? "" : path, mark_cycles != 0), msg, msg_len);
}
int nvgroup_tf_stop_timeline(char* msg, int msg_len) { return Report(nvgroup::StopTimeline(), msg, msg_len); }

// The settings table (cc/common/env.h): `name`'s value parsed from the
// environment now (its default when unset), normalized, into `value`.
// kInvalidArgument naming the variable when it is malformed, or when `name`
// has no parse or the value does not fit.
int nvgroup_tf_setting_value(const char* name, char* value, int value_len, char* msg, int msg_len) {
  const std::string n = name == nullptr ? "" : name;
  return ReportText(nvgroup::SettingValueFromEnvironment(n), n.c_str(), value, value_len, msg, msg_len);
}

// The agreed setting `name` as every rank agreed it at init (nvgroup/engine.h,
// AgreedSettingValue) into `value`; kFailedPrecondition before init.
int nvgroup_tf_agreed_setting_value(const char* name, char* value, int value_len, char* msg, int msg_len) {
  const std::string n = name == nullptr ? "" : name;
  return ReportText(nvgroup::AgreedSettingValue(n), n.c_str(), value, value_len, msg, msg_len);
}

// Tests and benchmarks only: the simulated link's delay per allreduce bucket
// (NVGROUP_TEST_BUCKET_DELAY_US; engine_control.h), from the next bucket on.
void nvgroup_tf_set_bucket_delay_for_testing(double microseconds) {
  nvgroup::SetBucketDelayForTesting(microseconds);
}

// Tests and benchmarks only: how many buckets the simulated link delayed in
// this process so far (engine_control.h).
int64_t nvgroup_tf_delayed_buckets_for_testing() { return nvgroup::DelayedBucketsForTesting(); }

// 1 when the library was built with the DEVICE_GPU kernels.
int nvgroup_tf_cuda_built() {
#if GOOGLE_CUDA
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
