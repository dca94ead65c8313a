"""Registered groups (RegisterGroup / EnqueueRegisteredGroup / UnregisterGroup,
cc/include/nvgroup/engine.h), np = 1 to 4, one launch:
  1. a registered group of mixed dtypes, ops and scales, many steps in a row
     with fresh data and alternating buffers each step: every element against
     the float64 reference (ints exact), bitwise equal across ranks, and
     bitwise equal to EnqueueGroup of the same requests (same names, after
     UnregisterGroup) on the same data; the steady state runs whole from the
     plan (stats: cached_group_runs) without a negotiation round;
  2. interop: some ranks launch the registered group, the others call
     EnqueueGroup with the same requests (unregistered first, or with the
     names lent), roles switching each step;
  3. a rank whose registered group differs (one member's shape) fails on every
     rank with the mismatch, never a hang; the engine keeps working;
  4. misuse, each a clear synchronous error: unknown handle, wrong number of
     pointers, a null pointer, a launch while the previous one is in flight
     (and every rank ends that step with the duplicate-name error), a
     registered name in another registration, unregister while a launch is
     in flight, unregister twice;
  4b. lent names: between launches a member's name runs through Enqueue
     (right values, the group keeps working); while it is in flight a launch
     is refused (the duplicate error on every rank); while a launch is in flight Enqueue of a member's name is
     refused; unregistering while a name is lent keeps it in flight until its
     Enqueue completes;
  5. re-registration after a shape change;
  6. last: a handle from before shutdown() fails after init() again."""
import time

import numpy as np
from mpi4py import MPI

from engine_common import E, check, check_close, expect_error, finish, rank_data, reference

comm = MPI.COMM_WORLD
E.init()
rank, size = E.rank(), E.size()
WAIT_S = 30.0

# (shape, dtype, op, prescale, postscale)
MEMBERS = [([7], "float32", "average", 1.0, 1.0), ([33, 3], "float32", "sum", 0.5, 3.0),
           ([1], "float64", "sum", 1.0, 1.0), ([100], "int32", "sum", 1.0, 1.0),
           ([2, 2, 2], "float16", "average", 1.0, 1.0), ([0], "float32", "sum", 1.0, 1.0),
           ([257], "float32", "max", 1.0, 1.0), ([16], "int64", "min", 1.0, 1.0)]


def items_of(prefix, members):
    return [("%s/%d" % (prefix, i), shape, dtype, op, pre, post)
            for i, (shape, dtype, op, pre, post) in enumerate(members)]


def inputs(members, seed):
    return [rank_data(seed + i, rank, shape, dtype, op) for i, (shape, dtype, op, _, _) in enumerate(members)]


def check_reference(what, members, seed, outs):
    for i, ((shape, dtype, op, pre, post), y) in enumerate(zip(members, outs)):
        want = reference(seed + i, size, shape, dtype, op, pre, post)
        check_close("%s member %d" % (what, i), y, want, dtype, scale=abs(pre * post))


def same_bits_on_all_ranks(what, outs):
    blob = b"".join(np.ascontiguousarray(y).tobytes() for y in outs)
    check(len(set(comm.allgather(blob))) == 1, "%s: outputs differ across ranks" % what)


def pointers(arrays):
    return np.array([a.ctypes.data for a in arrays], dtype=np.uint64)


def launch(group, xs, ys):
    return E.registered_group_allreduce_async(group, pointers(xs), pointers(ys))


def enqueue_group(prefix, members, xs, ys):
    items = [("%s/%d" % (prefix, i), x.ctypes.data, y.ctypes.data, list(x.shape), dtype, op, pre, post, "cpu", 0)
             for i, ((_, dtype, op, pre, post), x, y) in enumerate(zip(members, xs, ys))]
    return E.grouped_allreduce_async(items)


# 1. Many steps of a registered group: references, ranks, EnqueueGroup's bits.
group = E.register_allreduce_group(items_of("reg", MEMBERS))
check(group > 0, "a handle is never 0")
buffers = [[np.zeros(shape, np.dtype(dtype) if dtype != "float16" else np.float16)
            for shape, dtype, *_ in MEMBERS] for _ in range(2)]
