"""The host fold (cc/cpu/host_reduce.h ReduceFold) element for element against a
numpy reference of its contract: left to right in source order, float16 and
bfloat16 accumulated in float32 and rounded once, integers wrapping, Average's
division (integers truncated toward zero), Min/Max as written there. Every
dtype and op, 1-5 sources, lengths across the fold's 512-element blocks, and
the result written over each source in turn (the in-place collectives). No MPI."""
import numpy as np
import pytest

from nvgroup_tf import _engine

T = _engine.testing

INT_DTYPES = ["uint8", "int8", "uint16", "int16", "int32", "int64"]
FLOAT_DTYPES = ["float16", "bfloat16", "float32", "float64"]
OPS = ["Sum", "Average", "Min", "Max", "Product"]
LENGTHS = [1, 7, 511, 513, 1500]


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values):
    """Round to nearest even (finite values only: the data below has no NaN)."""
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def random_sources(rng, dtype, n, length):
    if dtype in INT_DTYPES:
        info = np.iinfo(dtype)
        return [rng.integers(info.min, info.max, size=length, dtype=dtype, endpoint=True) for _ in range(n)]
    # Small values, so Product stays finite in float16.
    values = [rng.uniform(-2.0, 2.0, size=length) for _ in range(n)]
    if dtype == "bfloat16":
        return [f32_to_bf16(v.astype(np.float32)) for v in values]
    return [v.astype(dtype) for v in values]


def apply(op, a, b):
    if op in ("Sum", "Average"):
        return a + b
    if op == "Product":
        return a * b
    if op == "Min":
        return np.where(b < a, b, a)
    return np.where(a < b, b, a)


def reference(dtype, op, sources, divisor):
    if dtype == "float16":
        widened = [s.astype(np.float32) for s in sources]
    elif dtype == "bfloat16":
        widened = [bf16_to_f32(s) for s in sources]
    else:
        widened = [s.copy() for s in sources]
    with np.errstate(over="ignore"):
        acc = widened[0]
        for s in widened[1:]:
            acc = apply(op, acc, s)
    if divisor > 1:
        if dtype in INT_DTYPES:  # in int64, truncated toward zero
            wide = [int(v) for v in acc.astype(np.int64)]
            acc = np.array([abs(v) // divisor * (1 if v >= 0 else -1) for v in wide], dtype=np.int64)
            acc = acc.astype(dtype)
        else:
            acc = (acc / acc.dtype.type(divisor)).astype(acc.dtype)
    if dtype == "float16":
        return acc.astype(np.float16)
    if dtype == "bfloat16":
        return f32_to_bf16(acc)
    return acc.astype(dtype)


@pytest.mark.parametrize("dtype", INT_DTYPES + FLOAT_DTYPES)
def test_host_fold_matches_its_contract_in_and_out_of_place(dtype):
    rng = np.random.default_rng(abs(hash(dtype)) % 2**32)
    checked = 0
    for op in OPS:
        for n in range(1, 6):
            for length in LENGTHS:
                sources = random_sources(rng, dtype, n, length)
                for divisor in ([1, 3] if op == "Average" else [1]):
                    want = reference(dtype, op, sources, divisor).tobytes()
                    for in_place in range(-1, n):
                        got = T.reduce_fold(dtype, op, [s.tobytes() for s in sources], divisor, in_place)
                        assert got == want, (dtype, op, n, length, divisor, in_place)
                        checked += 1
    assert checked == sum((n + 1) * len(LENGTHS) * (2 if op == "Average" else 1) for op in OPS for n in range(1, 6))


def test_host_fold_refuses_sources_of_different_lengths():
    with pytest.raises(RuntimeError, match="one length"):
        T.reduce_fold("float32", "Sum", [b"\0" * 8, b"\0" * 4])
