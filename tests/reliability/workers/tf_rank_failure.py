"""Worker: a rank of a TensorFlow loop is SIGKILLed; the survivors' next
hvd.allreduce must raise tf.errors.UnavailableError naming it.

    tf_rank_failure.py VICTIM STEP

Prints "CAUGHT <unix time> <exception type> <message>" on each survivor and
exits 3, as a training script would (non-zero).
"""
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import nvgroup_tf as hvd  # noqa: E402
from rel_common import say  # noqa: E402


def main():
    victim, at_step = int(sys.argv[1]), int(sys.argv[2])
    hvd.init()
    rank = hvd.rank()
    x = tf.constant(np.random.default_rng(rank).standard_normal((16, 4)))
    try:
        for step in range(1000000):
            if rank == victim and step == at_step:
                say("rank %d: KILL %.6f" % (rank, time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            hvd.allreduce(x, op=hvd.Sum, name="w/%d" % (step % 3))
    except tf.errors.OpError as e:
        say("rank %d: CAUGHT %.6f %s %s" % (rank, time.time(), type(e).__name__, e.message))
        sys.exit(3)
    say("rank %d: the loop ended without an error" % rank)
    sys.exit(4)


if __name__ == "__main__":
    main()