STEPS = 30
s0 = None
for step in range(STEPS):
    seed = 1000 + 37 * step
    xs = inputs(MEMBERS, seed)
    ys = buffers[step % 2]
    for y in ys:
        y[...] = 0
    if step == 3:
        s0 = E.stats()
    E.wait(launch(group, xs, ys), WAIT_S)
    check_reference("step %d" % step, MEMBERS, seed, ys)
    same_bits_on_all_ranks("step %d" % step, ys)
s1 = E.stats()
runs = s1["cached_group_runs"] - s0["cached_group_runs"]
check(runs >= STEPS - 4, "steady state: %d of %d launches ran whole from their plan" % (runs, STEPS - 3))
check(s1["negotiation_rounds"] == s0["negotiation_rounds"],
      "steady state: %d negotiation rounds" % (s1["negotiation_rounds"] - s0["negotiation_rounds"]))
registered_bits = [y.copy() for y in buffers[(STEPS - 1) % 2]]
last_seed = 1000 + 37 * (STEPS - 1)
E.unregister_group(group)
xs = inputs(MEMBERS, last_seed)
ys = [np.zeros_like(y) for y in registered_bits]
E.wait_all(enqueue_group("reg", MEMBERS, xs, ys))
for i, (a, b) in enumerate(zip(registered_bits, ys)):
    check(a.tobytes() == b.tobytes(), "member %d: the registered launch and EnqueueGroup differ bitwise" % i)
# The other way round: EnqueueGroup made the plan, a registration of the same requests runs from it.
group = E.register_allreduce_group(items_of("reg", MEMBERS))
ys2 = [np.zeros_like(y) for y in ys]
E.wait(launch(group, xs, ys2), WAIT_S)
for i, (a, b) in enumerate(zip(ys, ys2)):
    check(a.tobytes() == b.tobytes(), "member %d: EnqueueGroup then registered differ bitwise" % i)
E.unregister_group(group)

# 2. Interop: registered on some ranks, EnqueueGroup on the others, roles switching.
group = E.register_allreduce_group(items_of("mix", MEMBERS))
for step in range(6):
    seed = 5000 + 11 * step
    xs = inputs(MEMBERS, seed)
    ys = [np.zeros_like(y) for y in buffers[0]]
    if (rank + step) % 2 == 0:
        E.wait(launch(group, xs, ys), WAIT_S)
    elif step < 3:
        E.unregister_group(group)  # its names are free for EnqueueGroup on this rank
        E.wait_all(enqueue_group("mix", MEMBERS, xs, ys))
        group = E.register_allreduce_group(items_of("mix", MEMBERS))
    else:  # registered, its names lent to EnqueueGroup
        E.wait_all(enqueue_group("mix", MEMBERS, xs, ys))
    check_reference("interop step %d" % step, MEMBERS, seed, ys)
    same_bits_on_all_ranks("interop step %d" % step, ys)
E.unregister_group(group)

# 3. A rank whose registered group differs fails on every rank.
if size > 1:
    changed = [list(m) for m in MEMBERS]
    if rank == size - 1:
        changed[1][0] = [33, 4]
    g = E.register_allreduce_group(items_of("bad", changed))
    xs = inputs(changed, 77)
    ys = [np.zeros(m[0], xs[i].dtype) for i, m in enumerate(changed)]
    start = time.monotonic()
    expect_error(lambda: E.wait(launch(g, xs, ys), WAIT_S), "Mismatched", "bad/1")
    check(time.monotonic() - start < 10, "the mismatch took %.1f s" % (time.monotonic() - start))
    E.unregister_group(g)
    xs = inputs(MEMBERS, 78)
    ys = [np.zeros_like(y) for y in buffers[0]]
    g = E.register_allreduce_group(items_of("after_bad", MEMBERS))
    E.wait(launch(g, xs, ys), WAIT_S)
    check_reference("after the mismatch", MEMBERS, 78, ys)
    E.unregister_group(g)

