"""Shutdown with requests in flight (np = 2..4): a tensor only rank 0 submits
fails with ABORTED naming it, nothing hangs, and init after shutdown works.
Then a shutdown requested by one rank stops every rank's loop: the others'
pending requests fail with ABORTED and their later submissions fail too."""
import time

import numpy as np
from mpi4py import MPI

from engine_common import E, check, expect_error, finish

comm = MPI.COMM_WORLD
x = np.arange(8, dtype=np.float32)
y = np.zeros(8, np.float32)

for round_ in range(2):  # the second round runs after a re-init
    E.init()
    rank, size = E.rank(), E.size()
    E.wait(E.allreduce_async("fine", x.ctypes.data, y.ctypes.data, [8], "float32"), 30)
    check(np.all(y == x * size), "round %d: allreduce before shutdown" % round_)
    orphan = None
    if rank == 0:
        orphan = E.allreduce_async("orphan", x.ctypes.data, y.ctypes.data, [8], "float32")
    comm.Barrier()
    start = time.time()
    E.shutdown()
    check(time.time() - start < 10, "shutdown took %.1f s" % (time.time() - start))
    if orphan is not None:
        expect_error(lambda: E.wait(orphan, 10), "nvgroup_tf was shut down with 'orphan' in flight",
                     code="ABORTED")
    check(not E.is_initialized(), "not initialized after shutdown")
    expect_error(lambda: E.allreduce_async("after", x.ctypes.data, y.ctypes.data, [8], "float32"),
                 "has not been initialized", code="FAILED_PRECONDITION")

# One rank shuts down; the others' loops stop at the same cycle.
E.init()
rank, size = E.rank(), E.size()
pending = None
if rank != 0:
    pending = E.allreduce_async("never", x.ctypes.data, y.ctypes.data, [8], "float32")
comm.Barrier()
if rank == 0:
    E.shutdown()
else:
    expect_error(lambda: E.wait(pending, 20), "nvgroup_tf was shut down with 'never' in flight", code="ABORTED")
    time.sleep(0.1)
    expect_error(lambda: E.allreduce_async("later", x.ctypes.data, y.ctypes.data, [8], "float32"),
                 "nvgroup_tf was shut down", code="ABORTED")
    E.shutdown()
comm.Barrier()

# And everything works again.
E.init()
E.wait(E.allreduce_async("fine", x.ctypes.data, y.ctypes.data, [8], "float32"), 30)
check(np.all(y == x * E.size()), "allreduce after re-init")
E.shutdown()
finish()
