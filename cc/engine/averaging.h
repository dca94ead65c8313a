// How an Average reduction runs (allreduce and reducescatter, execution.cc):
// floats always, and integers when a scale factor is given (as Horovod's
// ScaleBuffer does), run as Sum with the division by the ranks folded into the
// postscale; integers without scale factors use the communicator's own
// (truncating) average.
#pragma once

#include "engine/wire_format.h"
#include "nvgroup/engine.h"

namespace nvgroup {

// Whether an Average of `r` runs as Sum with postscale / size rather than the
// communicator's truncating integer average.
bool AverageByPostscale(const ResponseMessage& r);

// The op and postscale the communicator is called with for `r` over `size`
// ranks: r's own, or Sum and postscale / size when AverageByPostscale.
struct Reduction {
  ReduceOp op;
  double postscale;
};
Reduction ReductionFor(const ResponseMessage& r, int size);

}  // namespace nvgroup
