"""Writes the results of a fixed set of collectives to OUT_DIR/<tag>_rank<r>.npz.

The test runs this under different engine settings (fusion on/off,
hierarchical/flat) and compares the files bit for bit, across settings and
across ranks. Usage: determinism.py OUT_DIR TAG {random,dyadic}
  random: normal float32/float64 data (fused vs unfused must agree bitwise);
  dyadic: multiples of 2^-6 below 2^10, so every sum is exact in float32 and the
          result cannot depend on the reduction order (hierarchical vs flat).
"""
import sys

import numpy as np

from common import hvd, run, tf


def data(kind, seed, shape, dtype):
    rng = np.random.default_rng(seed)
    if kind == "dyadic":
        return (rng.integers(-2 ** 16, 2 ** 16, size=shape) / 64.0).astype(dtype)
    return rng.normal(size=shape).astype(dtype)


def main():
    out_dir, tag, kind = sys.argv[1], sys.argv[2], sys.argv[3]
    hvd.init()
    me = hvd.rank()
    # 64 small tensors (fusable) + two larger than the 4 MiB default pipeline
    # chunk (12 MiB and 4.2 MiB float32).
    shapes = [(i % 13 + 1, 17) for i in range(64)] + [(3, 1 << 20), (257, 4099)]
    dtypes = [np.float32 if i % 3 else np.float64 for i in range(len(shapes))]
    inputs = [tf.constant(data(kind, [i, me], s, d)) for i, (s, d) in enumerate(zip(shapes, dtypes))]

    @tf.function
    def step(xs):
        outs = {}
        for i, x in enumerate(xs):
            outs["sum%d" % i] = hvd.allreduce(x, op=hvd.Sum, name="det.sum.%d" % i)
            outs["avg%d" % i] = hvd.allreduce(x, op=hvd.Average, name="det.avg.%d" % i)
        outs["scaled"] = hvd.allreduce(xs[5], op=hvd.Sum, prescale_factor=0.5,
                                       postscale_factor=0.25, name="det.scaled")
        for j, g in enumerate(hvd.grouped_allreduce(xs[:16], op=hvd.Sum, name="det.grouped")):
            outs["grouped%d" % j] = g
        return outs

    outs = {k: v.numpy() for k, v in step(inputs).items()}
    if kind == "dyadic":  # exact: check against the integer-valued reference here too
        for i, (s, d) in enumerate(zip(shapes, dtypes)):
            want = np.sum([data(kind, [i, r], s, np.float64) for r in range(hvd.size())], axis=0)
            if not np.array_equal(outs["sum%d" % i].astype(np.float64), want):
                print("[rank %d] FAIL: dyadic sum %d is not exact" % (me, i), flush=True)
                raise SystemExit(1)
    np.savez("%s/%s_rank%d.npz" % (out_dir, tag, me), **outs)
    print("[rank %d] wrote %d results" % (me, len(outs)), flush=True)


if __name__ == "__main__":
    run(main)
