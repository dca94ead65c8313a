// EnqueueAndWait (nvgroup/engine.h): Enqueue/EnqueueGroup plus a wait for the
// requests' done callbacks. Nothing of the engine's own runs here.
#include <condition_variable>
#include <memory>
#include <mutex>
#include <utility>

#include "nvgroup/engine.h"

namespace nvgroup {

Status EnqueueAndWait(std::vector<CollectiveRequest> requests) {
  struct Waiter {
    std::mutex mu;
    std::condition_variable cv;
    size_t pending = 0;
    Status first_error;
  };
  // Shared with the callbacks: an engine thread may still be inside the last
  // callback (after notify) when this function returns.
  auto waiter = std::make_shared<Waiter>();
  waiter->pending = requests.size();
  for (CollectiveRequest& request : requests) {
    request.done = [waiter](const Status& status) {
      std::lock_guard<std::mutex> lock(waiter->mu);
      if (!status.ok() && waiter->first_error.ok()) waiter->first_error = status;
      if (--waiter->pending == 0) waiter->cv.notify_all();
    };
  }
  const size_t count = requests.size();
  Status submitted = count == 1 ? Enqueue(std::move(requests[0])) : EnqueueGroup(std::move(requests));
  if (!submitted.ok()) return submitted;  // rejected: no callback will run
  std::unique_lock<std::mutex> lock(waiter->mu);
  waiter->cv.wait(lock, [&] { return waiter->pending == 0; });
  return waiter->first_error;
}

}  // namespace nvgroup
