"""The first round of a cross-group exchange job against a gated `ready`
(engine.testing.cross_exchange_gated, cc/algorithms/cross_exchange.h), one job
over all ranks per case, with and without the progress thread:

  late_ready   rank 0's slice is ready only once the other peers' copies of its
               part are in its receive buffer (at most WAIT_S): the receives of
               the first round must be posted, and MPI progressed, before the
               sends wait for `ready`. Every rank's result is checked element
               by element against the float64 sum of every rank's slice.
  ready_fails  every rank's `ready` fails with the first round's receives
               posted and no send anywhere: Wait returns that error on every
               rank and the exchange is destroyed (its receives cancelled)
               within the bound, instead of waiting for messages that never come.

With --serialized MPI has no MPI_THREAD_MULTIPLE: no progress thread.
"""
import os
import sys
import time

import numpy as np

if "--serialized" in sys.argv:
    import mpi4py
    mpi4py.rc.thread_level = "serialized"
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
import nvgroup_tf._engine as engine  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
WAIT_S = 5.0
BOUND_S = 3.0  # a failed job returns well within this
COUNTS = [1, 7, 1000, 65539]  # eager and rendezvous messages; parts not divisible by the peers


def expected(count):
    # rank r's slice is r * count + i (float32, exact); the sum in float64
    i = np.arange(count, dtype=np.float64)
    return sum(np.float32(r * count) + i.astype(np.float32) for r in range(SIZE)).astype(np.float64)


failures = []
for threads in ([True, False] if MPI.Query_thread() == MPI.THREAD_MULTIPLE else [False]):
    for count in COUNTS:
        COMM.Barrier()
        r = engine.testing.cross_exchange_gated(count, threads, "late_ready", WAIT_S)
        got = np.frombuffer(r["result"], dtype=np.float32).astype(np.float64)
        want = expected(count)
        if r["status"] != "OK":
            failures.append("late_ready count=%d threads=%s: %s" % (count, threads, r["status"]))
        elif not np.array_equal(got, want.astype(np.float32).astype(np.float64)):
            bad = int(np.flatnonzero(got != want.astype(np.float32))[0])
            failures.append("late_ready count=%d threads=%s: element %d is %r, want %r"
                            % (count, threads, bad, got[bad], want[bad]))
        if RANK == 0 and not r["arrived_before_ready"]:
            failures.append("late_ready count=%d threads=%s: the peers' copies did not arrive while rank 0's "
                            "slice was not ready (first-round receives posted only with the sends)"
                            % (count, threads))
        COMM.Barrier()
        t0 = time.monotonic()
        r = engine.testing.cross_exchange_gated(count, threads, "ready_fails")
        took = time.monotonic() - t0
        if "ready_fails: the slice never arrives" not in r["status"] or \
                "waiting for the cross-group slice" not in r["status"]:
            failures.append("ready_fails count=%d threads=%s: status %r" % (count, threads, r["status"]))
        if took > BOUND_S:
            failures.append("ready_fails count=%d threads=%s: returned after %.1f s" % (count, threads, took))

every = COMM.allgather(failures)
for rank, fs in enumerate(every):
    for f in fs:
        print("rank %d: %s" % (rank, f), flush=True)
if any(every):
    sys.exit(1)
if RANK == 0:
    print("cross gated checked on %d ranks" % SIZE, flush=True)
