// CompletionEvents: a pool of CUDA events, one recorded per bucket after its
// copy out (completion.cc, CompleteAfterStream), so that a bucket's
// requests complete when *their* work is done, not when the whole stream
// drains (bucket k no longer waits for bucket k+1), and so that an adapter can
// make its stream wait on the event (CollectiveRequest::completion_event_ready).
// Acquire on the background thread, Release on the finalizer thread once the
// host saw the event complete (a pending event is never re-recorded).
// Implemented for NVGROUP_WITH_CUDA builds (completion_events.cc).
#pragma once

#include <mutex>
#include <vector>

#include "nvgroup/status.h"

namespace nvgroup {

class CompletionEvents {
 public:
  explicit CompletionEvents(int device) : device_(device) {}
#ifdef NVGROUP_WITH_CUDA
  ~CompletionEvents();  // destroys every event (none may be pending)
#else
  ~CompletionEvents() = default;  // never created without CUDA
#endif
  StatusOr<void*> Acquire();
  void Release(void* event);

 private:
  const int device_;
  std::mutex mu_;
  std::vector<void*> free_;
  std::vector<void*> all_;
};

}  // namespace nvgroup
