"""Property-based tests (hypothesis) of the engine's request validation
(Enqueue, cc/engine/request_validation.cc) through the pybind module, on one rank.

Hypothesis draws collective requests mixing valid and invalid fields (names,
shapes with negative dimensions, null pointers, unknown dtypes/ops/devices,
non-finite or integer-incompatible scale factors, roots out of range, scalar
allgathers). The property: the request is refused at submission with an
EngineError whose status code and text name the problem, or it is accepted
and completes with the right result (one rank: the identity, integer average
included). A crash, a hang or a wrong result fails the run.
"""
import math
import os
import traceback

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nvgroup_tf._engine as engine
from rel_common import DTYPES, STORAGE, say, wait_bounded

SETTINGS = settings(max_examples=int(os.environ.get("REL_EXAMPLES", "400")), deadline=None,
                    derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
MOVABLE = DTYPES + ["uint8", "int8", "uint16", "int16", "bool"]
NP_TYPES = dict(STORAGE, uint8=np.uint8, int8=np.int8, uint16=np.uint16, int16=np.int16, bool=np.bool_)
_count = {"refused": 0, "completed": 0}


def refused(call, code, *words):
    """`call` must raise EngineError "<code>: ..." mentioning every word."""
    try:
        handle = call()
    except engine.EngineError as e:
        text = str(e)
        assert text.startswith(code + ":"), "expected %s, got %s" % (code, text)
        for w in words:
            assert w.lower() in text.lower(), "%r not in %s" % (w, text)
        _count["refused"] += 1
        return
    wait_bounded(handle, 30)
    raise AssertionError("accepted; expected %s mentioning %s" % (code, words))


shapes = st.lists(st.integers(-2, 4), max_size=3)


# Valid values dominate the draws (repetition weights them), so accepted
# requests are exercised about as often as refused ones.
@SETTINGS
@given(kind=st.sampled_from(["allreduce", "allgather", "broadcast"]),
       name=st.sampled_from(["", "a", "grad/w", "x" * 40, "名前", "tab\tname"]),
       shape=shapes,
       dtype=st.one_of(st.sampled_from(MOVABLE * 3 + ["Float32", "float8", "", "complex64"]), st.text(max_size=4)),
       op=st.sampled_from(["sum", "average", "min", "max", "product"] * 3 + ["SUM", "mean", "", "adasum"]),
       prescale=st.sampled_from([1.0] * 6 + [2.0, float("nan"), float("inf")]),
       device=st.sampled_from(["cpu"] * 8 + ["CPU", "cuda:0", "gpu", "tpu", "cuda:x", ""]),
       root=st.sampled_from([0] * 6 + [-1, 1, 2]),
       null_input=st.sampled_from([False] * 6 + [True]))
def prop_requests(kind, name, shape, dtype, op, prescale, device, root, null_input):
    count = int(np.prod(shape)) if shape and min(shape) >= 0 else (1 if not shape else 0)
    np_type = NP_TYPES.get(dtype.lower(), np.float64) if dtype else np.float64
    x = (np.arange(max(count, 1)) % 5 + 1).astype(np_type)
    y = np.zeros_like(x)
    in_ptr = 0 if null_input else x.ctypes.data
    if kind == "allreduce":
        call = lambda: engine.allreduce_async(name, in_ptr, y.ctypes.data, shape, dtype, op, prescale,  # noqa: E731
                                              1.0, device, keepalive=(x, y))
    elif kind == "broadcast":
        call = lambda: engine.broadcast_async(name, in_ptr, y.ctypes.data, shape, dtype, root,  # noqa: E731
                                              device, keepalive=(x, y))
    else:
        call = lambda: engine.allgather_async(name, in_ptr, shape, dtype, device, keepalive=x)  # noqa: E731

    # The first applicable rule decides, in the engine's own order of checks.
    if dtype.lower() not in MOVABLE:
        return refused(call, "INVALID_ARGUMENT", "dtype")
    if kind == "allreduce" and op.lower() not in ("sum", "average", "min", "max", "product"):
        return refused(call, "INVALID_ARGUMENT", "op")
    if device.lower() not in ("cpu", "cuda:0", "gpu"):
        return refused(call, "INVALID_ARGUMENT", "device")
    if not name:
        return refused(call, "INVALID_ARGUMENT", "name")
    if any(d < 0 for d in shape):
        return refused(call, "INVALID_ARGUMENT", "negative dimension")
    if device.lower() != "cpu":
        return refused(call, "UNIMPLEMENTED", "CUDA")
    if null_input and count > 0:
        return refused(call, "INVALID_ARGUMENT", "input pointer is null")
    if kind == "allreduce":
        if dtype.lower() == "bool":  # every numeric dtype reduces (integers scale as Horovod's)
            return refused(call, "UNIMPLEMENTED", dtype.lower())
        if not math.isfinite(prescale):
            return refused(call, "INVALID_ARGUMENT", "finite")
    if kind == "allgather" and not shape:
        return refused(call, "INVALID_ARGUMENT", "scalar")
    if kind == "broadcast" and root != 0:
        return refused(call, "INVALID_ARGUMENT", "root rank")

    out = wait_bounded(call(), 30)
    got = out if kind == "allgather" else y[:count]
    want = x[:count] if kind != "allreduce" or prescale == 1.0 else x[:count] * 2
    if kind == "allgather":
        want = want.reshape(shape)
        got = np.asarray(got).view(want.dtype) if dtype.lower() == "bfloat16" else got
    assert np.array_equal(np.asarray(got), want), (kind, dtype, shape, got, want)
    _count["completed"] += 1


def main():
    engine.init()
    assert engine.size() == 1, "run this worker on one rank"
    prop_requests()
    say("PROPERTY prop_requests OK (%d refused, %d completed)" % (_count["refused"], _count["completed"]))
    engine.shutdown()
    engine.finalize_mpi()


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001 -- print, then fail without waiting for anything
        say("FAILED\n%s" % traceback.format_exc())
        os._exit(1)
