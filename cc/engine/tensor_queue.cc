#include "engine/tensor_queue.h"

#include <chrono>

namespace nvgroup {

Status TensorQueue::Push(std::vector<TensorEntry> entries) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!closed_.ok()) return closed_;
    std::unordered_set<std::string> batch;
    for (const TensorEntry& e : entries) {
      const std::string& name = e.request.name;
      if (in_flight_.count(name) || !batch.insert(name).second)
        return Status::InvalidArgument("duplicate name: a collective named '" + name +
                                       "' is already in flight on this rank; names must be unique "
                                       "until the previous request completes");
    }
    for (TensorEntry& e : entries) {
      in_flight_.insert(e.request.name);
      queued_.push_back(std::move(e));
    }
  }
  // Wakes the loop out of its cycle wait: ordered after the push by the mutex.
  cv_.notify_one();
  return Status::Ok();
}

void TensorQueue::WaitAndPop(double timeout_s, std::vector<TensorEntry>* out, bool* shutdown_requested) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::duration<double>(timeout_s),
               [this] { return !queued_.empty() || shutdown_requested_; });
  for (TensorEntry& e : queued_) out->push_back(std::move(e));
  queued_.clear();
  *shutdown_requested = shutdown_requested_;
}

void TensorQueue::RequestShutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_requested_ = true;
  }
  cv_.notify_one();
}

void TensorQueue::Finish(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  in_flight_.erase(name);
}

std::vector<TensorEntry> TensorQueue::Close(const Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = status;
  std::vector<TensorEntry> left;
  left.swap(queued_);
  return left;
}

}  // namespace nvgroup
