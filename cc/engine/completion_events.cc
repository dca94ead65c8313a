// CUDA part of the engine compiled in every build (so every build script picks
// it up with the other engine sources); empty without NVGROUP_WITH_CUDA.
#include "engine/completion_events.h"

#ifdef NVGROUP_WITH_CUDA
#include <cuda_runtime.h>

#include "common/cuda_checks.h"

namespace nvgroup {

CompletionEvents::~CompletionEvents() {
  if (all_.empty()) return;
  (void)cudaSetDevice(device_);
  for (void* e : all_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(e));
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
  NVG_CUDA_CHECK(cudaSetDevice(device_));
  cudaEvent_t e = nullptr;
  NVG_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  std::lock_guard<std::mutex> lock(mu_);
  all_.push_back(e);
  return static_cast<void*>(e);
}

void CompletionEvents::Release(void* event) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(event);
}

}  // namespace nvgroup
#endif  // NVGROUP_WITH_CUDA
