"""Helpers shared by the reliability workers (run under mpirun, pybind engine).

Data reaches the engine as raw addresses (numpy `a.ctypes.data`). bfloat16 has
no numpy dtype: it is stored as uint16 bit patterns and widened here.
"""
import os
import sys
import time
import traceback

import numpy as np

import nvgroup_tf._engine as engine

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from numeric_data import DTYPES, EPS, FLOATS, OPS, STORAGE, random_input, to_float64  # noqa: E402,F401
from numeric_data import to_storage as from_float64  # noqa: E402


def widen(a, dtype):
    return a.astype(np.int64) if dtype in ("int32", "int64") else to_float64(a, dtype)


def check_allreduce(out, inputs, dtype, op, prescale=1.0, postscale=1.0):
    """Returns "" when `out` matches the float64 (exact int64) reference of the
    allreduce of `inputs` (one array per rank), else a description."""
    n = len(inputs)
    xs = [widen(x, dtype) for x in inputs]
    if dtype in FLOATS and prescale != 1.0:
        # The prescale is applied in the element type before the reduction.
        xs = [widen(from_float64(x * prescale, dtype), dtype) for x in xs]
    got = widen(out, dtype)
    if op in ("sum", "average"):
        ref = sum(xs[1:], xs[0].copy())
        if op == "average":
            ref = np.sign(ref) * (np.abs(ref) // n) if dtype not in FLOATS else ref / n
        mag = sum((np.abs(x) for x in xs[1:]), np.abs(xs[0])) / (n if op == "average" else 1)
    elif op == "min":
        ref, mag = np.minimum.reduce(xs), 0.0
    elif op == "max":
        ref, mag = np.maximum.reduce(xs), 0.0
    else:
        ref = np.prod(np.stack(xs), axis=0) if xs[0].size else xs[0].copy()
        mag = np.abs(ref)
    if dtype in FLOATS:
        ref = ref * postscale
        # float16/bfloat16 accumulate in float32 and round at most once per
        # level; every type rounds the scaled result once more.
        eps = EPS[dtype]
        tol = np.abs(postscale) * mag * ((n + 3) * eps) + np.abs(ref) * eps
        bad = np.abs(got - ref) > tol
    else:
        bad = got != ref
    if np.any(bad):
        i = int(np.argmax(bad))
        return "element %d of %d: got %r, want %r" % (i, bad.size, got.flat[i], ref.flat[i])
    return ""


def rss_bytes():
    """Anonymous resident memory: heap and stacks, not the shared-memory
    registered buffers, whose pages become resident as larger buckets touch them."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def wait_bounded(handle, timeout_s):
    """engine.wait(handle), but raises TimeoutError after `timeout_s` instead of
    hanging (polls, so the test never depends on wait()'s own timeout)."""
    deadline = time.time() + timeout_s
    while not engine.poll(handle):
        if time.time() > deadline:
            raise TimeoutError("collective handle %d still in flight after %.0f s" % (handle, timeout_s))
        time.sleep(0.002)
    return engine.wait(handle)


def say(text):
    """One line on stdout in one write(): mpirun forwards the ranks' output in
    chunks, and print()'s separate newline can land after another rank's line.
    With REL_RECORD_DIR set the line also goes to a file of this process: once
    mpirun decides to abort a job it may drop output still in flight."""
    line = (text + "\n").encode()
    os.write(1, line)
    record = os.environ.get("REL_RECORD_DIR")
    if record:
        fd = os.open(os.path.join(record, "%d.log" % os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, line)
        os.close(fd)


def allreduce_into(name, x, dtype, op="sum"):
    """Submits the allreduce of `x` into a new array: (handle, output)."""
    y = np.empty_like(x)
    return engine.allreduce_async(name, x.ctypes.data, y.ctypes.data, list(x.shape), dtype, op,
                                  keepalive=(x, y)), y


def run_worker(main):
    """Runs a worker's main(); an exception says which rank failed, then aborts the job."""
    from mpi4py import MPI
    try:
        main()
    except Exception:  # noqa: BLE001 -- report which rank failed, then fail the job
        say("rank %d: FAILED\n%s" % (MPI.COMM_WORLD.rank, traceback.format_exc()))
        MPI.COMM_WORLD.Abort(1)
