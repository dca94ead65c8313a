// Completion of requests: each request's `done` runs exactly once, with OK or
// the error. Host collectives complete at once on the background thread; CUDA
// collectives complete on the Finalizer's thread after their stream work
// (Engine::CompleteAfterStream in completion.cc, with one CompletionEvents
// event per bucket, completion_events.h), so the background loop keeps
// negotiating meanwhile.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace nvgroup {

// Runs `done` callbacks of CUDA requests after their stream work completes, on
// its own thread so the background loop keeps negotiating meanwhile. The
// destructor runs the jobs still queued, then joins.
class Finalizer {
 public:
  using Job = std::function<void()>;
  Finalizer() : thread_([this] { Run(); }) {}
  ~Finalizer();
  Finalizer(const Finalizer&) = delete;
  Finalizer& operator=(const Finalizer&) = delete;
  std::thread::id thread_id() const { return thread_.get_id(); }
  void Add(Job job);

 private:
  void Run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it uses exist
};

}  // namespace nvgroup
