// AbortSignal: the engine's abort (engine_control.h) as one object: the flag
// every negotiation wait polls, the first reason given, and the communicators
// whose spin waits an abort must end.
//
// Protocol (mu_): Raise, Cause and Close take mu_. The communicators are
// registered by Execution (execution.h) when it creates them and stay valid
// until Close: Execution calls Close before it frees them, and Raise after
// Close does nothing, so Raise never touches a communicator being freed.
// The flag is raised after the reason is written (both under mu_); the
// loop reads the reason under mu_ once the flag made it stop.
#pragma once

#include <atomic>
#include <mutex>

#include "nvgroup/communicator.h"
#include "nvgroup/status.h"

namespace nvgroup {

class AbortSignal {
 public:
  // Polled by every negotiation wait (WaitMpi, mpi_wait.h).
  const std::atomic<bool>& flag() const { return raised_; }
  bool raised() const { return raised_.load(); }

  // The communicators Raise aborts: the CPU one from the start, the CUDA one
  // once created.
  void WatchCpu(Communicator* cpu) { cpu_ = cpu; }
  void WatchCuda(Communicator* cuda) { cuda_ = cuda; }

  // Engine::Abort (any thread): the first reason wins; after Close nothing.
  // Raises the flag and ends the communicators' spin waits (they return
  // kAborted from then on).
  void Raise(const Status& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!reason_.ok() || closed_) return;
    reason_ = reason.ok() ? Status::Aborted("nvgroup_tf was aborted") : reason;
    raised_ = true;
    cpu_->Abort();
    if (Communicator* c = cuda_.load()) c->Abort();
  }

  // Engine::Stop when the loop did not leave in time: the flag and the CPU
  // communicator only, with no reason (the loop is stuck in a wait).
  void RaiseWithoutReason() {
    raised_ = true;
    cpu_->Abort();
  }

  // `s`, or the reason given to Raise when there is one: after an abort
  // (e.g. a peer died) every failure is a consequence of it.
  Status Cause(const Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    return reason_.ok() ? s : reason_;
  }

  // Before the communicators are freed: later Raises do nothing.
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }

 private:
  std::atomic<bool> raised_{false};
  std::mutex mu_;   // guards the two below and the communicators' lifetime for Raise
  Status reason_;   // why Raise was called (OK if it was not)
  bool closed_ = false;
  Communicator* cpu_ = nullptr;
  std::atomic<Communicator*> cuda_{nullptr};
};

}  // namespace nvgroup
