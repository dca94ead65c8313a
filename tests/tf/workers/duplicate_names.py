"""One tf.function with an allreduce and an allgather of the same name, 20
calls in one process: TF runs the two ops concurrently, so on each rank the
second one to reach the engine may be refused (its name is in flight) or
accepted (the first one completed). Whatever each rank's timing, every call
ends within seconds on every rank, with an error naming the tensor on every
rank (the duplicate-name error, or a collective-type mismatch when the ranks
submitted the two ops in different orders) or with no error on any rank and
right values; never with the stall timeout. After each call a checked
allreduce of a fresh name gives the exact sum on every rank."""
import time

import numpy as np

from common import Checker, hvd, run, tf

MAX_SECONDS = 20.0
CALLS = 20
NAME = "dup.both"


def main():
    hvd.init()
    c = Checker("duplicate_names")
    me, size = hvd.rank(), hvd.size()
    x = tf.constant(np.full([2, 3], me + 1, np.float32))

    @tf.function
    def both(t):
        return hvd.allreduce(t, op=hvd.Sum, name=NAME), hvd.allgather(t, name=NAME)

    errors = 0
    for k in range(CALLS):
        what = "call %d" % k
        start = time.monotonic()
        outcome = "ok"
        try:
            summed, gathered = both(x)
            c.equal(summed.numpy(), np.full([2, 3], size * (size + 1) / 2, np.float32), what + ": allreduce")
            c.equal(gathered.numpy(), np.concatenate([np.full([2, 3], r + 1, np.float32) for r in range(size)]),
                    what + ": allgather")
        except tf.errors.OpError as e:
            text = str(e)
            outcome = "error"
            errors += 1
            c.check(("'%s'" % NAME) in text and ("duplicate name" in text or "Mismatched collective types" in text),
                    "%s: unexpected error %s: %s" % (what, type(e).__name__, text[:400]))
            c.check("Stalled" not in text, "%s: the stall timeout, not the duplicate: %s" % (what, text[:400]))
        elapsed = time.monotonic() - start
        c.check(elapsed < MAX_SECONDS, "%s: took %.1f s" % (what, elapsed))
        outcomes = hvd.allgather_object(outcome)
        c.check(len(set(outcomes)) == 1, "%s: the ranks' outcomes differ: %s" % (what, outcomes))
        after = hvd.allreduce(tf.constant([float(me + 1)] * 4), op=hvd.Sum, name="after.dup.%d" % k)
        c.equal(after.numpy(), [size * (size + 1) / 2] * 4, what + ": the allreduce after it")
    if me == 0:
        print("%s %d of %d calls raised" % (c.prefix, errors, CALLS), flush=True)
    c.finish()


if __name__ == "__main__":
    run(main)
