"""Stall worker: rank 1 skips the collective named 'skipme'.

    stall.py warn       ranks 0 and 2 submit 'skipme'; rank 1 submits it only
                        after LATE seconds, so the job completes; rank 0 must
                        have warned (stderr) meanwhile.
    stall.py shutdown   rank 1 never submits it; with NVGROUP_STALL_SHUTDOWN_TIME
                        the ranks holding it get DEADLINE_EXCEEDED naming the
                        tensor and rank 1, and every rank's engine keeps working.
"""
import sys
import time

import numpy as np
from mpi4py import MPI

import nvgroup_tf._engine as engine
from rel_common import allreduce_into, check_allreduce, run_worker, say, wait_bounded

COMM = MPI.COMM_WORLD
LATE_S = 4.0


def allreduce(name, x):
    return allreduce_into(name, x, "float64")


def checked_allreduce(name, seed):
    """A collective every rank runs, checked against the reference."""
    size = engine.size()
    xs = [np.random.default_rng([seed, r]).standard_normal(33) for r in range(size)]
    h, y = allreduce(name, xs[engine.rank()])
    wait_bounded(h, 60.0)
    why = check_allreduce(y, xs, "float64", "sum")
    if why:
        raise AssertionError("%s: %s" % (name, why))


def main():
    mode = sys.argv[1]
    engine.init()
    rank = engine.rank()
    checked_allreduce("before", 1)
    x = np.random.default_rng(rank).standard_normal(5)
    h = None
    if rank != 1:
        h, y = allreduce("skipme", x)
    if mode == "warn":
        if rank == 1:
            time.sleep(LATE_S)
            h, y = allreduce("skipme", x)
        wait_bounded(h, 60.0)
        say("rank %d: skipme completed" % rank)
    else:
        checked_allreduce("meanwhile", 2)  # the stall blocks nothing else
        if h is not None:
            try:
                wait_bounded(h, 60.0)
                raise AssertionError("'skipme' completed although rank 1 never submitted it")
            except RuntimeError as e:
                say("rank %d: STALL_ERROR %s" % (rank, e))
    # Rank 1 must not submit 'after' while the others still wait out the stall
    # time: 'after' would stall in turn.
    COMM.Barrier()
    checked_allreduce("after", 3)
    say("rank %d: OK after the stall" % rank)
    engine.shutdown()


if __name__ == "__main__":
    run_worker(main)
