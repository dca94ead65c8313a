// CUDA error checks (only included by CUDA code). Clears CUDA's sticky
// last-error state for non-sticky errors by reading it, like NCCL's CUDACHECK.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common/checks.h"

#define NVG_CUDA_CHECK(call)                                                                             \
  do {                                                                                                   \
    cudaError_t _nvg_err = (call);                                                                       \
    if (_nvg_err != cudaSuccess) {                                                                       \
      (void)cudaGetLastError();                                                                          \
      return ::nvgroup::Status::Internal(std::string(#call) + " failed: " + cudaGetErrorName(_nvg_err) + \
                                         ": " + cudaGetErrorString(_nvg_err) + " at " +                  \
                                         ::nvgroup::SourceLocation(__FILE__, __LINE__));                 \
    }                                                                                                    \
  } while (0)

// After a kernel launch.
#define NVG_CUDA_CHECK_LAUNCH() NVG_CUDA_CHECK(cudaGetLastError())
