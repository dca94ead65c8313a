// CompletionEvents: a pool of completion events, one recorded per bucket after
// its copy out (completion.cc, CompleteAfterStream), so that a bucket's
// requests complete when *their* work is done, not when the whole stream
// drains (bucket k no longer waits for bucket k+1), and so that an adapter can
// make its stream wait on the event (CollectiveRequest::completion_event_ready).
// Acquire on the background thread, Release on the finalizer thread once the
// host saw the event complete (a pending event is never re-recorded).
//
// Two kinds: CUDA events of one device (NVGROUP_WITH_CUDA builds), and host
// tokens (kHostTokens): distinct addresses that stand for an event which is
// complete when recorded, for the host communicator's RecordEvent and
// WaitRecordedEvent (both no-ops). Host tokens let the CPU engine take the
// CUDA completion path in tests (Completion::StartHostEvents).
#pragma once

#include <mutex>
#include <vector>

#include "nvgroup/status.h"

namespace nvgroup {

class CompletionEvents {
 public:
  static constexpr int kHostTokens = -1;
  // `device`: the CUDA ordinal whose events these are, or kHostTokens.
  explicit CompletionEvents(int device) : device_(device) {}
  ~CompletionEvents();  // frees every event (none may be pending)
  CompletionEvents(const CompletionEvents&) = delete;
  CompletionEvents& operator=(const CompletionEvents&) = delete;

  StatusOr<void*> Acquire();
  void Release(void* event);

 private:
  StatusOr<void*> Create();  // a new event of this pool's kind
  void Destroy(void* event);

  const int device_;
  std::mutex mu_;
  std::vector<void*> free_;
  std::vector<void*> all_;
};

}  // namespace nvgroup
