"""Property-based tests (hypothesis) of the Python API's argument validation.

Run on one rank (every rejected argument is rejected locally, before any
cross-rank traffic). For each argument, hypothesis draws valid and invalid
values; a valid call must return the right result, an invalid one must raise
one of the documented exception types with a message naming the problem, and
nothing may crash the process. Malformed NVGROUP_* knobs must make init()
raise InvalidArgumentError naming the variable, and init() must work again
once the environment is fixed.

Prints "PROPERTY <name> OK" per property; exits 1 on the first failure (with
hypothesis' minimal failing example).
"""
import math
import os
import sys
import traceback

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import nvgroup_tf as hvd  # noqa: E402

SETTINGS = settings(max_examples=int(os.environ.get("REL_EXAMPLES", "40")), deadline=None,
                    derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TF_ERRORS = (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError, tf.errors.NotFoundError)

# Anything a user might pass by mistake.
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                 st.binary(max_size=4), st.lists(st.integers(0, 3), max_size=3),
                 st.dictionaries(st.text(max_size=2), st.integers(), max_size=2), st.just(object()))

_counter = [0]


def fresh(prefix):
    """A name no earlier example used (the response cache remembers names)."""
    _counter[0] += 1
    return "%s.%d" % (prefix, _counter[0])


def expect_error(call, types, must_mention):
    """`call` must raise one of `types`, its message mentioning one of `must_mention`."""
    try:
        result = call()
    except types as e:
        text = str(e).lower()
        if not any(m.lower() in text for m in must_mention):
            raise AssertionError("error does not say which argument is wrong (%s expected): %s: %s"
                                 % (must_mention, type(e).__name__, e))
        return
    raise AssertionError("accepted, returned %r" % (result,))


def is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


X = np.random.default_rng(0).standard_normal((3, 2))


@SETTINGS
@given(op=st.one_of(st.sampled_from([hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product, hvd.Adasum]), JUNK))
def prop_reduce_op(op):
    call = lambda: hvd.allreduce(tf.constant(X), op=op, name=fresh("op"))  # noqa: E731
    if op is None or (is_int(op) and op in (hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product)):
        np.testing.assert_array_equal(call().numpy(), X)  # one rank: every op is the identity
    elif is_int(op) and op == hvd.Adasum:
        expect_error(call, (NotImplementedError,), ["adasum"])
    else:
        expect_error(call, (ValueError, TypeError), ["op"])


@SETTINGS
@given(root=st.one_of(st.integers(-3, 3), JUNK))
def prop_broadcast_root(root):
    call = lambda: hvd.broadcast(tf.constant(X), root, name=fresh("root"))  # noqa: E731
    if is_int(root) and 0 <= root < hvd.size():
        np.testing.assert_array_equal(call().numpy(), X)
    else:
        expect_error(call, (ValueError, TypeError) + TF_ERRORS, ["root"])


@SETTINGS
@given(name=st.one_of(st.text(min_size=1, max_size=12), JUNK))
def prop_names(name):
    call = lambda: hvd.allreduce(tf.constant(X), op=hvd.Sum, name=name)  # noqa: E731
    if name is None:
        np.testing.assert_array_equal(call().numpy(), X)
    elif isinstance(name, str) and name and "\x00" not in name:
        np.testing.assert_array_equal(call().numpy(), X)
    else:
        expect_error(call, (ValueError, TypeError), ["name"])


@SETTINGS
@given(factor=st.one_of(st.floats(-4, 4, allow_nan=False, allow_infinity=False), JUNK),
       which=st.sampled_from(["prescale_factor", "postscale_factor"]))
def prop_scale_factors(factor, which):
    call = lambda: hvd.allreduce(tf.constant(X), op=hvd.Sum, name=fresh("scale"),  # noqa: E731
                                 **{which: factor})
    ok = isinstance(factor, (int, float, np.integer, np.floating)) and not isinstance(factor, bool) \
        and math.isfinite(factor) and abs(factor) < 3.0e38
    if ok:
        # Scale factors travel as float32 op attributes.
        want = X * float(np.float32(factor))
        np.testing.assert_allclose(call().numpy(), want, rtol=1e-6, atol=0)
    else:
        expect_error(call, (ValueError, TypeError) + TF_ERRORS, ["factor", "scale"])


