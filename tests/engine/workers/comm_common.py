"""Helpers shared by the communicator test workers (run under mpirun).

Data travels to the engine as raw addresses (numpy `a.ctypes.data`). bfloat16
has no numpy dtype: it is held as uint16 bit patterns and widened here.
"""
import ctypes
import os
import sys
import traceback

import numpy as np
from mpi4py import MPI

import nvgroup_tf._engine as engine

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from numeric_data import DTYPES, EPS, OPS, STORAGE, random_input, to_float64  # noqa: E402,F401
from numeric_data import to_storage as from_float32  # noqa: E402

COMM = MPI.COMM_WORLD
RANK = COMM.rank
SIZE = COMM.size


def make_communicator(**kwargs):
    return engine.Communicator(COMM.py2f(), "cpu", **kwargs)


def dyadic_input(rng, dtype, op, count):
    """Values whose sums/averages/products over <= 4 ranks are exact in `dtype`,
    so any reduction order gives the same bits."""
    if op == "product":
        # |product| <= 3^4 * 2^8 < 65504, the largest float16.
        x = rng.integers(1, 4, count) * rng.choice([-1.0, 1.0], count) * 2.0 ** rng.integers(-2, 3, count)
    else:
        # |k| < 2^m with m chosen so 4 * 2^m fits the significand (incl. the implicit bit).
        m = {"float16": 9, "bfloat16": 6}.get(dtype, 11)
        x = rng.integers(-(2 ** m) + 1, 2 ** m, count) * 2.0 ** -8
    return from_float32(x.astype(np.float32), dtype)


def widen(inputs, dtype):
    """Every rank's input as float64 (floats) or int64 (integers)."""
    if dtype in ("int32", "int64"):
        return [i.astype(np.int64) for i in inputs]
    return [to_float64(i, dtype) for i in inputs]


def reference(xs, dtype, op):
    """float64 (or exact int64) reference of the allreduce of the widened
    inputs `xs` (one per rank)."""
    n = len(xs)
    if op in ("sum", "average"):
        s = sum(xs[1:], xs[0].copy())
        if op == "average":
            if dtype in ("int32", "int64"):
                return np.sign(s) * (np.abs(s) // n)  # truncation toward zero
            return s / n
        return s
    if op == "min":
        return np.minimum.reduce(xs)
    if op == "max":
        return np.maximum.reduce(xs)
    return np.prod(np.stack(xs), axis=0)


def tolerance(xs, dtype, op):
    """Per-element error bound of a float result against the float64 reference
    (xs: widened inputs). float16/bfloat16 round once per level (<= 2 levels)
    after float32 accumulation; float32/float64 round once per operation."""
    n = len(xs)
    eps = EPS[dtype]
    acc_eps = 2.0 ** -24 if dtype in ("float16", "bfloat16") else eps  # float32 accumulation
    if op in ("min", "max"):
        return 0.0
    if op == "product":
        # Relative errors multiply: one rounding per group result plus the final one.
        return np.abs(np.prod(np.stack(xs), axis=0)) * ((n + 1) * eps + 2 * n * acc_eps)
    mag = sum((np.abs(x) for x in xs[1:]), np.abs(xs[0]))
    if op == "average":
        mag = mag / n
    return mag * (2 * eps + (n + 1) * acc_eps)


def result_as_float64(out, dtype):
    if dtype in ("int32", "int64"):
        return out.astype(np.int64)
    return to_float64(out, dtype)


def gather_arrays(a):
    """Rank 0 gets every rank's copy of the same-shaped 1-D array `a` (a list);
    the others get None. Buffer-based MPI_Gather: no pickling."""
    a = np.ascontiguousarray(a)
    rows = np.empty((SIZE, a.size), a.dtype) if RANK == 0 else None
    COMM.Gather(a.view(np.uint8), rows.view(np.uint8) if RANK == 0 else None, root=0)
    return list(rows) if RANK == 0 else None


class Checker:
    """Collects failures on this rank; finish() exits non-zero if any."""

    def __init__(self):
        self.failures = []
        self.checks = 0

    def expect(self, ok, message):
        self.checks += 1
        if not ok:
            self.failures.append(message)
            if len(self.failures) <= 20:
                print("[rank %d] FAIL: %s" % (RANK, message), flush=True)

    def compare(self, label, out, mine, dtype, op):
        """Checks `out` (this rank's result for input `mine`) on rank 0: against
        the float64 reference of all ranks' inputs, every element, and bitwise
        against every other rank's output. Other ranks only send their data."""
        inputs = gather_arrays(mine)
        outputs = gather_arrays(out)
        if RANK != 0:
            return
        xs = widen(inputs, dtype)
        ref = reference(xs, dtype, op)
        got = result_as_float64(out, dtype)
        if dtype in ("int32", "int64"):
            bad = np.nonzero(got != ref)[0]
        else:
            bad = np.nonzero(~(np.abs(got - ref) <= tolerance(xs, dtype, op)))[0]
        self.expect(bad.size == 0, "%s: %d of %d elements wrong, first at %s: got %r want %r" % (
            label, bad.size, out.size, bad[:1].tolist(),
            got[bad[:1]].tolist(), ref[bad[:1]].tolist()))
        self.bitwise_equal(label, outputs)

    def same_on_all_ranks(self, label, out):
        """Gathers the bytes to rank 0, which compares them."""
        outputs = gather_arrays(out)
        if RANK == 0:
            self.bitwise_equal(label, outputs)

    def bitwise_equal(self, label, outputs):
        diff = [r for r, o in enumerate(outputs)
                if not np.array_equal(o.view(np.uint8), outputs[0].view(np.uint8))]
        self.expect(not diff, "%s: ranks %s differ from rank 0 bitwise" % (label, diff))

    def finish(self):
        total = COMM.allreduce(len(self.failures))
        if RANK == 0:
            print("%d checks per rank, %d failures over all ranks" % (self.checks, total), flush=True)
        sys.stdout.flush()
        if total:
            sys.exit(1)


def run_main(main):
    """Runs main(); an unexpected exception fails this rank with its traceback."""
    try:
        main()
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(2)  # do not wait for the other ranks in MPI_Finalize


def registered_view(comm, dtype, count):
    """numpy view of the first `count` elements of the registered buffer."""
    storage = np.dtype(STORAGE[dtype])
    raw = (ctypes.c_char * (count * storage.itemsize)).from_address(comm.registered_buffer())
    return np.frombuffer(raw, dtype=storage, count=count)
