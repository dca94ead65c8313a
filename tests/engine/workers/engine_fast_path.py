"""The engine's fast path, np = 2 or 3, one launch:
  1. a grouped collective repeated over steps runs from its cached plan
     (stats: plan_launches, no negotiation), results checked every step
     against a float64 reference, every element, and bitwise across ranks;
     it is one queue entry, admitted and run whole (b); two cached groups
     and a lone tensor in one burst, one rank giving a group in another
     order (c); a rank 1.5 s late (d); one rank's changed member (e);
  2. the group changed (one member's shape, then one member more): it
     negotiates again, the results are right, and the new group gets a plan;
  3. lone tensors run on the fused path (results, prescale/postscale, average);
  4. a bucket waits once per distinct ready event (CPU: WaitEvent is a no-op,
     the counter still counts the calls);
  5. a burst of one allreduce_async per tensor, then wait_all; the forms of a
     grouped_allreduce_async item give the same results and errors (5b), and
     so do the forms of an allreduce_async call (5c);
  6. last: one rank's cache/plan digest is perturbed: the next collective
     fails on every rank naming the cause (never a wrong result or a hang),
     and a later init works again."""
import hashlib

import numpy as np
from mpi4py import MPI

from engine_common import E, check, check_close, expect_error, finish, rank_data, reference

comm = MPI.COMM_WORLD
E.init()
rank, size = E.rank(), E.size()


def digest_same_on_all_ranks(arrays, what):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    digests = comm.allgather(h.hexdigest())
    check(len(set(digests)) == 1, "%s: outputs differ across ranks" % what)


def run_group(prefix, shapes, seed, op="sum", dtype="float32", events=None):
    xs = [rank_data(seed + i, rank, s, dtype, op) for i, s in enumerate(shapes)]
    ys = [np.zeros_like(x) for x in xs]
    items = []
    for i, (x, y) in enumerate(zip(xs, ys)):
        ev = 0 if events is None else events[i]
        items.append(("%s/%d" % (prefix, i), x.ctypes.data, y.ctypes.data, list(x.shape), dtype, op, 1.0, 1.0,
                      "cpu", ev))
    E.wait_all(E.grouped_allreduce_async(items))
    for i, (s, y) in enumerate(zip(shapes, ys)):
        check_close("%s/%d" % (prefix, i), y, reference(seed + i, size, s, dtype, op), dtype)
    digest_same_on_all_ranks(ys, prefix)
    return ys


def delta(before, after, key):
    return after[key] - before[key]


# 1. Repeated grouped collective: plan after the first run, then every step from it.
shapes = [[7], [33, 3], [1], [100], [2, 2, 2], [16]]
run_group("g", shapes, 10)  # negotiated, plan made
s0 = E.stats()
steps = 5
for step in range(steps):
    run_group("g", shapes, 10 + step * 0)  # same data every step: the same reference
s1 = E.stats()
check(delta(s0, s1, "plan_launches") == steps, "plan launches %d, expected %d" % (delta(s0, s1, "plan_launches"), steps))
check(delta(s0, s1, "negotiated_responses") == 0, "a cached group negotiated again (%d responses)"
      % delta(s0, s1, "negotiated_responses"))
check(delta(s0, s1, "cached_responses") == steps * len(shapes), "cached responses %d" % delta(s0, s1, "cached_responses"))

# 1b. Group-level bookkeeping (Note [Cached groups]): each step of the cached
#     group is one queue entry, admitted whole (no member admitted one by one)
#     and run whole from its plan.
check(delta(s0, s1, "queue_entries") == steps, "queue entries %d for %d steps" % (delta(s0, s1, "queue_entries"), steps))
check(delta(s0, s1, "admitted_entries") == 0, "%d members admitted one by one" % delta(s0, s1, "admitted_entries"))
check(delta(s0, s1, "groups_not_batched") == steps, "a group waited out the admission gap (%d of %d did not)"
      % (delta(s0, s1, "groups_not_batched"), steps))
