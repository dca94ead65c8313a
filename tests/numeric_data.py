"""Element types and random test data shared by the numpy-level workers
(tests/engine/workers, tests/reliability/workers): data reaches the engine as
raw addresses (numpy `a.ctypes.data`); bfloat16 has no numpy dtype and is held
as uint16 bit patterns."""
import numpy as np

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64"]
FLOATS = ["float16", "bfloat16", "float32", "float64"]
OPS = ["sum", "average", "min", "max", "product"]
STORAGE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32,
           "float64": np.float64, "int32": np.int32, "int64": np.int64}
# Unit roundoff of the element type (float16/bfloat16 accumulate in float32 and
# round once per level; see cc/cpu/host_reduce.h).
EPS = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -53}


def to_float64(a, dtype):
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def to_storage(x, dtype):
    """Float values -> storage of `dtype` (bfloat16: via float32, round to nearest even)."""
    if dtype == "bfloat16":
        u = x.astype(np.float32).view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return x.astype(STORAGE[dtype])


def random_input(rng, dtype, op, count):
    """Random, never all zero; products stay far from overflow and underflow."""
    if dtype in ("int32", "int64"):
        if op == "product":
            v = rng.integers(1, 4, count) * rng.choice([-1, 1], count)
        else:
            v = rng.integers(-1000, 1000, count)
        return v.astype(STORAGE[dtype])
    if op == "product":
        x = rng.uniform(0.5, 2.0, count) * rng.choice([-1.0, 1.0], count)
    else:
        x = rng.standard_normal(count) * 3.0
    if dtype == "float64":
        return x
    return to_storage(x.astype(np.float32), dtype)
