"""A rank of a loop of GPU collectives is SIGKILLed; every survivor must raise
tf.errors.UnavailableError naming it, within a bounded time.

    tf_gpu_rank_failure.py VICTIM STEP

Prints "rank r: KILL <unix time>" on the victim and "rank r: CAUGHT <unix time>
<exception type> <message>" on each survivor (also into REL_RECORD_DIR, since
mpirun may drop output in flight when it ends the job), then exits 3.
"""
import os
import signal
import sys
import time

import numpy as np

from gpu_common import GPU, hvd, init_on_gpu, tf


def say(text):
    line = (text + "\n").encode()
    os.write(1, line)
    record = os.environ.get("REL_RECORD_DIR")
    if record:
        fd = os.open(os.path.join(record, "%d.log" % os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, line)
        os.close(fd)


def main():
    victim, at_step = int(sys.argv[1]), int(sys.argv[2])
    init_on_gpu(1024)
    rank = hvd.rank()
    with tf.device(GPU):
        x = tf.constant(np.random.default_rng(rank).standard_normal(1 << 20).astype(np.float32))
        small = [tf.constant(np.full([7 + i], float(rank), np.float32)) for i in range(5)]
    try:
        for step in range(1000000):
            if rank == victim and step == at_step:
                say("rank %d: KILL %.6f" % (rank, time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            with tf.device(GPU):
                y = hvd.allreduce(x, op=hvd.Average, name="big/%d" % (step % 3))
                hvd.grouped_allreduce(small, op=hvd.Sum, name="small/%d" % (step % 2))
            if step % 10 == 0:
                y.numpy()
    except tf.errors.OpError as e:
        say("rank %d: CAUGHT %.6f %s %s" % (rank, time.time(), type(e).__name__, e.message))
        sys.exit(3)
    say("rank %d: the loop ended without an error" % rank)
    sys.exit(4)


if __name__ == "__main__":
    main()