check(delta(s0, s1, "cached_group_admissions") == steps and delta(s0, s1, "cached_group_runs") == steps,
      "cached groups admitted %d, run %d, expected %d" % (delta(s0, s1, "cached_group_admissions"),
                                                          delta(s0, s1, "cached_group_runs"), steps))


def submit_group(prefix, shapes, seed, order):
    """One grouped_allreduce_async with the members in `order`; returns (handles, ys, check)."""
    xs = [rank_data(seed + i, rank, sh, "float32") for i, sh in enumerate(shapes)]
    ys = [np.zeros_like(x) for x in xs]
    items = [("%s/%d" % (prefix, i), xs[i].ctypes.data, ys[i].ctypes.data, list(shapes[i]), "float32")
             for i in order]

    def verify():
        for i, (sh, y) in enumerate(zip(shapes, ys)):
            check_close("%s/%d" % (prefix, i), y, reference(seed + i, size, sh, "float32", "sum"), "float32")
        digest_same_on_all_ranks(ys, prefix)
    return E.grouped_allreduce_async(items), (xs, ys), verify


# 1c. Two cached groups and a lone tensor in one burst, the last rank giving
#     group B's members in another order than its plan's (so it admits B
#     entry by entry) and the groups in the other order: every rank runs the
#     same plans in the same order whichever way it admitted them.
shapes_a, shapes_b = [[5], [40, 2], [3], [64]], [[9], [1], [17, 3]]
lone_x = rank_data(620, rank, [11], "float32")
lone_y = np.zeros_like(lone_x)
last = rank == size - 1


def mixed_step(shuffled):
    order_b = list(range(len(shapes_b)))[::-1] if shuffled and last else list(range(len(shapes_b)))
    keep = {}
    hs = []
    for name in (("b", "a") if shuffled and last else ("a", "b")):
        h, bufs, verify = (submit_group("mixA", shapes_a, 600, range(len(shapes_a))) if name == "a"
                           else submit_group("mixB", shapes_b, 610, order_b))
        hs += h
        keep[name] = (bufs, verify)
        if name == "a":
            hs.append(E.allreduce_async("mixL", lone_x.ctypes.data, lone_y.ctypes.data, [11], "float32"))
    E.wait_all(hs)
    for name in ("a", "b"):  # the same order on every rank (the digests are compared collectively)
        keep[name][1]()
    check_close("mixL", lone_y, reference(620, size, [11], "float32", "sum"), "float32")


mixed_step(False)  # negotiated; both plans made in the given order
mixed_step(False)
a = E.stats()
for step in range(steps):
    mixed_step(True)
b = E.stats()
check(delta(a, b, "plan_launches") == 2 * steps, "mixed: %d plan launches, expected %d" % (delta(a, b, "plan_launches"), 2 * steps))
check(delta(a, b, "negotiated_responses") == 0, "mixed: negotiated %d" % delta(a, b, "negotiated_responses"))
expect_whole = steps if last else 2 * steps
expect_single = steps * (1 + (len(shapes_b) if last else 0))
check(delta(a, b, "cached_group_runs") == expect_whole and delta(a, b, "admitted_entries") == expect_single,
      "mixed: %d groups run whole (expected %d), %d entries admitted one by one (expected %d)"
      % (delta(a, b, "cached_group_runs"), expect_whole, delta(a, b, "admitted_entries"), expect_single))

# 1d. The last rank submits a cached group 1.5 s late: the others' whole group
#     is turned back into entries and reported (Note [Reporting stuck cache
#     hits]), then completes right when the late rank comes.
comm.Barrier()
a = E.stats()
if last:
    import time
    time.sleep(1.5)
h, bufs, verify = submit_group("mixA", shapes_a, 600, range(len(shapes_a)))
E.wait_all(h)
verify()
b = E.stats()
if not last:
    check(delta(a, b, "cached_group_demotions") == 1, "late peer: %d demotions" % delta(a, b, "cached_group_demotions"))

