"""Horovod's collectives beyond allreduce/allgather/broadcast, through the pybind11 module
(np = 2, 3, 4): allreduce of the small integer dtypes (wrapping) and of
integers with scale factors (Horovod's truncation), reducescatter and grouped
reducescatter (Horovod's uneven split, Sum/Average, scale factors; every row
bitwise equal to the allreduce of the same data), alltoall (uneven and zero
splits, every dtype incl. bool; even split without splits), grouped allgather,
join (the joined rank contributes zeros, also through the response cache;
returns the last rank to join), process sets (sub-engines, collectives inside
them, non-members rejected, a disagreement on every rank), and the mismatch
errors: the same name for different collectives on different ranks, on every
rank, fast. Every element is checked against an exact-integer or float64
reference, and results are compared bitwise across ranks."""
import hashlib
import time

import numpy as np
from mpi4py import MPI

from engine_common import E, FLOATS, NP_DTYPES, check, check_close, expect_error, finish

comm = MPI.COMM_WORLD
E.init()
rank, size = E.rank(), E.size()
NP_DTYPES = dict(NP_DTYPES, uint16=np.uint16, int16=np.int16)
SMALL_INTS = ("uint8", "int8", "uint16", "int16")
INTS = SMALL_INTS + ("int32", "int64")
ALL = INTS + FLOATS


def data(seed, r, shape, dtype, lo=None, hi=None):
    """Random, never all zero, in a range where the test says."""
    rng = np.random.default_rng([seed, r])
    n = int(np.prod(shape)) if shape else 1
    if dtype in FLOATS:
        x = rng.uniform(-1.0, 1.0, n) + 0.01
    elif dtype == "bool":
        x = rng.integers(0, 2, n)
    else:
        info = np.iinfo(NP_DTYPES[dtype])
        x = rng.integers(info.min if lo is None else lo, (info.max if hi is None else hi) + 1, n)
    return x.astype(NP_DTYPES[dtype]).reshape(shape)


def same_on_all_ranks(name, a):
    digest = hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()
    digests = comm.allgather(digest)
    return check(len(set(digests)) == 1, "%s: results differ across ranks" % name)


def wrap(values, dtype):
    """int64 values -> dtype with two's-complement wrapping."""
    info = np.iinfo(NP_DTYPES[dtype])
    span = int(info.max) - int(info.min) + 1
    v = (np.asarray(values, dtype=object) - int(info.min)) % span + int(info.min)
    return np.array(v.tolist(), dtype=np.int64).astype(NP_DTYPES[dtype])


def int_reference(seed, shape, dtype, op, pre=1.0, post=1.0, lo=None, hi=None, contributing=None):
    """Exact reference of the engine's integer arithmetic (engine.h / host_reduce.h)."""
    ranks = range(size) if contributing is None else contributing
    xs = [data(seed, r, shape, dtype, lo, hi).astype(np.int64) for r in ranks]
    if pre != 1.0:  # Horovod's ScaleBuffer: trunc(x * pre) in double, wrapped
        xs = [wrap(np.trunc(x.astype(np.float64) * pre).astype(np.int64), dtype).astype(np.int64) for x in xs]
    if op in ("sum", "average"):
        acc = wrap(np.sum(xs, axis=0, dtype=object), dtype).astype(np.int64)
        if op == "average" and pre == 1.0 and post == 1.0:
            return wrap(np.trunc(acc / size).astype(np.int64), dtype)  # exact truncating division
        scale = post / size if op == "average" else post
        if scale != 1.0:
            acc = np.trunc(acc.astype(np.float64) * scale).astype(np.int64)
        return wrap(acc, dtype)
    if op == "min":
        return np.min(xs, axis=0).astype(NP_DTYPES[dtype])
    if op == "max":
        return np.max(xs, axis=0).astype(NP_DTYPES[dtype])
    return wrap(np.prod(np.array(xs, dtype=object), axis=0), dtype)


def float_reference(seed, shape, dtype, op, pre=1.0, post=1.0, contributing=None):
    ranks = range(size) if contributing is None else contributing
    xs = [data(seed, r, shape, dtype).astype(np.float64) * pre for r in ranks]
    acc = np.sum(xs, axis=0)
    return acc * post / (size if op == "average" else 1)


