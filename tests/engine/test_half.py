"""cc/cpu/half.h against numpy: every float16 bit pattern both ways, and
float32 -> float16/bfloat16 rounding (ties, subnormals, overflow, inf, NaN)
on exhaustive edge cases plus millions of random bit patterns."""
import os
import subprocess

import numpy as np
import pytest

from mpi_util import REPO

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def half_check(tmp_path_factory):
    exe = str(tmp_path_factory.mktemp("half") / "half_check")
    subprocess.run(["g++", "-O2", "-std=c++17", "-I" + os.path.join(REPO, "cc"),
                    os.path.join(HERE, "half_check.cc"), "-o", exe], check=True)

    def run(mode, data):
        out = subprocess.run([exe, mode], input=data.tobytes(), stdout=subprocess.PIPE, check=True)
        return np.frombuffer(out.stdout, np.float32 if mode in ("h2f", "b2f") else np.uint16)
    return run


def float_cases():
    rng = np.random.default_rng(5)
    bits = [rng.integers(0, 2 ** 32, 4_000_000, dtype=np.uint64).astype(np.uint32)]
    # Around every float16/bfloat16 rounding boundary: each float16 value, the
    # exact midpoints to its neighbour, and one float32 ulp either side.
    h = np.arange(0, 0x7C00, dtype=np.uint32)
    f = h.astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    nxt = np.append(f[1:], np.float32(65520.0).view(np.uint32))
    mid = ((f.view(np.float32).astype(np.float64) + nxt.view(np.float32)) / 2).astype(np.float32).view(np.uint32)
    for x in (f, mid):
        bits += [x, x + 1, x - 1, x | 0x80000000]
    b = np.arange(0, 0x7F80, dtype=np.uint32) << 16
    bits += [b, b + 0x8000, b + 0x7FFF, b + 0x8001]  # bfloat16 values, ties, either side
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF,
                        0x7F7FFFFF, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x33000000, 0x33000001,
                        0x32FFFFFF, 0x387FC000, 0x38800000], np.uint32)
    return np.concatenate(bits + [special]).view(np.float32)


def is_nan16(h):
    return ((h & 0x7C00) == 0x7C00) & ((h & 0x3FF) != 0)


def test_half_to_float_every_pattern(half_check):
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = half_check("h2f", h)
    want = h.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.isnan(got[nan]).all()
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_float_to_half_rounds_like_numpy(half_check):
    f = float_cases()
    got = half_check("f2h", f)
    with np.errstate(over="ignore", invalid="ignore"):
        want = f.astype(np.float16).view(np.uint16)
    nan = np.isnan(f)
    assert is_nan16(got[nan]).all(), "NaN must stay NaN"
    assert np.array_equal(got[nan] & 0x8000, want[nan] & 0x8000), "NaN sign"
    bad = np.nonzero(got[~nan] != want[~nan])[0]
    assert bad.size == 0, "first mismatch: float bits %#x -> %#x, numpy %#x" % (
        f[~nan][bad[0]].view(np.uint32), got[~nan][bad[0]], want[~nan][bad[0]])


def bfloat16_reference(f):
    """Round to nearest even on the bits; NaN -> quiet NaN with the same sign."""
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def test_bfloat16_both_ways(half_check):
    f = float_cases()
    got = half_check("f2b", f)
    assert np.array_equal(got, bfloat16_reference(f))
    # Independent check of the rounding on finite values: the result is one of
    # the two neighbouring bfloat16 values and no farther than the other one.
    fin = np.isfinite(f) & (np.abs(f) < 3.38e38)
    x = f[fin].astype(np.float64)
    r = (got[fin].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    down = ((f[fin].view(np.uint32) >> 16) << 16).view(np.float32).astype(np.float64)
    up_bits = ((f[fin].view(np.uint32) >> 16) + 1) << 16
    up = up_bits.view(np.float32).astype(np.float64)
    assert (np.abs(r - x) <= np.minimum(np.abs(down - x), np.abs(up - x))).all()
    b = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    back = half_check("b2f", b)
    assert np.array_equal(back.view(np.uint32), b.astype(np.uint32) << 16)