# 1e. The last rank changes one member's shape while the others admit the
#     cached group whole: the mismatch fails on every rank, naming the shapes;
#     the unchanged group then runs right again.
comm.Barrier()
bad_shapes = [[5], [40, 2], [4], [64]] if last else shapes_a
h, bufs, verify = submit_group("mixA", bad_shapes, 600, range(len(shapes_a)))
expect_error(lambda: E.wait_all(h), "tensor shapes")
h, bufs, verify = submit_group("mixA", shapes_a, 600, range(len(shapes_a)))
E.wait_all(h)
verify()

# 2. The group changes: a member's shape, then an extra member. Negotiates, right
#    results, then runs from its new plan.
for variant, new_shapes in (("shape", [[7], [33, 4], [1], [100], [2, 2, 2], [16]]),
                            ("member", shapes + [[5, 5]])):
    prefix = "g" if variant == "shape" else "g2"
    a = E.stats()
    run_group(prefix, new_shapes, 50)
    b = E.stats()
    check(delta(a, b, "negotiated_responses") >= len(new_shapes) if variant == "member"
          else delta(a, b, "negotiated_responses") >= 1, "%s change did not renegotiate" % variant)
    check(delta(a, b, "plan_launches") == 0, "%s change ran from the stale plan" % variant)
    run_group(prefix, new_shapes, 50)
    c = E.stats()
    check(delta(b, c, "plan_launches") == 1, "%s change: no new plan (%d launches)" % (variant, delta(b, c, "plan_launches")))
    check(delta(b, c, "negotiated_responses") == 0, "%s change: renegotiated again" % variant)
# The old shape again: its plan was replaced, so it negotiates and still computes right.
run_group("g", shapes, 10)

# 3. Lone tensors on the fused path: average, prescale and postscale.
for i, (dtype, op, pre, post) in enumerate([("float32", "average", 1.0, 1.0), ("float64", "sum", 0.5, 3.0),
                                             ("float16", "sum", 2.0, 0.25), ("int32", "average", 1.0, 1.0),
                                             ("bfloat16", "max", 1.0, 1.0)]):
    x = rank_data(200 + i, rank, [257], dtype, op)
    y = np.zeros_like(x)
    E.wait(E.allreduce_async("lone/%d" % i, x.ctypes.data, y.ctypes.data, [257], dtype, op, pre, post), 30)
    check_close("lone/%d" % i, y, reference(200 + i, size, [257], dtype, op, pre, post), dtype)
    digest_same_on_all_ranks([y], "lone/%d" % i)

# 4. One WaitEvent per distinct ready event of a bucket (fake handles: the CPU
#    communicator ignores them; the engine still deduplicates and counts).
a = E.stats()
run_group("ev", [[3]] * 6, 300, events=[0x10] * 6)
b = E.stats()
check(delta(a, b, "ready_event_waits") == 1, "6 tensors, one event: %d waits" % delta(a, b, "ready_event_waits"))
run_group("ev2", [[3]] * 6, 310, events=[0x10, 0x20, 0x10, 0x20, 0x30, 0])
c = E.stats()
check(delta(b, c, "ready_event_waits") == 3, "three distinct events: %d waits" % delta(b, c, "ready_event_waits"))

# 5. A burst of per-tensor enqueues, then wait_all.
burst_shapes = [[int(n)] for n in np.random.default_rng(7).integers(1, 300, 64)]
xs = [rank_data(400 + i, rank, s, "float32") for i, s in enumerate(burst_shapes)]
ys = [np.zeros_like(x) for x in xs]
for step in range(3):
    hs = [E.allreduce_async("burst/%d" % i, x.ctypes.data, y.ctypes.data, s, "float32")
          for i, (x, y, s) in enumerate(zip(xs, ys, burst_shapes))]
    results = E.wait_all(hs)
    check(results == [None] * len(hs), "wait_all results %r" % results[:3])
    for i, (s, y) in enumerate(zip(burst_shapes, ys)):
        check_close("burst/%d" % i, y, reference(400 + i, size, s, "float32", "sum"), "float32")
    digest_same_on_all_ranks(ys, "burst")
