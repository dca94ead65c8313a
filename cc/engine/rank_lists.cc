// Rank lists in error messages (rank_lists.h).
#include "engine/rank_lists.h"

namespace nvgroup {

std::string RanksText(const std::vector<int>& ranks) {
  std::string t = "[";
  for (size_t i = 0; i < ranks.size(); ++i) t += (i ? ", " : "") + std::to_string(ranks[i]);
  return t + "]";
}

std::string ValuesByRankText(const std::vector<std::string>& by_rank) {
  std::vector<std::string> values;
  std::vector<std::vector<int>> ranks;
  for (size_t r = 0; r < by_rank.size(); ++r) {
    size_t i = 0;
    while (i < values.size() && values[i] != by_rank[r]) ++i;
    if (i == values.size()) {
      values.push_back(by_rank[r]);
      ranks.emplace_back();
    }
    ranks[i].push_back(static_cast<int>(r));
  }
  std::string msg;
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) msg += ", ";
    if (ranks[i].size() == 1) {
      msg += "rank " + std::to_string(ranks[i][0]) + " has " + values[i];
    } else {
      msg += "ranks " + RanksText(ranks[i]) + " have " + values[i];
    }
  }
  return msg;
}

}  // namespace nvgroup
