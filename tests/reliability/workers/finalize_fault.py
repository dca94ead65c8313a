"""Worker: after shutdown(), rank VICTIM either stops (SIGSTOP) before it
finalizes MPI, or stays busy for BUSY_S seconds first (a rank that evaluates a
model after shutdown()). The other ranks go straight to finalize_mpi(), which
waits in MPI_Finalize for the victim.

    finalize_fault.py VICTIM stop|busy BUSY_S

Every rank sends its stderr (the engine's log lines) to
REL_RECORD_DIR/<pid>.log, since mpirun may drop the output of a job it ends.
Each rank says "rank R: SHUTDOWN_OK" after shutdown() and "rank R: FINALIZED"
after finalize_mpi() returned. Engine only (no TensorFlow).
"""
import os
import signal
import sys
import time

import numpy as np

import nvgroup_tf._engine as engine
from rel_common import say


def main():
    victim, kind, busy_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    record = os.environ["REL_RECORD_DIR"]
    fd = os.open(os.path.join(record, "%d.log" % os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    engine.init()
    rank, size = engine.rank(), engine.size()
    x = np.random.default_rng(rank).integers(-1000, 1000, size=257).astype(np.int64)
    got = np.empty_like(x)
    engine.wait(engine.allreduce_async("before_shutdown", x.ctypes.data, got.ctypes.data, list(x.shape), "int64",
                                       keepalive=(x, got)))
    want = sum(np.random.default_rng(r).integers(-1000, 1000, size=257).astype(np.int64) for r in range(size))
    if not np.array_equal(got, want):
        say("rank %d: WRONG" % rank)
        sys.exit(2)
    engine.shutdown()
    say("rank %d: SHUTDOWN_OK" % rank)
    if rank == victim:
        if kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(busy_s)
    engine.finalize_mpi()
    say("rank %d: FINALIZED" % rank)


if __name__ == "__main__":
    main()
