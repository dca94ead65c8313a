// Rank lists in error messages: "[0, 2, 3]" and "rank 0 has A, ranks [1, 3]
// have B" (each rank's value, ranks grouped by value). Every message of the
// engine that names ranks (knob mismatches at Init, negotiation mismatches,
// process-set registration, silent peers) is built from these, so they all
// read the same.
#pragma once

#include <string>
#include <vector>

namespace nvgroup {

// "[0, 2, 3]".
std::string RanksText(const std::vector<int>& ranks);

// "rank 0 has A, ranks [1, 3] have B, ..." where by_rank[r] is rank r's value:
// ranks grouped by value, groups in order of first appearance.
std::string ValuesByRankText(const std::vector<std::string>& by_rank);

}  // namespace nvgroup