# 4. Misuse.
ONE = [([8], "float32", "sum", 1.0, 1.0), ([4], "float32", "sum", 1.0, 1.0)]
g = E.register_allreduce_group(items_of("misuse", ONE))
xs = inputs(ONE, 9)
ys = [np.zeros_like(x) for x in xs]
expect_error(lambda: E.registered_group_allreduce_async(g + 1000, pointers(xs), pointers(ys)),
             "unknown registered group", code="INVALID_ARGUMENT")
# Addresses must be integers: floats (or bools) were truncated into addresses and crashed the engine.
expect_error(lambda: E.registered_group_allreduce_async(g, [1.5, 2.5], pointers(ys)),
             "in_ptrs must hold integer addresses", code="INVALID_ARGUMENT")
expect_error(lambda: E.registered_group_allreduce_async(g, pointers(xs), np.array([True, False])),
             "out_ptrs must hold integer addresses", code="INVALID_ARGUMENT")
expect_error(lambda: E.registered_group_allreduce_async(g, [xs[0].ctypes.data, -8], pointers(ys)),
             "in_ptrs holds a negative address", code="INVALID_ARGUMENT")
expect_error(lambda: E.registered_group_allreduce_async(g, pointers(xs[:1]), pointers(ys[:1])),
             "has 2 members", "gives 1", code="INVALID_ARGUMENT")
expect_error(lambda: E.registered_group_allreduce_async(g, np.array([xs[0].ctypes.data, 0], np.uint64),
                                                       pointers(ys)),
             "null input pointer", "misuse/1", code="INVALID_ARGUMENT")
expect_error(lambda: E.register_allreduce_group([("other/0", [3], "float32"), ("misuse/1", [4], "float32")]),
             "belongs to registered group", code="INVALID_ARGUMENT")
expect_error(lambda: E.register_allreduce_group([("twice", [3], "float32"), ("twice", [3], "float32")]),
             "twice", code="INVALID_ARGUMENT")
