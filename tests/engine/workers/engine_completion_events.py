"""The deferred completion path (Completion::CompleteAfterStream for CUDA
buckets, cc/engine/completion.cc) run by the CPU engine through
testing.host_completion_events: each bucket gets a host token that the
requests' completion_event_ready hears of before their `done`, and the names
leave the in-flight set at that point, so an adapter may resubmit them at once.
np = 1 to 4, one launch:
  1. one name submitted again right after each wait, many times: every element
     against the float64 reference, the same bits on every rank (a name left
     in flight makes the next submission fail as a duplicate);
  2. a group of names over several buckets, and an allgather with uneven rows,
     submitted again step after step;
  3. a registered group launched step after step (one event per launch);
  4. a rank whose tensor differs fails on every rank with the mismatch, and
     the same name is accepted again afterwards;
  5. every event was heard before its `done`, as many as submitted;
  6. after init() again without host events: the same data gives the same bits."""
import os
import time

import numpy as np
from mpi4py import MPI

from engine_common import E, check, check_close, expect_error, finish, rank_data, reference

comm = MPI.COMM_WORLD
WAIT_S = 30.0
STEPS = 12
os.environ["NVGROUP_FUSION_THRESHOLD"] = "4096"
E.testing.host_completion_events(True)
E.init()
rank, size = E.rank(), E.size()
# (name, shape, dtype, op): the group spans several 4 KiB buckets.
GROUP = [("ev/g%d" % i, [n], dt, op) for i, (n, dt, op) in enumerate(
    [(700, "float32", "sum"), (1500, "float32", "average"), (3, "int32", "sum"), (900, "float64", "max"),
     (2000, "float32", "sum"), (1, "int64", "min")])]


def same_bits_on_all_ranks(what, arrays):
    blob = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    check(len(set(comm.allgather(blob))) == 1, "%s: results differ across ranks" % what)


def allreduce_once(name, seed, shape=(513,), dtype="float32", op="sum"):
    x = rank_data(seed, rank, list(shape), dtype, op)
    y = np.zeros_like(x)
    E.wait(E.allreduce_async(name, x.ctypes.data, y.ctypes.data, list(shape), dtype, op), WAIT_S)
    check_close("%s seed %d" % (name, seed), y, reference(seed, size, list(shape), dtype, op), dtype)
    return y


def group_once(seed):
    xs = [rank_data(seed + i, rank, shape, dt, op) for i, (_, shape, dt, op) in enumerate(GROUP)]
    ys = [np.zeros_like(x) for x in xs]
    items = [(name, x.ctypes.data, y.ctypes.data, shape, dt, op, 1.0, 1.0, "cpu", 0)
             for (name, shape, dt, op), x, y in zip(GROUP, xs, ys)]
    E.wait_all(E.grouped_allreduce_async(items))
    for i, ((name, shape, dt, op), y) in enumerate(zip(GROUP, ys)):
        check_close("%s seed %d" % (name, seed), y, reference(seed + i, size, shape, dt, op), dt)
    return ys


def allgather_once(seed):
    rows = rank + 1
    x = rank_data(seed, rank, [rows, 3], "float32")
    y = E.wait(E.allgather_async("ev/ag", x.ctypes.data, [rows, 3], "float32"), WAIT_S)
    want = np.concatenate([rank_data(seed, r, [r + 1, 3], "float32") for r in range(size)])
    check(y.shape == want.shape and y.tobytes() == want.tobytes(), "ev/ag seed %d: allgather wrong" % seed)
    return y


def run_all(seed0):
    """Sections 1-3 on the current engine; returns every result in order."""
    out = []
    for step in range(STEPS):  # 1. the same name again right after each wait
        out.append(allreduce_once("ev/one", seed0 + step))
    for step in range(STEPS // 2):  # 2. a group over several buckets, an allgather
        out.extend(group_once(seed0 + 100 + 10 * step))
        out.append(allgather_once(seed0 + 200 + step))
    members = [(name, shape, dt, op, 1.0, 1.0) for name, shape, dt, op in GROUP]
    group = E.register_allreduce_group([(n.replace("ev/", "ev/reg/"), *rest) for n, *rest in members])
    for step in range(STEPS // 2):  # 3. a registered group, launch after launch
        seed = seed0 + 300 + 10 * step
        xs = [rank_data(seed + i, rank, shape, dt, op) for i, (_, shape, dt, op) in enumerate(GROUP)]
        ys = [np.zeros_like(x) for x in xs]
        ptr = lambda arrays: np.array([a.ctypes.data for a in arrays], dtype=np.uint64)  # noqa: E731
        E.wait(E.registered_group_allreduce_async(group, ptr(xs), ptr(ys)), WAIT_S)
        for i, ((name, shape, dt, op), y) in enumerate(zip(GROUP, ys)):
            check_close("registered %s seed %d" % (name, seed), y, reference(seed + i, size, shape, dt, op), dt)
        out.extend(ys)
    E.unregister_group(group)
    return out


results = run_all(1000)
same_bits_on_all_ranks("host events", results)
# Events heard: one per request of sections 1-2 (each a bucket or part of
# one), one per registered launch (section 3).
expected = STEPS + (STEPS // 2) * (len(GROUP) + 1) + STEPS // 2
heard, after_done = E.testing.completion_events_heard()
check(heard == expected, "completion_event_ready heard %d events, want %d" % (heard, expected))
check(after_done == 0, "%d events were heard after their done (or were null)" % after_done)

# 4. A mismatch fails on every rank; the name is accepted again afterwards.
if size > 1:
    shape = [9] if rank == size - 1 else [8]
    x = rank_data(5, rank, shape, "float32")
    y = np.zeros_like(x)
    start = time.monotonic()
    expect_error(lambda: E.wait(E.allreduce_async("ev/bad", x.ctypes.data, y.ctypes.data, shape, "float32"),
                                WAIT_S), "Mismatched", "ev/bad")
    check(time.monotonic() - start < 10, "the mismatch took %.1f s" % (time.monotonic() - start))
    allreduce_once("ev/bad", 6, shape=(8,))

# 6. The same data without host events: the same bits.
E.shutdown()
E.testing.host_completion_events(False)
E.init()
plain = run_all(1000)
check(len(plain) == len(results), "%d results without host events, %d with" % (len(plain), len(results)))
for i, (a, b) in enumerate(zip(results, plain)):
    check(a.tobytes() == b.tobytes(), "result %d differs bitwise with and without host events" % i)
heard, _ = E.testing.completion_events_heard()
check(heard == 0, "without host events completion_event_ready heard %d events" % heard)
E.shutdown()
finish()