expect_error(lambda: E.wait_all(hs), "unknown or already waited handle", code="INVALID_ARGUMENT")

# 5b. The forms of a group item (Note [A group item's common form],
#     cc/python/engine_bindings.cc): the common 5-tuple (str, int, int, list or
#     tuple of ints, str) is read without pybind11's casters, every other form
#     through them; in one group they give the same results, and the errors of
#     a common-form item are those of the generic path.


class Name(str):
    pass


form_shapes = [[6], [3, 4], [5], [2, 2], [9], [1], [7]]
xs = [rank_data(700 + i, rank, s, "float32") for i, s in enumerate(form_shapes)]
ys = [np.zeros_like(x) for x in xs]
p = [(x.ctypes.data, y.ctypes.data) for x, y in zip(xs, ys)]
items = [("form/0", p[0][0], p[0][1], [6], "float32"),  # common: list shape
         ("form/1", p[1][0], p[1][1], (3, 4), "float32"),  # common: tuple shape
         ("form/2", p[2][0], p[2][1], [np.int64(5)], "float32"),  # numpy dims: generic
         (Name("form/3"), p[3][0], p[3][1], [2, 2], "float32"),  # a str subclass: generic
         ("form/4", p[4][0], p[4][1], [9], "float32", "sum"),  # 6 fields: generic
         ("form/5", p[5][0], p[5][1], [1], "Float32"),  # common, the dtype's other spelling
         ("form/6", p[6][0], p[6][1], [7], "float32", "sum", 1.0, 1.0, "cpu", 0)]  # all 10 fields
for step in range(2):  # negotiated, then from its plan
    for y in ys:
        y[...] = 0
    E.wait_all(E.grouped_allreduce_async(items))
    for i, (s, y) in enumerate(zip(form_shapes, ys)):
        check_close("form/%d step %d" % (i, step), y, reference(700 + i, size, s, "float32", "sum"), "float32")
    digest_same_on_all_ranks(ys, "forms")
x1, y1 = xs[0], ys[0]
expect_error(lambda: E.grouped_allreduce_async([("bad/d", x1.ctypes.data, y1.ctypes.data, [6], "complex64")]),
             "unknown dtype 'complex64'", code="INVALID_ARGUMENT")
expect_error(lambda: E.grouped_allreduce_async([("bad/n", x1.ctypes.data, y1.ctypes.data, [-6], "float32")]),
             "negative dimension", code="INVALID_ARGUMENT")
expect_error(lambda: E.grouped_allreduce_async([("", x1.ctypes.data, y1.ctypes.data, [6], "float32")]),
             "non-empty name", code="INVALID_ARGUMENT")
expect_error(lambda: E.grouped_allreduce_async([("bad/p", 0, y1.ctypes.data, [6], "float32")]),
             "input pointer is null", code="INVALID_ARGUMENT")
for bad_item in [("bad/f", float(x1.ctypes.data), y1.ctypes.data, [6], "float32"),  # not an int: the casters'
                 ("bad/s", x1.ctypes.data, y1.ctypes.data, ["6"], "float32"),
                 ("bad/neg", -1, y1.ctypes.data, [6], "float32")]:
    try:
        E.grouped_allreduce_async([bad_item])
        check(False, "item %r was accepted" % (bad_item,))
    except (TypeError, RuntimeError, OverflowError):
        pass
# Nothing is left in flight by the refusals: the names work.
E.wait_all(E.grouped_allreduce_async([("bad/d", x1.ctypes.data, y1.ctypes.data, [6], "float32")]))
check_close("bad/d", y1, reference(700, size, [6], "float32", "sum"), "float32")

