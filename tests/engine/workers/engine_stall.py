"""Stall inspector (np = 2; NVGROUP_STALL_WARNING_TIME=1,
NVGROUP_STALL_SHUTDOWN_TIME=3): a tensor only rank 0 submits is reported as
stalled naming the missing rank, then fails with DEADLINE_EXCEEDED; the same
for a tensor that is in the response cache (it is reported to rank 0 after
half the warning time)."""
import time

import numpy as np
from mpi4py import MPI

from engine_common import E, check, finish

comm = MPI.COMM_WORLD
E.init()
rank, size = E.rank(), E.size()
x = np.ones(4, np.float32)
y = np.zeros(4, np.float32)
E.wait(E.allreduce_async("stall/cached", x.ctypes.data, y.ctypes.data, [4], "float32"), 30)
missing = list(range(1, size))
for name in ("stall/new", "stall/cached"):
    if rank == 0:
        start = time.time()
        h = E.allreduce_async(name, x.ctypes.data, y.ctypes.data, [4], "float32")
        try:
            E.wait(h, 30)
            check(False, "%s: no stall error" % name)
        except E.EngineError as e:
            text = str(e)
            want = "DEADLINE_EXCEEDED: Stalled ranks: tensor '%s' is ready on ranks [0] but missing on %s for " % (
                name, missing)
            check(text.startswith(want), "%s: %r does not start with %r" % (name, text, want))
        elapsed = time.time() - start
        check(2.5 < elapsed < 10, "%s: failed after %.1f s (shutdown time 3 s)" % (name, elapsed))
    comm.Barrier()
# Nothing is left behind: the names work again on every rank.
for name in ("stall/new", "stall/cached"):
    E.wait(E.allreduce_async(name, x.ctypes.data, y.ctypes.data, [4], "float32"), 30)
    check(np.all(y == size), "%s after the stall" % name)
E.shutdown()
finish()
