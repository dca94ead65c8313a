// The event pool of completion_events.h, in every build; the CUDA events only
// with NVGROUP_WITH_CUDA.
#include "engine/completion_events.h"

#ifdef NVGROUP_WITH_CUDA
#include <cuda_runtime.h>

#include "common/cuda_checks.h"
#endif

namespace nvgroup {

CompletionEvents::~CompletionEvents() {
#ifdef NVGROUP_WITH_CUDA
  if (device_ != kHostTokens && !all_.empty()) (void)cudaSetDevice(device_);
#endif
  for (void* e : all_) Destroy(e);
}

StatusOr<void*> CompletionEvents::Acquire() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      void* e = free_.back();
      free_.pop_back();
      return e;
    }
  }
  StatusOr<void*> e = Create();
  if (!e.ok()) return e;
  std::lock_guard<std::mutex> lock(mu_);
  all_.push_back(e.value());
  return e;
}

void CompletionEvents::Release(void* event) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(event);
}

StatusOr<void*> CompletionEvents::Create() {
  if (device_ == kHostTokens) return static_cast<void*>(new char(0));
#ifdef NVGROUP_WITH_CUDA
  NVG_CUDA_CHECK(cudaSetDevice(device_));
  cudaEvent_t e = nullptr;
  NVG_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return static_cast<void*>(e);
#else
  return Status::Unimplemented("CUDA completion events need a CUDA build");
#endif
}

void CompletionEvents::Destroy(void* event) {
  if (device_ == kHostTokens) {
    delete static_cast<char*>(event);
    return;
  }
#ifdef NVGROUP_WITH_CUDA
  (void)cudaEventDestroy(static_cast<cudaEvent_t>(event));
#endif
}

}  // namespace nvgroup
