#include "engine/stall_inspector.h"

#include <cmath>

#include "common/logging.h"

namespace nvgroup {
namespace {

std::string RankList(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

}  // namespace

StallInspector::StallInspector(int size, double warning_s, double shutdown_s)
    : size_(size), warning_s_(warning_s), shutdown_s_(shutdown_s) {}

void StallInspector::RecordReport(const std::string& name, int rank, double now) {
  auto [it, inserted] = entries_.try_emplace(name);
  if (inserted) {
    it->second.first_report = now;
    it->second.reported.assign(size_, false);
  }
  if (rank >= 0 && rank < size_) it->second.reported[rank] = true;
}

void StallInspector::Remove(const std::string& name) { entries_.erase(name); }

std::string StallInspector::Describe(const std::string& name, const Entry& e, double now) const {
  std::vector<int> ready, missing;
  for (int r = 0; r < size_; ++r) (e.reported[r] ? ready : missing).push_back(r);
  return "Stalled ranks: tensor '" + name + "' is ready on ranks " + RankList(ready) + " but missing on " +
         RankList(missing) + " for " +
         std::to_string(static_cast<long long>(std::floor(now - e.first_report))) + " s";
}

std::vector<StallInspector::Stalled> StallInspector::Check(double now) {
  // Stall times are whole seconds; looking every 100 ms is precise enough and
  // keeps a 1 kHz loop from scanning a large table every cycle.
  constexpr double kCheckIntervalS = 0.1;
  std::vector<Stalled> stalled;
  if (now < next_check_) return stalled;
  next_check_ = now + kCheckIntervalS;
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& e = it->second;
    double waited = now - e.first_report;
    if (shutdown_s_ > 0 && waited >= shutdown_s_) {
      stalled.push_back({it->first, Describe(it->first, e, now) +
                                        "; failing it because NVGROUP_STALL_SHUTDOWN_TIME is " +
                                        std::to_string(shutdown_s_) + " s"});
      it = entries_.erase(it);
      continue;
    }
    if (warning_s_ > 0 && waited >= warning_s_ && !e.warned) {
      e.warned = true;
      NVG_LOG(kWarning) << Describe(it->first, e, now)
                        << " (collective names must be identical on every rank; "
                           "NVGROUP_STALL_WARNING_TIME sets this warning's delay)";
    }
    ++it;
  }
  return stalled;
}

}  // namespace nvgroup