ALL_DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64, tf.int8, tf.uint8,
              tf.int16, tf.uint16, tf.uint32, tf.uint64, tf.bool, tf.complex64, tf.string]
REDUCIBLE = {tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64, tf.int8, tf.uint8,
             tf.int16, tf.uint16}
MOVABLE = REDUCIBLE | {tf.bool}


def tensor_of(dtype):
    if dtype == tf.string:
        return tf.constant(["a", "b", "c"])
    if dtype == tf.bool:
        return tf.constant([True, False, True])
    return tf.cast(tf.constant([1, 2, 3]), dtype)


@SETTINGS
@given(dtype=st.sampled_from(ALL_DTYPES), kind=st.sampled_from(["allreduce", "allgather", "broadcast"]))
def prop_dtypes(dtype, kind):
    t = tensor_of(dtype)
    fns = {"allreduce": lambda: hvd.allreduce(t, op=hvd.Sum, name=fresh("dt")),
           "allgather": lambda: hvd.allgather(t, name=fresh("dt")),
           "broadcast": lambda: hvd.broadcast(t, 0, name=fresh("dt"))}
    supported = REDUCIBLE if kind == "allreduce" else MOVABLE
    if dtype in supported:
        got = fns[kind]()
        assert got.dtype == dtype, (got.dtype, dtype)
        np.testing.assert_array_equal(got.numpy(), t.numpy())
    else:
        expect_error(fns[kind], (TypeError, ValueError) + TF_ERRORS, [dtype.name, "dtype", "type"])


@SETTINGS
@given(value=st.one_of(JUNK, st.lists(st.text(max_size=3), min_size=1, max_size=3)))
def prop_tensor_argument(value):
    # Whatever TF makes of it: a tensor of a supported dtype works, anything
    # else is refused with a Python/TF error (never a crash).
    try:
        t = tf.convert_to_tensor(value)
    except (TypeError, ValueError):
        t = None
    call = lambda: hvd.allreduce(value, op=hvd.Sum, name=fresh("arg"))  # noqa: E731
    if t is not None and t.dtype in REDUCIBLE:
        np.testing.assert_array_equal(call().numpy(), t.numpy())
    else:
        expect_error(call, (TypeError, ValueError) + TF_ERRORS, ["tensor", "type", "convert", "dtype"])


KNOBS = ["NVGROUP_FUSION_THRESHOLD", "NVGROUP_CYCLE_TIME", "NVGROUP_TIMEOUT", "NVGROUP_CACHE_CAPACITY",
         "NVGROUP_STALL_WARNING_TIME", "NVGROUP_STALL_SHUTDOWN_TIME", "NVGROUP_PIPELINE_CHUNK",
         "NVGROUP_LOG_LEVEL", "NVGROUP_ALLREDUCE_ALGORITHM", "NVGROUP_GROUP_SIZE"]


@SETTINGS
@given(knob=st.sampled_from(KNOBS),
       value=st.one_of(st.sampled_from(["abc", "", " ", "-1", "1e999", "nan", "inf", "0x10", "12abc", "1.5",
                                        "99999999999999999999999", "-0", "info", "mpi", "4"]),
                       st.text(max_size=6)))
def prop_malformed_knobs(knob, value):
    if "\x00" in value:
        return  # cannot be put in the environment
    hvd.shutdown()
    os.environ[knob] = value
    try:
        try:
            hvd.init()
            accepted = True
        except tf.errors.InvalidArgumentError as e:
            accepted = False
            assert knob in str(e), "init's error does not name %s: %s" % (knob, e)
        if accepted:  # a value init accepts must give a working engine
            np.testing.assert_array_equal(
                hvd.allreduce(tf.constant(X), op=hvd.Sum, name=fresh("knob")).numpy(), X)
    finally:
        del os.environ[knob]
        hvd.shutdown()
        hvd.init()


def main():
    hvd.init()
    assert hvd.size() == 1, "run this worker on one rank"
    props = [prop_reduce_op, prop_broadcast_root, prop_names, prop_scale_factors, prop_dtypes,
             prop_tensor_argument, prop_malformed_knobs]
    only = sys.argv[1:]
    for prop in props:
        if only and prop.__name__ not in only:
            continue
        prop()
        print("PROPERTY %s OK" % prop.__name__, flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001 -- print, then fail without waiting for anything
        print("FAILED\n%s" % traceback.format_exc(), flush=True)
        sys.stdout.flush()
        os._exit(1)
