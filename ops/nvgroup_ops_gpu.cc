// DEVICE_GPU kernels: the same kernel bodies as the CPU (adapter.h) with GPU
// traits. Built only with GOOGLE_CUDA (setup.py with NVGROUP_WITH_CUDA=1).
//
// How it works. TF runs GPU kernels by enqueueing work on its compute stream;
// when ComputeAsync runs, the input is not necessarily computed yet. Prepare()
// takes an event from a pool and records it on that stream; the engine makes
// its own stream wait for it on the device (no host block, engine.h). When the
// engine has enqueued the op's work it records a completion event and TF's
// compute stream waits on it (WaitOnCompletion), then done() runs: no host
// sync (the ordering argument is in adapter.h's header comment). The readiness
// event goes back to the pool at done(): the engine's wait on it was enqueued
// before, and cudaStreamWaitEvent captures the record current at the call, so
// recording it again for a later op cannot affect that wait.
#if GOOGLE_CUDA

#include <cuda_runtime_api.h>

#include <mutex>
#include <utility>
#include <vector>

#include "common/env.h"
#include "ops/adapter.h"
#include "ops/negotiated_output_kernels.h"
#include "tensorflow/core/framework/device_base.h"
#include "xla/stream_executor/stream.h"
#include "xla/stream_executor/stream_executor.h"

namespace nvgroup {
namespace tf_adapter {
namespace {

absl::Status CudaError(const char* what, cudaError_t error) {
  return absl::InternalError(std::string(what) + " failed: " + cudaGetErrorString(error));
}

// cudaEvents of each device, reused across ops. An event is created (the only
// time the current device must be switched) only when none is free, so the
// pool holds as many events as ops were ever in flight at once.
class EventPool {
 public:
  absl::Status Take(int ordinal, cudaEvent_t* event) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::vector<cudaEvent_t>& free = FreeList(ordinal);
      if (!free.empty()) {
        *event = free.back();
        free.pop_back();
        return absl::OkStatus();
      }
    }
    int previous = 0;
    cudaError_t error = cudaGetDevice(&previous);
    if (error != cudaSuccess) return CudaError("cudaGetDevice", error);
    if (previous != ordinal && (error = cudaSetDevice(ordinal)) != cudaSuccess)
      return CudaError("cudaSetDevice", error);
    error = cudaEventCreateWithFlags(event, cudaEventDisableTiming);
    cudaError_t restored = previous != ordinal ? cudaSetDevice(previous) : cudaSuccess;
    if (error != cudaSuccess) return CudaError("cudaEventCreateWithFlags", error);
    if (restored != cudaSuccess) {
      Give(ordinal, *event);
      return CudaError("cudaSetDevice (restoring the caller's device)", restored);
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.created;
    return absl::OkStatus();
  }
  void Give(int ordinal, cudaEvent_t event) {
    std::lock_guard<std::mutex> lock(mu_);
    FreeList(ordinal).push_back(event);
  }
  void CountRecord() {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.recorded;
  }
  GpuEventStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  std::vector<cudaEvent_t>& FreeList(int ordinal) {  // mu_ held
    if (ordinal >= static_cast<int>(free_.size())) free_.resize(ordinal + 1);
    return free_[ordinal];
  }
  std::mutex mu_;
  std::vector<std::vector<cudaEvent_t>> free_;  // by device ordinal
  GpuEventStats stats_;
};

// Never destroyed: ops may finish during static destruction at exit, and the
// driver frees the events with the process.
EventPool& Pool() {
  static EventPool* pool = new EventPool();
  return *pool;
}

absl::Status ComputeStream(tf::OpKernelContext* context, stream_executor::Stream** stream) {
  const tf::DeviceContext* device_context = context->op_device_context();
  if (device_context == nullptr || device_context->stream() == nullptr) {
    return absl::InternalError("nvgroup GPU kernel '" + context->op_kernel().name() +
                               "' has no TensorFlow GPU stream");
  }
  *stream = device_context->stream();
  return absl::OkStatus();
}

cudaStream_t CudaStream(stream_executor::Stream* stream) {
  return static_cast<cudaStream_t>(stream->platform_specific_handle().stream);
}

// NVGROUP_TF_CUDA_WAIT (the settings table, cc/common/env.h; parsed once per
// process, at the first GPU op): true = "stream", false = "host" (the default).
absl::Status CompleteOnStream(bool* on_stream) {
  static const std::pair<Status, bool> parsed = [] {
    Knobs knobs;
    Status status = ParseSettingFromEnvironment("NVGROUP_TF_CUDA_WAIT", &knobs);
    return std::make_pair(status, knobs.tf_cuda_wait_on_stream);
  }();
  *on_stream = parsed.second;
  return ToTfStatus(parsed.first);
}

struct GpuTraits {
  static constexpr bool kDeviceCompletion = true;
  static absl::Status CompletesOnStream(bool* on_stream) { return CompleteOnStream(on_stream); }

