"""Admission batching and lone requests (Note [Lone requests skip the gap] in
cc/engine/tensor_queue.h), np = 2 or 3, one launch:
  1. a caller in lock-step (one allreduce_async, then wait, repeated) stops
     waiting for a quiet gap after a few takes: every later request is taken
     at once (stats: lone_requests_not_batched), results right every call;
  2. a burst of allreduce_async calls (each pushed while the earlier ones are
     in flight) turns the batching back on: at most the burst's first take
     skips the gap, and every result is right;
  3. lock-step again: lone requests skip the gap again after the same few
     takes;
  4. the same burst repeated (Note [A repeated burst ends the gap]: the
     batching ends at its size), then a larger one (cut short, its rest in
     the next cycle), then the first again: every result is right."""
import numpy as np
from mpi4py import MPI

from engine_common import E, check, check_close, finish, rank_data, reference

comm = MPI.COMM_WORLD
E.init()
rank, size = E.rank(), E.size()
LONE_TAKES = 4  # TensorQueue::kLoneTakesBeforeNoBatching


def lone_calls(prefix, calls, seed):
    for i in range(calls):
        shape = [1 + (i * 5) % 9]
        x = rank_data(seed + i, rank, shape, "float32")
        y = np.zeros_like(x)
        E.wait(E.allreduce_async(prefix, x.ctypes.data, y.ctypes.data, shape, "float32"))
        check_close("%s call %d" % (prefix, i), y, reference(seed + i, size, shape, "float32", "sum"), "float32")


def burst(prefix, n, seed):
    xs = [rank_data(seed + i, rank, [3 + i], "float32") for i in range(n)]
    ys = [np.zeros_like(x) for x in xs]
    hs = [E.allreduce_async("%s/%d" % (prefix, i), x.ctypes.data, y.ctypes.data, [3 + i], "float32")
          for i, (x, y) in enumerate(zip(xs, ys))]
    E.wait_all(hs)
    for i, y in enumerate(ys):
        check_close("%s/%d" % (prefix, i), y, reference(seed + i, size, [3 + i], "float32", "sum"), "float32")


def not_batched():
    return E.stats()["lone_requests_not_batched"]


# 1. Lock-step: after LONE_TAKES lone takes, every request is taken at once.
calls = 24
n0 = not_batched()
lone_calls("lone", calls, 100)
got = not_batched() - n0
check(got >= calls - LONE_TAKES - 1,
      "lock-step: %d of %d lone requests skipped the admission gap, expected at least %d"
      % (got, calls, calls - LONE_TAKES - 1))

# 2. A burst: pushes while earlier requests are in flight turn batching back on.
n1 = not_batched()
burst("burst", 12, 300)
got = not_batched() - n1
check(got <= 1, "burst: %d takes skipped the admission gap, expected at most the first" % got)

# 3. Lock-step again.
n2 = not_batched()
lone_calls("again", calls, 500)
got = not_batched() - n2
check(got >= calls - LONE_TAKES - 1,
      "lock-step after a burst: %d of %d skipped the gap, expected at least %d" % (got, calls, calls - LONE_TAKES - 1))

# 4. Repeated bursts of one size: once two quiet takes agree on the size, the
# batching ends at it; then a larger one, the first size again.
def ended_at_size():
    return E.stats()["bursts_ended_at_size"]


n3 = ended_at_size()
for step in range(12):
    burst("same%d" % step, 10, 700 + 20 * step)
got = ended_at_size() - n3
check(got >= 1, "12 bursts of 10 requests: no take ended at the repeated size (%d)" % got)
for step, n in enumerate([16, 10, 10, 10, 16, 16, 16]):
    burst("rep%d" % step, n, 1000 + 20 * step)

E.shutdown()
finish()
