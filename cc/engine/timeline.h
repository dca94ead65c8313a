// Timeline: a Chrome trace (chrome://tracing, Perfetto) of each tensor's life,
// written by rank 0 when NVGROUP_TIMELINE names a file.
//
// How it works. Every tensor gets its own row (a trace "thread" named after the
// tensor) and a sequence of phases, each a "B"/"E" event pair with microsecond
// timestamps since Open:
//   QUEUE            Enqueue -> the background loop picks it up
//   NEGOTIATE        picked up -> its response is known on every rank
//   FUSION_COPY_IN   batched scaled copy into the registered buffer (fused allreduce)
//   ALLREDUCE | ALLGATHER | BROADCAST   the communicator call
//   FUSION_COPY_OUT  batched scaled copy out of the registered buffer (fused allreduce)
// With start_timeline(mark_cycles=True), each cycle that executes collectives
// also gets a global instant event CYCLE_START ("ph": "i", "s": "g").
// For CUDA the communicator phases measure the host enqueue, not device time.
// The file is a JSON array: "[" at Open, one event per line joined by commas,
// "]" at Close, so it parses after every clean Shutdown. Only the background
// thread writes, so there is no lock.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <unordered_map>

#include "nvgroup/status.h"

namespace nvgroup {

class Timeline {
 public:
  Timeline() = default;
  ~Timeline() { Close(); }
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  // `start_s` is the engine clock's value that becomes timestamp 0.
  Status Open(const std::string& path, double start_s);
  bool enabled() const { return file_ != nullptr; }
  // `at_s`: engine clock (seconds).
  void Begin(const std::string& tensor, const char* phase, double at_s) { Event(tensor, phase, 'B', at_s); }
  void End(const std::string& tensor, const char* phase, double at_s) { Event(tensor, phase, 'E', at_s); }
  // A global instant event "CYCLE_START" (start_timeline(mark_cycles=True)).
  void MarkCycle(double at_s);
  void Close();

 private:
  void Event(const std::string& tensor, const char* phase, char kind, double at_s);
  void Write(const std::string& text);

  FILE* file_ = nullptr;
  std::string path_;
  double start_s_ = 0;
  bool first_event_ = true;
  std::unordered_map<std::string, int> rows_;  // tensor name -> trace tid
};

}  // namespace nvgroup
