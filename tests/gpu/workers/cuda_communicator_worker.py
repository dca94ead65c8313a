"""GPU worker: the CUDA communicator and the engine driven from Python with cupy.

Run under mpirun, one rank per GPU. Checks, on random data (never zeros):
  * Communicator.allreduce for float32/float16/float64/int32/int64 x every op x
    sizes from 1 element to 3M+1 (odd sizes included), out of place and in
    place, every element against a float64 (ints: exact int64) reference,
    results bitwise equal on all ranks;
  * the engine's allreduce_async on device='cuda:N' for 50 named tensors of odd
    sizes with a ready event (fusion -> NV-group kernel -> callback), Average,
    every element checked;
  * bad input raises on every rank (host pointer, unknown dtype).
Exits non-zero after printing every failure, prefixed with the rank.
"""
import hashlib
import sys

import numpy as np
from mpi4py import MPI

import cupy as cp
from nvgroup_tf import _engine

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
local = comm.Split_type(MPI.COMM_TYPE_SHARED).rank
dev = local % cp.cuda.runtime.getDeviceCount()
cp.cuda.Device(dev).use()
failures = []


def fail(msg):
    failures.append(msg)
    print("[rank %d] FAIL %s" % (rank, msg), flush=True)


def inputs(seed, dtype, op, n):
    """Every rank's input (any rank can build any rank's from the seed)."""
    out = []
    for r in range(size):
        rng = np.random.default_rng([seed, r])
        if np.issubdtype(dtype, np.integer):
            lo, hi = (-3, 4) if op == "product" else (-1000, 1001)
            out.append(rng.integers(lo, hi, n).astype(dtype))
        elif op == "product":
            out.append(rng.uniform(0.5, 2.0, n).astype(dtype))
        else:
            out.append(rng.uniform(-1.0, 1.0, n).astype(dtype))
    return out


def reference(xs, op, dtype):
    if np.issubdtype(dtype, np.integer):
        acc = [x.astype(np.int64) for x in xs]
        if op in ("sum", "average"):
            s = np.sum(acc, axis=0)
            if op == "average":  # truncation toward zero
                s = np.sign(s) * (np.abs(s) // size)
            return s.astype(dtype)
        f = {"min": np.min, "max": np.max, "product": np.prod}[op]
        return f(acc, axis=0).astype(dtype)
    acc = np.array([x.astype(np.float64) for x in xs])
    f = {"sum": np.sum, "average": np.mean, "min": np.min, "max": np.max, "product": np.prod}[op]
    return f(acc, axis=0)


def tolerance(dtype, op, xs):
    if np.issubdtype(dtype, np.integer) or op in ("min", "max"):
        return 0.0
    u = {np.float16: 2.0 ** -11, np.float32: 2.0 ** -24, np.float64: 2.0 ** -53}[dtype]
    mag = np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0)
    if op == "product":
        return (2 * size + 1) * u * np.abs(reference(xs, op, dtype))
    return (size + 2) * u * mag / (size if op == "average" else 1)


def same_on_all_ranks(arr):
    digest = hashlib.sha1(np.ascontiguousarray(arr).tobytes()).hexdigest()
    return len(set(comm.allgather(digest))) == 1


c = _engine.Communicator(comm.py2f(), device="cuda:%d" % dev)
stream = cp.cuda.Stream(non_blocking=True)
seed = 0
for dtype in (np.float32, np.float16, np.float64, np.int32, np.int64):
    name = np.dtype(dtype).name
    for op in ("sum", "average", "min", "max", "product"):
        for n in (1, 7, 1000, 65539, 3 * 2 ** 20 + 1):
            seed += 1
            xs = inputs(seed, dtype, op, n)
            ref = reference(xs, op, dtype)
            tol = tolerance(dtype, op, xs)
            for in_place in (False, True):
                with stream:
                    x = cp.asarray(xs[rank])
                    y = x if in_place else cp.full(n, 77, dtype=dtype)
                stream.synchronize()
                c.allreduce(x.data.ptr, y.data.ptr, n, name, op, stream=stream.ptr)
                c.synchronize(stream.ptr)
                got = cp.asnumpy(y)
                err = np.abs(got.astype(np.float64) - np.asarray(ref, dtype=np.float64))
                bad = int(np.sum(~(err <= tol)))
                if bad:
                    fail("%s %s n=%d in_place=%s: %d of %d elements off" % (name, op, n, in_place, bad, n))
                if not same_on_all_ranks(got):
                    fail("%s %s n=%d: ranks differ" % (name, op, n))
    if rank == 0:
        print("# communicator %s: all ops and sizes done" % name, flush=True)

# Bad input: the same clear error on every rank, no hang.
# (The lambdas run before `del c` below, which is what F821 sees.)
host = np.zeros(16, np.float32)
for what, call in (("host pointer", lambda: c.allreduce(host.ctypes.data, host.ctypes.data, 16, "float32", "sum")),  # noqa: F821
                   ("unknown dtype", lambda: c.allreduce(0, 0, 16, "complex64", "sum"))):  # noqa: F821
    try:
        call()
        fail("bad input '%s' did not raise" % what)
    except Exception as e:  # noqa: BLE001 (the binding raises RuntimeError/ValueError)
        if "INVALID_ARGUMENT" not in str(e):
            fail("bad input '%s': unexpected error %s" % (what, e))
del c

# Engine path: named tensors fused through the registered buffer.
_engine.init(comm.py2f())
sizes = [1 + (7919 * t) % 20000 for t in range(50)]
xs = [[np.random.default_rng([999, t, r]).uniform(-1, 1, n).astype(np.float32) for r in range(size)]
      for t, n in enumerate(sizes)]
for step in range(3):
    with stream:
        ins = [cp.asarray(x[rank]) for x in xs]
        outs = [cp.full(n, np.nan, dtype=np.float32) for n in sizes]
        ready = cp.cuda.Event(disable_timing=True)
        ready.record(stream)
    handles = [_engine.allreduce_async("grad_%d" % t, ins[t].data.ptr, outs[t].data.ptr, [sizes[t]],
                                       "float32", "average", device="cuda:%d" % dev,
                                       ready_event=ready.ptr)
               for t in reversed(range(len(sizes)))]
    for h in handles:
        _engine.wait(h)
    for t, n in enumerate(sizes):
        got = cp.asnumpy(outs[t])
        ref = np.mean([x.astype(np.float64) for x in xs[t]], axis=0)
        bad = int(np.sum(~(np.abs(got - ref) <= (size + 2) * 2.0 ** -24)))
        if bad:
            fail("engine step %d tensor %d: %d of %d elements off" % (step, t, bad, n))
if rank == 0:
    print("# engine allreduce_async on cuda: 3 steps x 50 tensors done", flush=True)
_engine.shutdown()

failures = comm.allgather(len(failures))
if rank == 0:
    print("# cuda_communicator_worker: %s" % ("PASSED" if sum(failures) == 0 else "FAILED"), flush=True)
sys.exit(0 if sum(failures) == 0 else 1)
