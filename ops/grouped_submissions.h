// What the grouped allreduces of the TF adapter did: the TF kernels
// (ops/adapter.h, Note [Grouped kernels launch a registered group]) and the
// XLA calls (ops/xla_ops.h, Note [Calls launch registered groups]) count
// here; c_api.cc exports the counts for tests and benchmarks.
#pragma once

#include <cstdint>

#include "nvgroup/status.h"

namespace nvgroup {
namespace tf_adapter {

struct GroupedSubmissionStats {
  int64_t registrations = 0;  // RegisterGroup calls that succeeded
  int64_t launches = 0;       // steps submitted as a launch of a registration
  int64_t by_name = 0;        // steps of a grouped allreduce submitted by name (EnqueueGroup)
};
GroupedSubmissionStats GetGroupedSubmissionStats();

enum class GroupedSubmission { kRegistration, kLaunch, kByName };
void CountGroupedSubmission(GroupedSubmission what);

// NVGROUP_TF_REGISTERED_GROUPS (the settings table, cc/common/env.h), parsed
// once per process for the kernels and the XLA calls alike.
StatusOr<bool> RegisteredGroupsEnabled();

}  // namespace tf_adapter
}  // namespace nvgroup
