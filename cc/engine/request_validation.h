// Validation of a CollectiveRequest on the caller's thread, before it enters
// the queue (Enqueue/EnqueueGroup, nvgroup/engine.h): names, dtypes, shapes,
// devices, pointers and each collective type's own parameters. A bad request
// is rejected with kInvalidArgument or kUnimplemented naming the collective;
// the engine never sees it.
#pragma once

#include "nvgroup/engine.h"

namespace nvgroup {

// `size`: ranks of the request's process set. Allocates nothing when the
// request is good (it runs for every enqueue).
Status ValidateRequest(const CollectiveRequest& q, int size);
// A member of RegisterGroup (nvgroup/engine.h): the same checks but for the
// pointers and `done`, which each launch brings (its own, cheaper, checks:
// RegisteredGroups::Launch).
Status ValidateRegisteredMember(const CollectiveRequest& q, int size);

}  // namespace nvgroup
