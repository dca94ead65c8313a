"""Shared by the TF workers: checks that collect failures, data and references.

A worker runs many checks on every rank, prints each failure prefixed with its
rank, and exits 1 if any failed. An unexpected exception ends the rank at once
with os._exit(1) (mpirun then stops the other ranks instead of letting them
wait in a collective).
"""
import faulthandler
import os
import sys
import traceback

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import nvgroup_tf as hvd  # noqa: E402

FLOAT_DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
INT_DTYPES = [tf.int32, tf.int64]
REDUCE_DTYPES = FLOAT_DTYPES + INT_DTYPES
ALL_DTYPES = [tf.uint8, tf.int8, tf.bool] + REDUCE_DTYPES

# Relative tolerance of a float result vs the float64 reference, per dtype:
# a few ulps of the type times the number of ranks (one rounding per add).
ULP = {tf.float16: 2.0 ** -10, tf.bfloat16: 2.0 ** -7, tf.float32: 2.0 ** -23,
       tf.float64: 2.0 ** -52}


class Checker:
    def __init__(self, name):
        self.name = name
        self.failures = []
        self.checks = 0

    @property
    def prefix(self):
        return "[rank %d/%d %s]" % (hvd.rank(), hvd.size(), self.name) if hvd.is_initialized() \
            else "[%s]" % self.name

    def check(self, ok, what):
        self.checks += 1
        if not ok:
            self.failures.append(what)
            print("%s FAIL: %s" % (self.prefix, what), flush=True)

    def equal(self, got, want, what):
        got, want = np.asarray(got), np.asarray(want)
        ok = got.shape == want.shape and np.array_equal(got, want)
        self.check(ok, "%s: got %s, want %s" % (what, _short(got), _short(want)))

    def close(self, got, want, magnitude, dtype, what):
        """Float result vs float64 reference, every element. `magnitude` bounds
        the size of the terms (e.g. sum of |inputs|): the error allowed is a few
        roundings of the dtype per rank at that magnitude."""
        got = np.asarray(got, dtype=np.float64)
        want = np.asarray(want, dtype=np.float64)
        if got.shape != want.shape:
            self.check(False, "%s: shape %s, want %s" % (what, got.shape, want.shape))
            return
        bound = 8 * hvd.size() * ULP[dtype] * np.maximum(np.abs(magnitude), 1e-30)
        err = np.abs(got - want)
        bad = np.flatnonzero(~(err <= bound))
        self.check(bad.size == 0, "%s: %d of %d elements off, first at %s: got %r want %r" % (
            what, bad.size, err.size, bad[:1], got.ravel()[bad[:1]], want.ravel()[bad[:1]]))

    def raises(self, error_types, fn, what, contains=None):
        try:
            fn()
        except error_types as e:
            if contains is not None:
                self.check(contains in str(e), "%s: message %r lacks %r" % (what, str(e), contains))
            else:
                self.checks += 1
            return str(e)
        except Exception as e:  # noqa: BLE001
            self.check(False, "%s: raised %s instead of %s: %s" % (what, type(e).__name__,
                                                                   error_types, e))
            return None
        self.check(False, "%s: did not raise" % what)
        return None

    def section(self, title):
        if hvd.rank() == 0:
            print("%s %s" % (self.prefix, title), flush=True)

    def finish(self):
        print("%s %d checks, %d failures" % (self.prefix, self.checks, len(self.failures)),
              flush=True)
        sys.stdout.flush()
        if self.failures:
            os._exit(1)


def run(main):
    """Runs main(); any exception kills this rank with exit code 1. A rank still
    running after NVGROUP_TEST_DUMP_AFTER seconds (default 200, below the tests'
    timeouts) prints every thread's stack, so a hang shows where it is."""
    faulthandler.dump_traceback_later(float(os.environ.get("NVGROUP_TEST_DUMP_AFTER", "200")))
    try:
        main()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _short(a):
    text = np.array2string(np.asarray(a).ravel()[:6], precision=6)
    return "%s (shape %s)" % (text, np.asarray(a).shape)


def random_array(rng, dtype, shape, op=None):
    """Random values of `dtype` (never all zeros), exact in that dtype.
    Product: values near 1 (floats) or in {-2..2}\\{0} (ints) so products stay
    in range."""
    shape = tuple(shape)
    if dtype == tf.bool:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dtype in (tf.uint8, tf.int8):
        lo, hi = (0, 255) if dtype == tf.uint8 else (-128, 127)
        return rng.integers(lo, hi + 1, size=shape).astype(dtype.as_numpy_dtype)
    if dtype.is_integer:
        if op == "product":
            vals = rng.integers(1, 3, size=shape) * rng.choice([-1, 1], size=shape)
        else:
            vals = rng.integers(-10 ** 6, 10 ** 6, size=shape)
        return vals.astype(dtype.as_numpy_dtype)
    if op == "product":
        vals = rng.uniform(0.5, 1.5, size=shape) * rng.choice([-1, 1], size=shape)
    else:
        vals = rng.normal(size=shape) * 10
    return tf.cast(vals, dtype).numpy()  # rounded into the dtype


def reference(arrays, op, dtype):
    """op over ranks of `arrays` (list, one per rank), float64 for floats,
    exact integer arithmetic for integers."""
    n = len(arrays)
    if dtype.is_integer:
        stack = np.stack([np.asarray(a, dtype=np.int64) for a in arrays])
        if op in ("sum", "average"):
            s = stack.sum(axis=0)
            if op == "sum":
                return s
            return np.sign(s) * (np.abs(s) // n)  # truncation toward zero
        return {"min": stack.min(axis=0), "max": stack.max(axis=0),
                "product": stack.prod(axis=0)}[op]
    stack = np.stack([tf.cast(a, tf.float64).numpy() for a in arrays])
    return {"sum": stack.sum(axis=0), "average": stack.sum(axis=0) / n,
            "min": stack.min(axis=0), "max": stack.max(axis=0),
            "product": stack.prod(axis=0)}[op]


def to_numpy(t):
    """float16/bfloat16 results as float64 numpy, others as their own type."""
    if t.dtype in (tf.bfloat16, tf.float16):
        return tf.cast(t, tf.float64).numpy()
    return t.numpy()


def magnitude(arrays, op, n):
    """Bound on the size of the terms of a reduction (float64): what Checker.close scales by."""
    stack = np.abs(np.stack([tf.cast(a, tf.float64).numpy() for a in arrays]))
    if op == "product":
        return stack.prod(axis=0)
    return stack.sum(axis=0) / (n if op == "average" else 1)


def check_reduced(c, got, arrays, op, dtype, what):
    """A reduction's result vs the float64 / exact-integer reference of `arrays` (one per rank)."""
    want = reference(arrays, op, dtype)
    if dtype.is_integer or op in ("min", "max"):
        c.equal(to_numpy(got).astype(np.float64 if dtype.is_floating else np.int64), want, what)
    else:
        c.close(to_numpy(got), want, magnitude(arrays, op, hvd.size()), dtype, what)


def per_rank(case, fn):
    """fn(rng) for every rank's generator (same on all ranks), and this rank's."""
    values = [fn(np.random.default_rng([case, r])) for r in range(hvd.size())]
    return values, values[hvd.rank()]


def shape_for(case, ndims):
    rng = np.random.default_rng([case, 10 ** 6])
    return tuple(int(d) for d in rng.integers(1, 6, size=ndims))
