// Stall inspector: rank 0 watches names that some ranks reported and others
// have not, the classic cause of a hung data-parallel job (a rank took another
// branch, or names differ across ranks).
//
// How it works. The coordinator tells it when a rank reports a name and when a
// name completes or is dropped. Check() (called every loop cycle on rank 0)
// logs one warning per name once it has waited NVGROUP_STALL_WARNING_TIME,
// naming the ranks that have it and those that do not, and returns the names
// that have waited NVGROUP_STALL_SHUTDOWN_TIME (when > 0) with an error text;
// the coordinator turns those into error responses delivered to every rank.
// Names reported through the cache path reach rank 0 too: a cached request
// that is not ready everywhere within a short time is reported to rank 0
// (see Note [Reporting stuck cache hits] in negotiation.h).
#pragma once

#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace nvgroup {

class StallInspector {
 public:
  // warning_s / shutdown_s: 0 disables the warning / the error.
  StallInspector(int size, double warning_s, double shutdown_s);

  void RecordReport(const std::string& name, int rank, double now);
  void Remove(const std::string& name);

  struct Stalled {
    std::string name;
    std::string message;  // "Stalled ranks: tensor 'x' is ready on ranks [..] but missing on [..] for N s"
  };
  // Logs new warnings; returns (and forgets) the names past the shutdown time.
  std::vector<Stalled> Check(double now);

 private:
  struct Entry {
    double first_report = 0;
    std::vector<bool> reported;
    bool warned = false;
  };
  std::string Describe(const std::string& name, const Entry& e, double now) const;

  int size_;
  double warning_s_;
  double shutdown_s_;
  double next_check_ = 0;  // Check() looks at the table at most every kCheckIntervalS
  std::unordered_map<std::string, Entry> entries_;
};

}  // namespace nvgroup