expect_error(lambda: E.register_allreduce_group([]), "at least one member", code="INVALID_ARGUMENT")
# A registered name through allreduce_async between launches: lent, it runs
# as if it were not registered, and the group keeps working afterwards.
y0 = np.zeros_like(xs[0])
E.wait(E.allreduce_async("misuse/0", xs[0].ctypes.data, y0.ctypes.data, [8], "float32"), WAIT_S)
check_close("misuse/0 lent to allreduce_async", y0, reference(9, size, [8], "float32", "sum"), "float32")
E.wait(launch(g, xs, ys), WAIT_S)
check_reference("misuse group after a lent name", ONE, 9, ys)
if size > 1:
    def held_by_rank0(submit, check_result, while_held, refused_later):
        """Rank 0 submits at once and, while the others wait at a barrier (so
        its submission stays in flight), runs while_held(), whose refusals
        reach rank 0's coordinator; the others submit after the barrier, then
        their refused_later() meets the duplicate error those refusals left."""
        if rank == 0:
            h = submit()
            while_held()
            comm.Barrier()
            E.wait(h, WAIT_S)
            check_result()
            comm.Barrier()
        else:
            comm.Barrier()
            E.wait(submit(), WAIT_S)
            check_result()
            comm.Barrier()
            started = time.monotonic()
            expect_error(lambda: E.wait(refused_later(), WAIT_S), "duplicate name", code="INVALID_ARGUMENT")
            check(time.monotonic() - started < 10, "the refusal took %.1f s" % (time.monotonic() - started))
        comm.Barrier()

    def fresh_launch():
        return launch(g, xs, [np.zeros_like(x) for x in xs])

    # A launch in flight: launching again is refused, unregistering too.
    ys = [np.zeros_like(x) for x in xs]

    def refused_while_launched():
        expect_error(lambda: E.unregister_group(g), "in flight", code="FAILED_PRECONDITION")
        expect_error(fresh_launch, "duplicate name", "previous launch is still in flight", code="INVALID_ARGUMENT")
    held_by_rank0(lambda: launch(g, xs, ys), lambda: check_reference("the launch in flight", ONE, 9, ys),
                  refused_while_launched, fresh_launch)
    ys = [np.zeros_like(x) for x in xs]
    E.wait(launch(g, xs, ys), WAIT_S)
    check_reference("after the refused launch", ONE, 9, ys)

    # 4b. A member's name lent to allreduce_async and in flight: a launch is refused.
    def lend(out):
        return E.allreduce_async("misuse/1", xs[1].ctypes.data, out.ctypes.data, [4], "float32")

    want1 = reference(10, size, [4], "float32", "sum")
    y1 = np.zeros_like(xs[1])
    held_by_rank0(lambda: lend(y1), lambda: check_close("misuse/1 lent, in flight", y1, want1, "float32"),
                  lambda: expect_error(fresh_launch, "duplicate name", "submitted by that name",
                                       code="INVALID_ARGUMENT"),
                  fresh_launch)
    # A launch in flight: its names are not lent.
    ys = [np.zeros_like(x) for x in xs]
    held_by_rank0(lambda: launch(g, xs, ys),
                  lambda: check_reference("the launch whose name was refused", ONE, 9, ys),
                  lambda: expect_error(lambda: lend(np.zeros_like(xs[1])), "duplicate name",
                                       "whose launch is in flight", code="INVALID_ARGUMENT"),
                  lambda: lend(np.zeros_like(xs[1])))
    # Unregistered while lent: the name stays in flight until its allreduce
    # completes (a registration naming it fails), then registers again.
    y1 = np.zeros_like(xs[1])
    if rank == 0:
        h = lend(y1)
        E.unregister_group(g)
        expect_error(lambda: E.register_allreduce_group(items_of("misuse", ONE)), "is in flight",
                     code="INVALID_ARGUMENT")
        comm.Barrier()
        E.wait(h, WAIT_S)
    else:
        comm.Barrier()
        E.wait(lend(y1), WAIT_S)
        E.unregister_group(g)
    check_close("misuse/1 lent, then unregistered", y1, want1, "float32")
    g = E.register_allreduce_group(items_of("misuse", ONE))
    ys = [np.zeros_like(x) for x in xs]
    E.wait(launch(g, xs, ys), WAIT_S)
    check_reference("registered again after the lent name", ONE, 9, ys)
E.unregister_group(g)
expect_error(lambda: E.unregister_group(g), "unknown registered group", code="INVALID_ARGUMENT")
# The names are free again.
ys = [np.zeros_like(x) for x in xs]
E.wait(E.allreduce_async("misuse/0", xs[0].ctypes.data, ys[0].ctypes.data, [8], "float32"), WAIT_S)
check_close("misuse/0 after unregistering", ys[0], reference(9, size, [8], "float32", "sum"), "float32")

# 5. Re-registration after a shape change.
g = E.register_allreduce_group(items_of("reshape", MEMBERS))
for version, members in enumerate([MEMBERS, [([9], *m[1:]) if i == 0 else m for i, m in enumerate(MEMBERS)]]):
    if version == 1:
        E.unregister_group(g)
        g = E.register_allreduce_group(items_of("reshape", members))
    for step in range(4):
        seed = 9000 + 100 * version + step
        xs = inputs(members, seed)
        ys = [np.zeros(m[0], x.dtype) for m, x in zip(members, xs)]
        E.wait(launch(g, xs, ys), WAIT_S)
        check_reference("reshape v%d step %d" % (version, step), members, seed, ys)
        same_bits_on_all_ranks("reshape v%d step %d" % (version, step), ys)
stale = g

# 6. A handle from before shutdown().
E.shutdown()
E.init()
xs = inputs(MEMBERS, 1)
ys = [np.zeros_like(x) for x in xs]
expect_error(lambda: launch(stale, xs, ys), "before the last shutdown", code="FAILED_PRECONDITION")
g = E.register_allreduce_group(items_of("reshape", MEMBERS))  # the names are free in the new engine
E.wait(launch(g, xs, ys), WAIT_S)
check_reference("after init() again", MEMBERS, 1, ys)
E.shutdown()
finish()
