"""Errors the engine must report cleanly (np = 2, 3, 4): use before init, bad
local input, duplicate in-flight names, and cross-rank mismatches of shape,
dtype, op, root, collective type and scale factors -- the same error on every
rank within seconds, naming the tensor -- including a mismatch against a cached
response. The engine keeps working afterwards."""
import time

import numpy as np
from mpi4py import MPI

from engine_common import E, check, expect_error, finish

comm = MPI.COMM_WORLD
x = np.ones(12, np.float32)
y = np.zeros(12, np.float32)
NOT_INIT = "nvgroup_tf has not been initialized; call hvd.init() first"

# Use before init.
check(not E.is_initialized(), "not initialized at start")
expect_error(lambda: E.allreduce_async("early", x.ctypes.data, y.ctypes.data, [12], "float32"), NOT_INIT,
             code="FAILED_PRECONDITION")
expect_error(E.rank, NOT_INIT, code="FAILED_PRECONDITION")

E.init()
E.init()  # idempotent while running
rank, size = E.rank(), E.size()

# Bad input on this rank: synchronous errors naming the problem.
expect_error(lambda: E.broadcast_async("b", x.ctypes.data, y.ctypes.data, [12], "float32", size),
             "root rank %d is out of range [0, %d)" % (size, size), code="INVALID_ARGUMENT")
expect_error(lambda: E.broadcast_async("b", x.ctypes.data, y.ctypes.data, [12], "float32", -1),
             "out of range", code="INVALID_ARGUMENT")
expect_error(lambda: E.allgather_async("g", x.ctypes.data, [], "float32"), "rank >= 1", code="INVALID_ARGUMENT")
expect_error(lambda: E.allreduce_async("u", x.ctypes.data, y.ctypes.data, [12], "bool"),
             "allreduce does not support dtype bool", code="UNIMPLEMENTED")
expect_error(lambda: E.allreduce_async("", x.ctypes.data, y.ctypes.data, [12], "float32"), "non-empty name",
             code="INVALID_ARGUMENT")
expect_error(lambda: E.allreduce_async("n", x.ctypes.data, y.ctypes.data, [-1], "float32"), "negative dimension",
             code="INVALID_ARGUMENT")
expect_error(lambda: E.allreduce_async("big", x.ctypes.data, y.ctypes.data, [2**40, 2**40], "float32"),
             "is too large", code="INVALID_ARGUMENT")
expect_error(lambda: E.allreduce_async("p", 0, y.ctypes.data, [12], "float32"), "input pointer is null",
             code="INVALID_ARGUMENT")
expect_error(lambda: E.allreduce_async("d", x.ctypes.data, y.ctypes.data, [12], "complex64"), "unknown dtype")
expect_error(lambda: E.allreduce_async("o", x.ctypes.data, y.ctypes.data, [12], "float32", "median"),
             "unknown reduce op")

# Duplicate in-flight name: rank 0 holds 'dup' in flight until the barrier.
if rank == 0:
    first = E.allreduce_async("dup", x.ctypes.data, y.ctypes.data, [12], "float32")
    expect_error(lambda: E.allreduce_async("dup", x.ctypes.data, y.ctypes.data, [12], "float32"),
                 "duplicate name", "'dup'", code="INVALID_ARGUMENT")
    expect_error(lambda: E.grouped_allreduce_async([("g1", x.ctypes.data, y.ctypes.data, [12], "float32"),
                                                    ("g1", x.ctypes.data, y.ctypes.data, [12], "float32")]),
                 "duplicate name", code="INVALID_ARGUMENT")
comm.Barrier()
if rank != 0:
    first = E.allreduce_async("dup", x.ctypes.data, y.ctypes.data, [12], "float32")
E.wait(first, 30)
check(np.all(y == size), "dup allreduce result")


