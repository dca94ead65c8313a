// How an Average reduction runs (averaging.h).
#include "engine/averaging.h"

namespace nvgroup {

bool AverageByPostscale(const ResponseMessage& r) {
  return IsFloatingPoint(r.dtype) || r.prescale_factor != 1.0 || r.postscale_factor != 1.0;
}

Reduction ReductionFor(const ResponseMessage& r, int size) {
  Reduction red{r.op, r.postscale_factor};
  if (red.op == ReduceOp::kAverage && AverageByPostscale(r)) {
    red.op = ReduceOp::kSum;
    red.postscale /= size;
  }
  return red;
}

}  // namespace nvgroup
