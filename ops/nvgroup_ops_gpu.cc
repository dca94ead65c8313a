// DEVICE_GPU kernels: the same kernel bodies as the CPU (adapter.h) with GPU
// traits. Built only with GOOGLE_CUDA (setup.py with NVGROUP_WITH_CUDA=1).
//
// How it works. TF runs GPU kernels by enqueueing work on its compute stream;
// when ComputeAsync runs, the input is not necessarily computed yet. Prepare()
// records a cudaEvent on that stream; the engine makes its own stream wait for
// the event on the device (no host block, engine.h contract) and calls done
// only once the output is complete on the device, so TF may read the output on
// any stream afterwards. The event is destroyed when the last request of the
// op has completed (Completion in adapter.h).
#if GOOGLE_CUDA

#include <cuda_runtime_api.h>

#include "ops/adapter.h"
#include "ops/adapter_extra.h"
#include "tensorflow/core/framework/device_base.h"
#include "xla/stream_executor/stream.h"
#include "xla/stream_executor/stream_executor.h"

namespace nvgroup {
namespace tf_adapter {
namespace {

absl::Status CudaError(const char* what, cudaError_t error) {
  return absl::InternalError(std::string(what) + " failed: " + cudaGetErrorString(error));
}

absl::Status RecordEvent(cudaStream_t stream, void** event) {
  cudaEvent_t cuda_event = nullptr;
  cudaError_t error = cudaEventCreateWithFlags(&cuda_event, cudaEventDisableTiming);
  if (error != cudaSuccess) return CudaError("cudaEventCreateWithFlags", error);
  error = cudaEventRecord(cuda_event, stream);
  if (error != cudaSuccess) {
    cudaEventDestroy(cuda_event);
    return CudaError("cudaEventRecord", error);
  }
  *event = cuda_event;
  return absl::OkStatus();
}

struct GpuTraits {
  static absl::Status Prepare(tf::OpKernelContext* context, Device* device, void** event) {
    const tf::DeviceContext* device_context = context->op_device_context();
    if (device_context == nullptr || device_context->stream() == nullptr) {
      return absl::InternalError("nvgroup GPU kernel '" + context->op_kernel().name() +
                                 "' has no TensorFlow GPU stream");
    }
    stream_executor::Stream* stream = device_context->stream();
    auto cuda_stream = static_cast<cudaStream_t>(stream->platform_specific_handle().stream);
    *device = Device::Cuda(stream->parent()->device_ordinal());
    // The event must belong to the stream's device; this TF thread's current
    // device is put back afterwards.
    int previous_device = 0;
    cudaError_t error = cudaGetDevice(&previous_device);
    if (error != cudaSuccess) return CudaError("cudaGetDevice", error);
    error = cudaSetDevice(device->ordinal);
    if (error != cudaSuccess) return CudaError("cudaSetDevice", error);
    absl::Status status = RecordEvent(cuda_stream, event);
    error = cudaSetDevice(previous_device);
    if (status.ok() && error != cudaSuccess) {
      Release(*event);
      *event = nullptr;
      return CudaError("cudaSetDevice (restoring the caller's device)", error);
    }
    return status;
  }

  // Runs after the engine finished with the event; a failure here cannot be
  // reported to the op any more (its status is already final) and leaks nothing.
  static void Release(void* event) {
    if (event != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event));
  }
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("NvgroupAllreduce").Device(tf::DEVICE_GPU), AllreduceOp<GpuTraits>);
REGISTER_KERNEL_BUILDER(Name("NvgroupGroupedAllreduce").Device(tf::DEVICE_GPU),
                        GroupedAllreduceOp<GpuTraits>);
REGISTER_KERNEL_BUILDER(Name("NvgroupAllgather").Device(tf::DEVICE_GPU), AllgatherOp<GpuTraits>);
REGISTER_KERNEL_BUILDER(Name("NvgroupBroadcast").Device(tf::DEVICE_GPU), BroadcastOp<GpuTraits>);

// Collectives added for Horovod parity (ops/nvgroup_ops_extra.cc). Alltoall's
// splits and received splits stay in host memory.
REGISTER_KERNEL_BUILDER(Name("NvgroupReducescatter").Device(tf::DEVICE_GPU), ReducescatterOp<GpuTraits>);
REGISTER_KERNEL_BUILDER(Name("NvgroupGroupedReducescatter").Device(tf::DEVICE_GPU),
                        GroupedReducescatterOp<GpuTraits>);
REGISTER_KERNEL_BUILDER(
    Name("NvgroupAlltoall").Device(tf::DEVICE_GPU).HostMemory("splits").HostMemory("received_splits"),
    AlltoallOp<GpuTraits>);
REGISTER_KERNEL_BUILDER(Name("NvgroupGroupedAllgather").Device(tf::DEVICE_GPU), GroupedAllgatherOp<GpuTraits>);

}  // namespace tf_adapter
}  // namespace nvgroup

#endif  // GOOGLE_CUDA