# ---- 1. small integer dtypes and integer scale factors (allreduce) ----------
for i, dtype in enumerate(SMALL_INTS):
    for op in ("sum", "min", "max", "product", "average"):
        shape = [7, 5]
        seed = 100 + i * 10 + ["sum", "min", "max", "product", "average"].index(op)
        lo, hi = (-3, 3) if dtype.startswith("int") else (None, None)
        if op == "average":  # average of small ints: no wrap in the sum
            lo, hi = (0, 200 // size) if dtype == "uint8" else (-100 // size, 100 // size)
        x = data(seed, rank, shape, dtype, lo, hi)
        out = np.zeros_like(x)
        E.wait(E.allreduce_async("ints/%s/%s" % (dtype, op), x.ctypes.data, out.ctypes.data, shape, dtype, op), 60)
        want = int_reference(seed, shape, dtype, op, lo=lo, hi=hi)
        check(np.array_equal(out, want), "allreduce %s %s: got %s want %s" % (dtype, op, out.ravel()[:6],
                                                                              want.ravel()[:6]))
        same_on_all_ranks("allreduce %s %s" % (dtype, op), out)

for i, dtype in enumerate(INTS):
    for op, pre, post in (("sum", 3.0, 0.5), ("average", 1.0, 3.0), ("average", 0.5, 1.0), ("sum", -1.5, 1.0)):
        shape = [33]
        seed = 300 + i * 10 + int(pre * 4) + int(post * 4)
        lo, hi = (0, 20) if dtype.startswith("u") else (-20, 20)
        x = data(seed, rank, shape, dtype, lo, hi)
        out = np.zeros_like(x)
        E.wait(E.allreduce_async("iscale/%s/%s/%g/%g" % (dtype, op, pre, post), x.ctypes.data, out.ctypes.data,
                                 shape, dtype, op, pre, post), 60)
        want = int_reference(seed, shape, dtype, op, pre, post, lo, hi)
        check(np.array_equal(out, want), "scaled allreduce %s %s pre=%g post=%g: got %s want %s" % (
            dtype, op, pre, post, out[:6], want[:6]))

# ---- 2. reducescatter ----------------------------------------------------------
def rs_rows(dim0, r):
    return dim0 // size + (1 if r < dim0 % size else 0)


def rs_range(dim0):
    start = sum(rs_rows(dim0, k) for k in range(rank))
    return start, start + rs_rows(dim0, rank)


count = 0
for dtype in ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int16", "uint8"):
    for dim0 in (1, size - 1, size, 2 * size + 1, 17):
        for op, pre, post in (("sum", 1.0, 1.0), ("average", 1.0, 1.0), ("sum", 0.5, 3.0)):
            if dim0 == 0:
                continue
            count += 1
            shape = [dim0, 3]
            seed = 1000 + count
            lo, hi = (0, 40) if dtype == "uint8" else (-1000, 1000)
            x = data(seed, rank, shape, dtype, lo, hi)
            name = "rs/%s/%d/%s/%g" % (dtype, dim0, op, pre)
            got = E.wait(E.reducescatter_async(name, x.ctypes.data, shape, dtype, op, pre, post), 60)
            check(list(got.shape) == [rs_rows(dim0, rank), 3], "%s: shape %s" % (name, got.shape))
            # The same data through allreduce: our rows must be bitwise equal.
            full = np.zeros_like(x)
            E.wait(E.allreduce_async(name + "/ar", x.ctypes.data, full.ctypes.data, shape, dtype, op, pre, post), 60)
            a, b = rs_range(dim0)
            check(np.array_equal(np.asarray(got).view(np.uint8), full[a:b].view(np.uint8)),
                  "%s: rows differ from the allreduce's" % name)
            if dtype in FLOATS:
                check_close(name, got, float_reference(seed, shape, dtype, op, pre, post)[a:b], dtype)
            else:
                check(np.array_equal(got, int_reference(seed, shape, dtype, op, pre, post, lo, hi)[a:b]),
                      "%s: wrong integer rows" % name)
            same_on_all_ranks(name, full)

# Grouped reducescatter: one negotiation for all members.
xs = [data(5000 + k, rank, [size + k, 2], "float32") for k in range(4)]
ids = E.grouped_reducescatter_async([("grs[%d]" % k, x.ctypes.data, list(x.shape), "float32")
                                     for k, x in enumerate(xs)], "average")
for k, h in enumerate(ids):
    got = E.wait(h, 60)
    a, b = rs_range(size + k)
    check_close("grs[%d]" % k, got, float_reference(5000 + k, [size + k, 2], "float32", "average")[a:b], "float32")

# ---- 3. alltoall ---------------------------------------------------------------
def splits_of(seed, r):
    rng = np.random.default_rng([seed, r, 7])
    s = rng.integers(0, 4, size)
    s[(r + 1) % size] = 0  # a zero split on every rank
    return s.tolist()


for i, dtype in enumerate(ALL + ("bool",)):
    seed = 7000 + i
    mine = splits_of(seed, rank)
    shape = [sum(mine), 2, 3]
    x = data(seed, rank, shape, dtype)
    got, received = E.wait(E.alltoall_async("a2a/%s" % dtype, x.ctypes.data, shape, dtype, mine), 60)
    want_recv = [splits_of(seed, s)[rank] for s in range(size)]
    check(list(received) == want_recv, "alltoall %s: received splits %s != %s" % (dtype, received, want_recv))
    parts = []
    for s in range(size):
        theirs = splits_of(seed, s)
        start = sum(theirs[:rank])
        parts.append(data(seed, s, [sum(theirs), 2, 3], dtype)[start:start + theirs[rank]])
    want = np.concatenate(parts, axis=0)
    check(got.shape == want.shape and np.array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8)),
          "alltoall %s: wrong rows (shape %s vs %s)" % (dtype, got.shape, want.shape))