  static absl::Status Prepare(tf::OpKernelContext* context, Device* device, void** event) {
    stream_executor::Stream* stream = nullptr;
    TF_RETURN_IF_ERROR(ComputeStream(context, &stream));
    *device = Device::Cuda(stream->parent()->device_ordinal());
    cudaEvent_t cuda_event = nullptr;
    TF_RETURN_IF_ERROR(Pool().Take(device->ordinal, &cuda_event));
    // The event belongs to the stream's device (the pool is per device), so
    // the thread's current device does not matter here.
    cudaError_t error = cudaEventRecord(cuda_event, CudaStream(stream));
    if (error != cudaSuccess) {
      Pool().Give(device->ordinal, cuda_event);
      return CudaError("cudaEventRecord", error);
    }
    Pool().CountRecord();
    *event = cuda_event;
    return absl::OkStatus();
  }

  static absl::Status RecordReady(tf::OpKernelContext* context, void* event) {
    stream_executor::Stream* stream = nullptr;
    TF_RETURN_IF_ERROR(ComputeStream(context, &stream));
    cudaError_t error = cudaEventRecord(static_cast<cudaEvent_t>(event), CudaStream(stream));
    if (error != cudaSuccess) return CudaError("cudaEventRecord (after allocating the output)", error);
    Pool().CountRecord();
    return absl::OkStatus();
  }

  static absl::Status WaitOnCompletion(tf::OpKernelContext* context, void* completion_event) {
    stream_executor::Stream* stream = nullptr;
    TF_RETURN_IF_ERROR(ComputeStream(context, &stream));
    cudaError_t error = cudaStreamWaitEvent(CudaStream(stream), static_cast<cudaEvent_t>(completion_event),
                                            0);
    if (error != cudaSuccess) return CudaError("cudaStreamWaitEvent (TF's stream on the collective)", error);
    return absl::OkStatus();
  }

  static void Release(const Device& device, void* event) {
    if (event != nullptr) Pool().Give(device.ordinal, static_cast<cudaEvent_t>(event));
  }
};

}  // namespace

GpuEventStats GetGpuEventStats() { return Pool().stats(); }

REGISTER_KERNEL_BUILDER(Name("NvgroupAllreduce").Device(tf::DEVICE_GPU), AllreduceOp<GpuTraits>);
REGISTER_KERNEL_BUILDER(Name("NvgroupGroupedAllreduce").Device(tf::DEVICE_GPU),
                        GroupedAllreduceOp<GpuTraits>);
REGISTER_KERNEL_BUILDER(Name("NvgroupAllgather").Device(tf::DEVICE_GPU), AllgatherOp<GpuTraits>);
REGISTER_KERNEL_BUILDER(Name("NvgroupBroadcast").Device(tf::DEVICE_GPU), BroadcastOp<GpuTraits>);

// The collectives of ops/nvgroup_negotiated_output_ops.cc (join is CPU only). Alltoall's
// splits and received splits stay in host memory.
REGISTER_KERNEL_BUILDER(Name("NvgroupReducescatter").Device(tf::DEVICE_GPU), ReducescatterOp<GpuTraits>);
REGISTER_KERNEL_BUILDER(Name("NvgroupGroupedReducescatter").Device(tf::DEVICE_GPU),
                        GroupedReducescatterOp<GpuTraits>);
REGISTER_KERNEL_BUILDER(
    Name("NvgroupAlltoall").Device(tf::DEVICE_GPU).HostMemory("splits").HostMemory("received_splits"),
    AlltoallOp<GpuTraits>);
REGISTER_KERNEL_BUILDER(Name("NvgroupGroupedAllgather").Device(tf::DEVICE_GPU),
                        GroupedAllgatherOp<GpuTraits>);

}  // namespace tf_adapter
}  // namespace nvgroup

#endif  // GOOGLE_CUDA
