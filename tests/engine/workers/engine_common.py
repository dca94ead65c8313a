"""Shared helpers of the engine's multi-rank workers (run under mpirun by
tests/engine/test_engine.py). Each worker records failed checks with its rank
and exits non-zero at finish() if any failed."""
import os
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))
from nvgroup_tf import _engine as E  # noqa: E402

NP_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
             "float64": np.float64, "int32": np.int32, "int64": np.int64, "uint8": np.uint8,
             "int8": np.int8, "bool": np.bool_}
FLOATS = ("float16", "bfloat16", "float32", "float64")
# Relative tolerance of a float result against the float64 reference: the
# engine folds float16/bfloat16 in float32 and rounds once (cc/cpu/host_reduce.h),
# so the error is the output rounding plus the fp32 fold plus scaling.
RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5, "float64": 1e-12}

_failures = []


def rank_size_from_env():
    return (int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")),
            int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))


def check(cond, what):
    if not cond:
        r, _ = rank_size_from_env()
        msg = "[rank %d] CHECK FAILED: %s" % (r, what)
        print(msg, flush=True)
        _failures.append(msg)
    return cond


def expect_error(fn, *fragments, code=None):
    """Runs fn(); checks it raises EngineError containing every fragment. Returns the text."""
    try:
        fn()
    except E.EngineError as e:
        text = str(e)
        if code is not None:
            check(text.startswith(code + ":"), "expected %s, got %r" % (code, text))
        for f in fragments:
            check(f in text, "expected %r in %r" % (f, text))
        return text
    check(False, "expected an error containing %r, got none" % (fragments,))
    return ""


def rank_data(seed, rank, shape, dtype, op="sum"):
    """The deterministic input of `rank` for a tensor (every rank can recompute it)."""
    rng = np.random.default_rng([seed, rank])
    n = int(np.prod(shape)) if shape else 1
    if dtype in FLOATS:
        lo = 0.5 if op == "product" else -1.0
        x = rng.uniform(lo, 1.5 if op == "product" else 1.0, n)
    else:
        x = rng.integers(-3, 4, n) if op == "product" else rng.integers(-1000, 1000, n)
    return x.astype(NP_DTYPES[dtype]).reshape(shape)


def reference(seed, size, shape, dtype, op, prescale=1.0, postscale=1.0):
    """float64 reference of op over ranks (ints: exact; integer average truncates toward zero)."""
    xs = [rank_data(seed, r, shape, dtype, op).astype(np.float64) * prescale for r in range(size)]
    if op in ("sum", "average"):
        acc = np.sum(xs, axis=0)
        if op == "average":
            acc = acc / size if dtype in FLOATS else np.trunc(acc / size)
    elif op == "min":
        acc = np.min(xs, axis=0)
    elif op == "max":
        acc = np.max(xs, axis=0)
    else:
        acc = np.prod(xs, axis=0)
    return acc * postscale


def check_close(name, got, want, dtype, scale=1.0):
    """Every element: ints exact; floats within RTOL of the magnitude involved."""
    g = np.asarray(got).astype(np.float64)
    if dtype not in FLOATS:
        bad = np.flatnonzero(g.ravel() != want.ravel())
    else:
        tol = RTOL[dtype] * (np.abs(want.ravel()) + scale)
        bad = np.flatnonzero(np.abs(g.ravel() - want.ravel()) > tol)
    return check(bad.size == 0, "%s (%s): %d of %d elements wrong, first at %s: got %r want %r" % (
        name, dtype, bad.size, g.size, bad[:1], g.ravel()[bad[:1]], want.ravel()[bad[:1]]))


def wait_all(handles, timeout=120):
    """Waits for every handle; returns {name: exception or None}."""
    errors = {}
    deadline = time.time() + timeout
    for name, h in handles.items():
        try:
            E.wait(h, max(0.1, deadline - time.time()))
            errors[name] = None
        except Exception as e:  # noqa: BLE001 (reported by the caller)
            errors[name] = e
    return errors


def finish():
    r, _ = rank_size_from_env()
    if _failures:
        print("[rank %d] %d check(s) failed" % (r, len(_failures)), flush=True)
        sys.exit(1)
    print("[rank %d] OK" % r, flush=True)
