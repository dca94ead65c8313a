// Status: how every error in the engine travels, from the failing MPI/CUDA/system
// call up to the one conversion point in each front end (ops/ ToTfStatus, the
// pybind11 module's exception translation, the benchmark's exit code).
//
// Rules:
//  * No exit/abort/throw inside the engine. Functions return Status or StatusOr.
//  * Messages carry the failing library's own text and file:line (NVG_*_CHECK in
//    cc/common/checks.h) and one line of context per level (NVG_RETURN_IF_ERROR).
//  * A cross-rank mismatch becomes the *same* Status on every rank.
#pragma once

#include <string>
#include <utility>

namespace nvgroup {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,     // bad input from the caller on this rank
  kFailedPrecondition = 2,  // cross-rank mismatch (shape/dtype/op/root), use before init
  kAborted = 3,             // engine shut down with the request in flight
  kUnavailable = 4,         // a peer rank died or became unreachable
  kDeadlineExceeded = 5,    // a wait outlived its timeout (stall shutdown time)
  kInternal = 6,            // MPI/CUDA/system call failed
  kUnimplemented = 7,       // dtype/op/device combination not supported
};

const char* StatusCodeName(StatusCode code);

class Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status FailedPrecondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
  static Status Aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
  static Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
  static Status DeadlineExceeded(std::string m) { return {StatusCode::kDeadlineExceeded, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
  static Status Unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

  // Returns a copy whose message is prefixed with one line of context.
  Status WithContext(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// A value or the Status explaining why there is none.
template <typename T>
class StatusOr {
 public:
  StatusOr(Status status) : status_(std::move(status)) {}  // NOLINT: implicit by design
  StatusOr(T value) : value_(std::move(value)) {}           // NOLINT: implicit by design
  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() { return value_; }
  const T& value() const { return value_; }
  T&& consume() { return std::move(value_); }

 private:
  Status status_;
  T value_{};
};

}  // namespace nvgroup
