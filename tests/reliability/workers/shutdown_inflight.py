"""Shutdown worker: shutdown() with collectives in flight, then init again.

    shutdown_inflight.py CYCLES

Each cycle every rank submits a burst of allreduces of random sizes (some of
them large enough to still be running), rank 0 also submits one name nobody
else ever submits, and every rank calls shutdown() at once. Every handle must
then resolve within a bound: OK with the correct result, or ABORTED; the
orphan must be ABORTED. Then init() must work again and run a checked
collective. Submitting after shutdown must fail with a clear error.
"""
import sys
import time

import numpy as np
from mpi4py import MPI

import nvgroup_tf._engine as engine
from rel_common import allreduce_into, check_allreduce, run_worker, say, wait_bounded

COMM = MPI.COMM_WORLD
BURST = 40


def submit(name, x):
    return allreduce_into(name, x, "float32")


def submit_or_aborted(name, x):
    """Shutdown is agreed: a rank still submitting when another rank's
    shutdown() lands is refused with ABORTED. Returns (handle, y) or None."""
    try:
        return submit(name, x)
    except RuntimeError as e:
        if "ABORTED" not in str(e) or "shut down" not in str(e):
            raise AssertionError("submitting %s: unexpected error %s" % (name, e))
        return None


def main():
    cycles = int(sys.argv[1])
    counts = {"ok": 0, "aborted": 0, "refused": 0}
    for cycle in range(cycles):
        engine.init()
        rank, size = engine.rank(), engine.size()
        # A checked collective right after (re-)init.
        xs = [np.random.default_rng([cycle, r, 1]).standard_normal(100).astype(np.float32) for r in range(size)]
        h, y = submit("warm", xs[rank])
        wait_bounded(h, 60)
        why = check_allreduce(y, xs, "float32", "sum")
        if why:
            raise AssertionError("after init #%d: %s" % (cycle, why))

        inputs, handles = {}, []
        for k in range(BURST):
            n = int(np.random.default_rng([cycle, k]).integers(1, 1 << (10 + k % 10)))
            inputs[k] = [np.random.default_rng([cycle, k, r]).standard_normal(n).astype(np.float32)
                         for r in range(size)]
            submitted = submit_or_aborted("burst/%d" % k, inputs[k][rank])
            if submitted is None:
                counts["refused"] += 1
                break
            handles.append((k,) + submitted)
        orphan = None
        if rank == 0:
            orphan = (submit_or_aborted("orphan", np.ones(8, np.float32)) or (None,))[0]
        t0 = time.time()
        engine.shutdown()
        took = time.time() - t0
        for k, h, y in handles:
            try:
                wait_bounded(h, 30)
            except RuntimeError as e:
                if "ABORTED" not in str(e):
                    raise AssertionError("burst/%d failed with %s, not ABORTED" % (k, e))
                counts["aborted"] += 1
                continue
            why = check_allreduce(y, inputs[k], "float32", "sum")
            if why:
                raise AssertionError("burst/%d completed with a wrong result: %s" % (k, why))
            counts["ok"] += 1
        if orphan is not None:
            try:
                wait_bounded(orphan, 30)
                raise AssertionError("the orphan collective completed")
            except RuntimeError as e:
                if "ABORTED" not in str(e) or "orphan" not in str(e):
                    raise AssertionError("orphan: unexpected error %s" % e)
        try:
            submit("late", np.ones(4, np.float32))
            raise AssertionError("a collective was accepted after shutdown()")
        except RuntimeError as e:
            if "init" not in str(e):
                raise AssertionError("submitting after shutdown: unclear error %s" % e)
        say("rank %d: cycle %d shutdown took %.2f s" % (rank, cycle, took))
    say("rank %d: SHUTDOWN_OK ok=%d aborted=%d refused=%d"
          % (COMM.rank, counts["ok"], counts["aborted"], counts["refused"]))


if __name__ == "__main__":
    run_worker(main)