# Repeated with the same splits (response cache), then changed splits.
for step in range(3):
    mine = splits_of(7100 + (step // 2), rank)
    x = data(7100 + step, rank, [sum(mine), 4], "float64")
    got, received = E.wait(E.alltoall_async("a2a/steps", x.ctypes.data, [sum(mine), 4], "float64", mine), 60)
    parts = []
    for s in range(size):
        theirs = splits_of(7100 + (step // 2), s)
        start = sum(theirs[:rank])
        parts.append(data(7100 + step, s, [sum(theirs), 4], "float64")[start:start + theirs[rank]])
    check(np.array_equal(got, np.concatenate(parts)), "alltoall step %d" % step)

# Without splits: an even split of dimension 0.
x = data(7200, rank, [2 * size, 3], "int32")
got, received = E.wait(E.alltoall_async("a2a/even", x.ctypes.data, [2 * size, 3], "int32"), 60)
check(list(received) == [2] * size, "even alltoall received %s" % (received,))
want = np.concatenate([data(7200, s, [2 * size, 3], "int32")[2 * rank:2 * rank + 2] for s in range(size)])
check(np.array_equal(got, want), "even alltoall rows")
expect_error(lambda: E.alltoall_async("a2a/bad", x.ctypes.data, [2 * size + 1, 3], "int32"),
             "divisible by the number of ranks", code="INVALID_ARGUMENT")
expect_error(lambda: E.alltoall_async("a2a/bad", x.ctypes.data, [2 * size, 3], "int32", [1] * size),
             "sum to", code="INVALID_ARGUMENT")
expect_error(lambda: E.reducescatter_async("rs/bad", x.ctypes.data, [2, 3], "int32", "max"),
             "Sum or Average", code="INVALID_ARGUMENT")

# ---- 4. grouped allgather --------------------------------------------------------
xs = [data(8000 + k, rank, [rank + k + 1, 2], "int64") for k in range(3)]
ids = E.grouped_allgather_async([("gag[%d]" % k, x.ctypes.data, list(x.shape), "int64") for k, x in enumerate(xs)])
for k, h in enumerate(ids):
    got = E.wait(h, 60)
    want = np.concatenate([data(8000 + k, s, [s + k + 1, 2], "int64") for s in range(size)])
    check(np.array_equal(got, want), "grouped allgather member %d" % k)


# ---- 5. mismatches: every rank, fast, same text -----------------------------------
def mismatch(name, submit, *fragments):
    start = time.time()
    h = submit()
    text = ""
    try:
        E.wait(h, 20)
        check(False, "%s: mismatch not reported" % name)
    except E.EngineError as e:
        text = str(e)
    check(time.time() - start < 5, "%s: error took %.1f s" % (name, time.time() - start))
    check(text.startswith("FAILED_PRECONDITION:") and all(f in text for f in fragments),
          "%s: unexpected error %r" % (name, text))
    check(len(set(comm.allgather(text))) == 1, "%s: ranks got different errors" % name)


buf = data(9000, rank, [4 * size, 3], "float32")
obuf = np.zeros_like(buf)
mismatch("same/name", lambda: (E.allreduce_async("same/name", buf.ctypes.data, obuf.ctypes.data, [4, 3], "float32")
                               if rank == 0 else E.allgather_async("same/name", buf.ctypes.data, [4, 3], "float32")),
         "Mismatched collective types for 'same/name'", "rank 0 has allreduce", "allgather")
mismatch("same/rs", lambda: (E.reducescatter_async("same/rs", buf.ctypes.data, [4, 3], "float32")
                             if rank % 2 else E.alltoall_async("same/rs", buf.ctypes.data, [size, 3], "float32")),
         "Mismatched collective types for 'same/rs'", "reducescatter", "alltoall")
mismatch("rs/shape", lambda: E.reducescatter_async("rs/shape", buf.ctypes.data, [4 + rank % 2, 3], "float32"),
         "Mismatched reducescatter tensor shapes for 'rs/shape'")
mismatch("a2a/shape", lambda: E.alltoall_async("a2a/shape", buf.ctypes.data, [size, 1 + rank % 2], "float32"),
         "Mismatched alltoall tensor shapes", "all but the first dimension")
mismatch("rs/op", lambda: E.reducescatter_async("rs/op", buf.ctypes.data, [4, 3], "float32",
                                                "average" if rank % 2 else "sum"),
         "Mismatched reducescatter ops for 'rs/op'")

# ---- 6. join -------------------------------------------------------------------
first, last = size - 1, 0
joined = []
if rank == first:
    joined.append(E.join_async())
else:
    for step in range(3):  # same names every step: the later steps run from the response cache
        for k, (dtype, op) in enumerate((("float32", "sum"), ("float64", "average"), ("int32", "sum"),
                                         ("int64", "average"))):
            seed = 9100 + k
            x = data(seed, rank, [5, 2], dtype, -1000, 1000)
            out = np.zeros_like(x)
            E.wait(E.allreduce_async("join/%d" % k, x.ctypes.data, out.ctypes.data, [5, 2], dtype, op), 60)
            contributing = [r for r in range(size) if r != first]
            if dtype in FLOATS:
                check_close("join/%d step %d" % (k, step), out,
                            float_reference(seed, [5, 2], dtype, op, contributing=contributing), dtype)
            else:
                check(np.array_equal(out, int_reference(seed, [5, 2], dtype, op, lo=-1000, hi=1000,
                                                        contributing=contributing)),
                      "join/%d step %d: integer result with a joined rank" % (k, step))
        # A grouped allreduce and a reducescatter with the joined rank.
        gx = [data(9200 + j, rank, [3 + j], "float32") for j in range(2)]
        go = [np.zeros_like(g) for g in gx]
        ids = E.grouped_allreduce_async([("join/g[%d]" % j, g.ctypes.data, o.ctypes.data, [3 + j], "float32")
                                         for j, (g, o) in enumerate(zip(gx, go))])
        for j, h in enumerate(ids):
            E.wait(h, 60)
            check_close("join/g[%d]" % j, go[j], float_reference(9200 + j, [3 + j], "float32", "sum",
                                                                 contributing=[r for r in range(size) if r != first]),
                        "float32")
        rx = data(9300, rank, [2 * size + 1, 2], "float64")
        got = E.wait(E.reducescatter_async("join/rs", rx.ctypes.data, [2 * size + 1, 2], "float64"), 60)
        a, b = rs_range(2 * size + 1)
        check_close("join/rs", got, float_reference(9300, [2 * size + 1, 2], "float64", "sum",
                                                    contributing=[r for r in range(size) if r != first])[a:b],
                    "float64")
    # An allgather cannot run with a joined rank: an error, not a hang.
    expect = E.allgather_async("join/gather", buf.ctypes.data, [2, 3], "float32")
    try:
        E.wait(expect, 30)
        check(False, "allgather with a joined rank did not fail")
    except E.EngineError as e:
        check("have joined" in str(e) and "FAILED_PRECONDITION" in str(e), "allgather with join: %s" % e)
    if size > 2 and rank != last:
        joined.append(E.join_async())
    if rank == last:
        time.sleep(1.0)  # the others have joined by now
        joined.append(E.join_async())
results = [E.wait(h, 60) for h in joined]
check(results == [last], "join returned %s, expected [%d]" % (results, last))
# Join again (state was reset): everybody joins, the answer is one of the ranks, the same everywhere.
again = E.wait(E.join_async(), 60)
check(0 <= again < size and len(set(comm.allgather(again))) == 1, "second join returned %s" % again)
# Normal operation after the joins.
x = data(9400, rank, [6], "float64")
out = np.zeros_like(x)
E.wait(E.allreduce_async("join/0", x.ctypes.data, out.ctypes.data, [6], "float64"), 60)
check_close("after join", out, float_reference(9400, [6], "float64", "sum"), "float64")

# ---- 7. process sets -----------------------------------------------------------
even = [r for r in range(size) if r % 2 == 0]
odd = [r for r in range(size) if r % 2 == 1]
even_id = E.add_process_set(even)
odd_id = E.add_process_set(odd)
check((even_id, odd_id) == (1, 2), "process set ids %s" % ((even_id, odd_id),))
check(E.process_set_ids() == [0, 1, 2], "ids %s" % E.process_set_ids())
mine_set, members = (even_id, even) if rank % 2 == 0 else (odd_id, odd)
other_set = odd_id if mine_set == even_id else even_id
check(E.process_set_ranks(mine_set) == members, "ranks of my set")
check(E.process_set_rank(mine_set) == members.index(rank) and E.process_set_size(mine_set) == len(members),
      "rank/size in my set")
check(E.process_set_rank(other_set) == -1, "not in the other set")
for step in range(2):
    x = data(9500 + step, rank, [4, 3], "float64")
    out = np.zeros_like(x)
    E.wait(E.allreduce_async("ps/ar", x.ctypes.data, out.ctypes.data, [4, 3], "float64", "average",
                             process_set=mine_set), 60)
    want = sum(data(9500 + step, r, [4, 3], "float64") for r in members) / len(members)
    check_close("ps/ar step %d" % step, out, want, "float64")
g = E.wait(E.allgather_async("ps/ag", x.ctypes.data, [4, 3], "float64", process_set=mine_set), 60)
check(np.array_equal(g, np.concatenate([data(9501, r, [4, 3], "float64") for r in members])), "ps allgather")
root = members[-1]  # a rank of set 0, as in Horovod
b = data(9600, rank, [5], "int32")
E.wait(E.broadcast_async("ps/bc", b.ctypes.data, b.ctypes.data, [5], "int32", root, process_set=mine_set), 60)
check(np.array_equal(b, data(9600, root, [5], "int32")), "ps broadcast from global rank %d" % root)
rx = data(9700, rank, [len(members) + 1, 2], "float32")
got = E.wait(E.reducescatter_async("ps/rs", rx.ctypes.data, [len(members) + 1, 2], "float32",
                                   process_set=mine_set), 60)
me = members.index(rank)
rows = [(len(members) + 1) // len(members) + (1 if k < (len(members) + 1) % len(members) else 0)
        for k in range(len(members))]
a = sum(rows[:me])
want = sum(data(9700, r, [len(members) + 1, 2], "float32").astype(np.float64) for r in members)[a:a + rows[me]]
check_close("ps reducescatter", got, want, "float32")
# The sets run independently of set 0 and of each other at the same time.
h0 = E.allreduce_async("ps/global", x.ctypes.data, out.ctypes.data, [4, 3], "float64")
E.wait(h0, 60)
check_close("global next to sets", out, sum(data(9501, r, [4, 3], "float64") for r in range(size)), "float64")
if odd:  # np >= 2 always has an odd rank
    expect_error(lambda: E.allreduce_async("ps/outsider", x.ctypes.data, out.ctypes.data, [4, 3], "float64",
                                           process_set=other_set),
                 "is not a member of process set %d" % other_set, code="INVALID_ARGUMENT")
expect_error(lambda: E.allreduce_async("ps/unknown", x.ctypes.data, out.ctypes.data, [4, 3], "float64",
                                       process_set=77), "process set 77 does not exist", code="INVALID_ARGUMENT")
expect_error(lambda: E.broadcast_async("ps/root", b.ctypes.data, b.ctypes.data, [5], "int32",
                                       [r for r in range(size) if r not in members][0], process_set=mine_set),
             "is not a member of process set", code="INVALID_ARGUMENT")
# Ranks disagreeing on a set: the same error on every rank, naming each list.
text = expect_error(lambda: E.add_process_set([0, rank] if rank else [0]), "same ranks", code="INVALID_ARGUMENT")
check("rank 0 passed [0], rank 1 passed [0, 1]" in text, "disagreement text %r" % text)
expect_error(lambda: E.add_process_set(list(range(size))), "global process set", code="INVALID_ARGUMENT")
E.remove_process_set(odd_id)
E.remove_process_set(even_id)
check(E.process_set_ids() == [0], "sets removed")
expect_error(lambda: E.allreduce_async("ps/removed", x.ctypes.data, out.ctypes.data, [4, 3], "float64",
                                       process_set=even_id), "does not exist", code="INVALID_ARGUMENT")
# A set registered after removals takes the first removed id (odd_id), as Horovod's ProcessSetTable, and works.
again_id = E.add_process_set(even)
check(again_id == odd_id, "re-registered id %d, expected the first removed id %d" % (again_id, odd_id))
if rank in even:
    E.wait(E.allreduce_async("ps/again", x.ctypes.data, out.ctypes.data, [4, 3], "float64", process_set=again_id),
           60)
    check_close("re-registered set", out, sum(data(9501, r, [4, 3], "float64") for r in even), "float64")

# ---- an output allocation refused on one rank ------------------------------------
# (Note [Outputs sized by negotiation], cc/engine/execution.cc) The last rank's
# allocate_output fails for one allgather, reducescatter and alltoall: that rank
# takes part with host scratch memory and fails naming the allocation, the other
# ranks get every row right, and the engine goes on.
victim = size - 1
ag_in = data(9700, rank, [rank + 1, 3], "float32")
rs_in = data(9701, rank, [size + 1, 3], "float64")
a2a_in = data(9702, rank, [2 * size, 3], "int32")
cases = (
    ("allgather", lambda: E.allgather_async("alloc/ag", ag_in.ctypes.data, [rank + 1, 3], "float32"),
     lambda: np.concatenate([data(9700, r, [r + 1, 3], "float32") for r in range(size)])),
    ("reducescatter", lambda: E.reducescatter_async("alloc/rs", rs_in.ctypes.data, [size + 1, 3], "float64"),
     lambda: float_reference(9701, [size + 1, 3], "float64", "sum")[slice(*rs_range(size + 1))]),
    ("alltoall", lambda: E.alltoall_async("alloc/a2a", a2a_in.ctypes.data, [2 * size, 3], "int32"),
     lambda: np.concatenate([data(9702, s, [2 * size, 3], "int32")[2 * rank:2 * rank + 2] for s in range(size)])),
)
for kind, submit, want in cases:
    if rank == victim:
        E.testing.refuse_output_allocations(1)
        expect_error(lambda: E.wait(submit(), 60), "allocating the %s output" % kind, "refused", code="INTERNAL")
    else:
        got = E.wait(submit(), 60)
        got = got[0] if isinstance(got, tuple) else got
        if kind == "reducescatter":
            check_close("refused allocation: " + kind, got, want(), "float64")
        else:
            check(np.array_equal(np.asarray(got), want()), "refused allocation on rank %d: wrong %s rows" % (victim, kind))
after = np.zeros([5], np.float64)
src = data(9703, rank, [5], "float64")
E.wait(E.allreduce_async("alloc/after", src.ctypes.data, after.ctypes.data, [5], "float64"), 60)
check_close("after a refused allocation", after, float_reference(9703, [5], "float64", "sum"), "float64")

E.shutdown()
finish()
