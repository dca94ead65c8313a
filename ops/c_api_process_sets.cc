// extern "C" entry points for process sets (nvgroup_tf/process_sets.py calls
// them through ctypes on the op library, like ops/c_api.cc). Each returns the
// engine's StatusCode (0 = OK) and writes the message into `msg` on error.
#include <cstdint>
#include <cstring>
#include <vector>

#include "nvgroup/engine.h"

namespace {

int ReportStatus(const nvgroup::Status& status, char* msg, int msg_len) {
  if (msg != nullptr && msg_len > 0) {
    std::strncpy(msg, status.message().c_str(), static_cast<size_t>(msg_len) - 1);
    msg[msg_len - 1] = '\0';
  }
  return static_cast<int>(status.code());
}

}  // namespace

extern "C" {

int nvgroup_tf_add_process_set(const int* ranks, int count, int* id, char* msg, int msg_len) {
  std::vector<int> r(ranks, ranks + (count > 0 ? count : 0));
  nvgroup::StatusOr<int32_t> added = nvgroup::AddProcessSet(r);
  if (added.ok()) *id = added.value();
  return ReportStatus(added.status(), msg, msg_len);
}

int nvgroup_tf_remove_process_set(int id, char* msg, int msg_len) {
  return ReportStatus(nvgroup::RemoveProcessSet(id), msg, msg_len);
}

// Writes up to `capacity` ranks; *count receives the set's size.
int nvgroup_tf_process_set_ranks(int id, int* ranks, int capacity, int* count, char* msg, int msg_len) {
  nvgroup::StatusOr<std::vector<int>> r = nvgroup::ProcessSetRanks(id);
  if (r.ok()) {
    *count = static_cast<int>(r.value().size());
    for (int i = 0; i < *count && i < capacity; ++i) ranks[i] = r.value()[i];
  }
  return ReportStatus(r.status(), msg, msg_len);
}

int nvgroup_tf_process_set_rank(int id, int* out, char* msg, int msg_len) {
  nvgroup::StatusOr<int> r = nvgroup::ProcessSetRank(id);
  if (r.ok()) *out = r.value();
  return ReportStatus(r.status(), msg, msg_len);
}

}  // extern "C"
