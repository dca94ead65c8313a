"""Mismatched collectives across ranks must raise on every rank within seconds
(tf.errors.FailedPreconditionError naming the tensor), and the engine must keep
working afterwards. Rank 0 differs from the other ranks in each case."""
import time

import numpy as np

from common import Checker, hvd, run, tf

# A hang is caught by the test's timeout; this bounds "within seconds" per case.
MAX_SECONDS = 20.0


def expect_mismatch(c, what, name, fn):
    start = time.monotonic()
    message = c.raises(tf.errors.FailedPreconditionError, fn, what)
    elapsed = time.monotonic() - start
    c.check(elapsed < MAX_SECONDS, "%s: took %.1f s to fail" % (what, elapsed))
    if message is not None:
        c.check(name in message, "%s: message does not name %r: %s" % (what, name, message))
    # The engine still works after the error.
    ok = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="after." + name)
    c.equal(ok.numpy(), [float(hvd.size())], "allreduce after " + what)


def main():
    hvd.init()
    c = Checker("errors")
    me = hvd.rank()
    odd = me == 0
    x = tf.constant(np.random.default_rng(me).normal(size=(3, 3)).astype(np.float32))

    expect_mismatch(c, "shape mismatch", "mm.shape", lambda: hvd.allreduce(
        tf.ones([2, 3]) if odd else tf.ones([3, 3]), op=hvd.Sum, name="mm.shape"))
    expect_mismatch(c, "rank mismatch", "mm.ndims", lambda: hvd.allreduce(
        tf.ones([9]) if odd else tf.ones([3, 3]), op=hvd.Sum, name="mm.ndims"))
    expect_mismatch(c, "dtype mismatch", "mm.dtype", lambda: hvd.allreduce(
        tf.ones([3], tf.float64) if odd else tf.ones([3]), op=hvd.Sum, name="mm.dtype"))
    expect_mismatch(c, "op mismatch", "mm.op", lambda: hvd.allreduce(
        x, op=hvd.Max if odd else hvd.Sum, name="mm.op"))
    expect_mismatch(c, "prescale mismatch", "mm.prescale", lambda: hvd.allreduce(
        x, op=hvd.Sum, prescale_factor=2.0 if odd else 1.0, name="mm.prescale"))
    expect_mismatch(c, "postscale mismatch", "mm.postscale", lambda: hvd.allreduce(
        x, op=hvd.Sum, postscale_factor=2.0 if odd else 1.0, name="mm.postscale"))
    expect_mismatch(c, "broadcast root mismatch", "mm.root", lambda: hvd.broadcast(
        x, 1 if odd else 0, name="mm.root"))
    expect_mismatch(c, "broadcast shape mismatch", "mm.bshape", lambda: hvd.broadcast(
        tf.ones([4]) if odd else tf.ones([5]), 0, name="mm.bshape"))
    expect_mismatch(c, "allgather trailing-dimension mismatch", "mm.gather", lambda: hvd.allgather(
        tf.ones([me + 1, 4]) if odd else tf.ones([me + 1, 3]), name="mm.gather"))
    expect_mismatch(c, "allgather dtype mismatch", "mm.gtype", lambda: hvd.allgather(
        tf.ones([2], tf.int32) if odd else tf.ones([2], tf.int64), name="mm.gtype"))
    expect_mismatch(c, "grouped allreduce with one mismatched member", "mm.grouped",
                    lambda: hvd.grouped_allreduce(
                        [x, tf.ones([2]) if odd else tf.ones([3])], op=hvd.Sum, name="mm.grouped"))
    # Groups of different lengths (rank 0: 2 tensors, the others: 3): every
    # rank raises, also those whose third member rank 0 never submits; three
    # times, each time with a working allreduce after it.
    for k in range(3):
        expect_mismatch(c, "grouped allreduce of different lengths #%d" % k, "mm.glen%d" % k,
                        lambda: hvd.grouped_allreduce([x] * (2 if odd else 3), op=hvd.Sum, name="mm.glen%d" % k))

    @tf.function
    def in_function(t):
        return hvd.allreduce(t, op=hvd.Sum, name="mm.function")
    expect_mismatch(c, "shape mismatch inside tf.function", "mm.function",
                    lambda: in_function(tf.ones([2]) if odd else tf.ones([4])))

    # Bad input that every rank passes alike: a clear local error, no hang.
    c.raises((tf.errors.InvalidArgumentError, ValueError, TypeError),
             lambda: hvd.allgather(tf.constant(3.0), name="bad.scalar"), "allgather of a scalar")
    c.raises((tf.errors.InvalidArgumentError, ValueError),
             lambda: hvd.broadcast(x, hvd.size() + 3, name="bad.root"), "root out of range",
             contains="root")
    c.raises((TypeError, tf.errors.InvalidArgumentError, tf.errors.NotFoundError),
             lambda: hvd.allreduce(tf.constant(["a"]), op=hvd.Sum, name="bad.string"),
             "allreduce of strings")
    c.finish()


if __name__ == "__main__":
    run(main)
