// Error-checking macros. Each turns a failing call into a Status carrying the
// library's own error text and file:line, and returns it from the enclosing
// function (which must return Status or StatusOr). Never exits or throws.
#pragma once

#include <cerrno>
#include <cstring>
#include <string>

#include "nvgroup/status.h"

namespace nvgroup {
std::string SourceLocation(const char* file, int line);  // "file.cc:123"
std::string MpiErrorString(int code);                     // MPI_Error_string text
}  // namespace nvgroup

#define NVG_RETURN_IF_ERROR(expr)      \
  do {                                 \
    ::nvgroup::Status _nvg_s = (expr); \
    if (!_nvg_s.ok()) return _nvg_s;   \
  } while (0)

// Adds one line of context ("while <what>") at this level.
#define NVG_RETURN_IF_ERROR_CTX(expr, what)            \
  do {                                                 \
    ::nvgroup::Status _nvg_s = (expr);                 \
    if (!_nvg_s.ok()) return _nvg_s.WithContext(what); \
  } while (0)

#define NVG_MPI_CHECK(call)                                                                          \
  do {                                                                                               \
    int _nvg_rc = (call);                                                                            \
    if (_nvg_rc != MPI_SUCCESS)                                                                      \
      return ::nvgroup::Status::Internal(std::string(#call) +                                        \
                                         " failed: " + ::nvgroup::MpiErrorString(_nvg_rc) + " at " + \
                                         ::nvgroup::SourceLocation(__FILE__, __LINE__));             \
  } while (0)

// For POSIX calls returning -1 and setting errno; retries on EINTR.
#define NVG_SYS_CHECK(call)                                                                                 \
  do {                                                                                                      \
    int _nvg_rc;                                                                                            \
    do {                                                                                                    \
      _nvg_rc = (call);                                                                                     \
    } while (_nvg_rc == -1 && errno == EINTR);                                                              \
    if (_nvg_rc == -1)                                                                                      \
      return ::nvgroup::Status::Internal(std::string(#call) + " failed: " + std::strerror(errno) + " at " + \
                                         ::nvgroup::SourceLocation(__FILE__, __LINE__));                    \
  } while (0)

// NVG_CUDA_CHECK lives in cc/common/cuda_checks.h so host-only code needs no CUDA headers.