def mismatch(name, submit, expected_text=None, fragment="Mismatched"):
    """submit() enqueues this rank's (rank-dependent) version; every rank must fail fast
    with the same FAILED_PRECONDITION text naming the tensor."""
    start = time.time()
    h = submit()
    try:
        E.wait(h, 20)
        text = ""
        check(False, "%s: mismatch was not reported" % name)
    except E.EngineError as e:
        text = str(e)
    elapsed = time.time() - start
    check(elapsed < 5, "%s: error took %.1f s" % (name, elapsed))
    check(text.startswith("FAILED_PRECONDITION:") and fragment in text and "'%s'" % name in text,
          "%s: unexpected error %r" % (name, text))
    if expected_text is not None and size == 2:
        check(text == "FAILED_PRECONDITION: " + expected_text, "%s: %r != %r" % (name, text, expected_text))
    texts = comm.allgather(text)
    check(len(set(texts)) == 1, "%s: ranks got different errors: %s" % (name, texts))


buf = np.ones(64, np.float64)
out = np.zeros(64, np.float64)
odd = rank % 2
mismatch("grad/w", lambda: E.allreduce_async("grad/w", buf.ctypes.data, out.ctypes.data, [2 + rank, 3], "float32"),
         "Mismatched allreduce tensor shapes for 'grad/w': rank 0 has [2, 3], rank 1 has [3, 3]")
mismatch("mm/dtype", lambda: E.allreduce_async("mm/dtype", buf.ctypes.data, out.ctypes.data, [4],
                                               "float64" if odd else "float32"),
         "Mismatched allreduce dtypes for 'mm/dtype': rank 0 has float32, rank 1 has float64")
mismatch("mm/op", lambda: E.allreduce_async("mm/op", buf.ctypes.data, out.ctypes.data, [4], "float32",
                                            "max" if odd else "sum"),
         "Mismatched allreduce ops for 'mm/op': rank 0 has Sum, rank 1 has Max")
mismatch("mm/root", lambda: E.broadcast_async("mm/root", buf.ctypes.data, out.ctypes.data, [4], "float32", odd),
         "Mismatched broadcast root ranks for 'mm/root': rank 0 has 0, rank 1 has 1")
mismatch("mm/type", lambda: (E.broadcast_async("mm/type", buf.ctypes.data, out.ctypes.data, [4], "float32", 0)
                             if odd else E.allreduce_async("mm/type", buf.ctypes.data, out.ctypes.data, [4], "float32")),
         "Mismatched collective types for 'mm/type': rank 0 has allreduce, rank 1 has broadcast")
mismatch("mm/scale", lambda: E.allreduce_async("mm/scale", buf.ctypes.data, out.ctypes.data, [4], "float32", "sum",
                                               1.0, 0.5 if odd else 1.0),
         "Mismatched allreduce postscale factors for 'mm/scale': rank 0 has 1, rank 1 has 0.5")
mismatch("mm/gather", lambda: E.allgather_async("mm/gather", buf.ctypes.data, [2, 2 + odd], "float64"),
         fragment="all but the first dimension must agree")

# A mismatch against a cached response: 'cached/w' is negotiated and cached,
# then one rank changes its shape (its request misses the cache, the others hit).
for step in range(3):
    E.wait(E.allreduce_async("cached/w", buf.ctypes.data, out.ctypes.data, [3], "float64"), 30)
    check(np.all(out[:3] == size), "cached/w step %d" % step)
mismatch("cached/w", lambda: E.allreduce_async("cached/w", buf.ctypes.data, out.ctypes.data,
                                               [4 if rank == size - 1 else 3], "float64"),
         fragment="Mismatched allreduce tensor shapes")

# The engine still works, also for the names that failed.
for name in ("grad/w", "cached/w", "after"):
    out[:] = 0
    E.wait(E.allreduce_async(name, buf.ctypes.data, out.ctypes.data, [64], "float64"), 30)
    check(np.all(out == size), "%s works after the errors" % name)
E.shutdown()
expect_error(lambda: E.allreduce_async("late", x.ctypes.data, y.ctypes.data, [12], "float32"), NOT_INIT)
finish()