# 5c. allreduce_async's forms (Note [A call's common form], cc/python/engine_bindings.cc): the
# five-argument call read directly, every other form through the generic casters, the same results
# and the same refusals.
call_forms = [lambda n, x, y: E.allreduce_async(n, x, y, [6], "float32"),  # common: list shape
              lambda n, x, y: E.allreduce_async(n, x, y, (6,), "float32"),  # tuple shape: generic overload
              lambda n, x, y: E.allreduce_async(n, x, y, [np.int64(6)], "float32"),  # numpy dim: casters
              lambda n, x, y: E.allreduce_async(Name(n), x, y, [6], "float32"),  # str subclass: casters
              lambda n, x, y: E.allreduce_async(n, x, y, [6], "Float32"),  # common, other spelling
              lambda n, x, y: E.allreduce_async(n, x, y, [6], "float32", "sum"),  # 6 arguments
              lambda n, x, y: E.allreduce_async(n, x, y, [6], dtype="float32"),  # a keyword
              lambda n, x, y: E.allreduce_async(n, x, y, [6], "float32", "sum", 1.0, 1.0, "cpu", 0, None, 0)]
x6 = rank_data(720, rank, [6], "float32")
for step in range(2):
    outs = [np.zeros_like(x6) for _ in call_forms]
    E.wait_all([f("call/%d" % i, x6.ctypes.data, y.ctypes.data) for i, (f, y) in enumerate(zip(call_forms, outs))])
    for i, y in enumerate(outs):
        check_close("call form %d step %d" % (i, step), y, reference(720, size, [6], "float32", "sum"), "float32")
    digest_same_on_all_ranks(outs, "call forms")
expect_error(lambda: E.allreduce_async("bad/cd", x1.ctypes.data, y1.ctypes.data, [6], "complex64"),
             "unknown dtype 'complex64'", code="INVALID_ARGUMENT")
expect_error(lambda: E.allreduce_async("bad/cn", x1.ctypes.data, y1.ctypes.data, [-6], "float32"),
             "negative dimension", code="INVALID_ARGUMENT")
expect_error(lambda: E.allreduce_async("", x1.ctypes.data, y1.ctypes.data, [6], "float32"),
             "non-empty name", code="INVALID_ARGUMENT")
expect_error(lambda: E.allreduce_async("bad/cp", 0, y1.ctypes.data, [6], "float32"),
             "input pointer is null", code="INVALID_ARGUMENT")
for bad_call in [lambda: E.allreduce_async("bad/cf", float(x1.ctypes.data), y1.ctypes.data, [6], "float32"),
                 lambda: E.allreduce_async("bad/cs", x1.ctypes.data, y1.ctypes.data, ["6"], "float32"),
                 lambda: E.allreduce_async("bad/cneg", -1, y1.ctypes.data, [6], "float32"),
                 lambda: E.allreduce_async("bad/cx", x1.ctypes.data, y1.ctypes.data, [6])]:
    try:
        bad_call()
        check(False, "a call was accepted")
    except (TypeError, RuntimeError, OverflowError):
        pass
E.wait(E.allreduce_async("bad/cd", x1.ctypes.data, y1.ctypes.data, [6], "float32"))  # nothing left in flight
check_close("bad/cd", y1, reference(700, size, [6], "float32", "sum"), "float32")

# 6. Diverged state (as a bug would leave it) on one rank: the next collective
#    fails on every rank, naming the cause.
comm.Barrier()
if rank == size - 1:
    E.testing.perturb_state_digest()
x = np.ones(4, np.float32)
y = np.zeros(4, np.float32)
# The engine may stop before or after this enqueue (idle cycles run every
# millisecond): the error then comes from the enqueue or from the wait.
expect_error(lambda: E.wait(E.allreduce_async("after_divergence", x.ctypes.data, y.ctypes.data, [4], "float32"), 60),
             "response caches or cached plans differ", code="INTERNAL")
E.shutdown()
E.init()
E.wait(E.allreduce_async("again", x.ctypes.data, y.ctypes.data, [4], "float32"), 30)
check(np.all(y == size), "allreduce after re-init: %r" % y)
E.shutdown()
finish()
