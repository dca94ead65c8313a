"""AbortEngine, the hook a liveness monitor calls (np >= 2): every rank aborts
with kUnavailable "rank 9 ... died" while requests are pending; each pending
request and each later submission fails with exactly that status at once, no
wait for NVGROUP_TIMEOUT; shutdown is prompt; a new init works.

Leaves with os._exit after a file handshake in argv[1] (the aborted cycle may
leave a negotiation request unfinished, which makes MPI_Finalize unsafe)."""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from engine_common import E, _failures, check, expect_error

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
folder = sys.argv[1]
REASON = "rank 9 (host test, pid 1) died or exited without shutdown(); aborting"

E.init()
x = np.ones(4, np.float32)
y = np.zeros(4, np.float32)
E.wait(E.allreduce_async("before", x.ctypes.data, y.ctypes.data, [4], "float32"), 30)
# Rank 0 never submits 'stuck', so it stays pending everywhere else.
h = E.allreduce_async("stuck" if rank else "other", x.ctypes.data, y.ctypes.data, [4], "float32")
comm.Barrier()
start = time.time()
E.testing.abort_engine(REASON)
expect_error(lambda: E.wait(h, 10), REASON, code="UNAVAILABLE")
check(time.time() - start < 1.5, "abort took %.1f s" % (time.time() - start))
time.sleep(0.05)
expect_error(lambda: E.allreduce_async("later", x.ctypes.data, y.ctypes.data, [4], "float32"), REASON,
             code="UNAVAILABLE")
E.testing.abort_engine("a second reason is ignored")
start = time.time()
E.shutdown()
check(time.time() - start < 2, "shutdown after abort took %.1f s" % (time.time() - start))
E.testing.abort_engine("no engine: no-op")

comm.Barrier()
E.init()
E.wait(E.allreduce_async("after", x.ctypes.data, y.ctypes.data, [4], "float32"), 30)
check(np.all(y == size), "allreduce after re-init")
E.shutdown()

print("[rank %d] %s" % (rank, "FAILED" if _failures else "OK"), flush=True)
open(os.path.join(folder, "done.%d" % rank), "w").close()
deadline = time.time() + 30
while time.time() < deadline and len(os.listdir(folder)) < size:
    time.sleep(0.05)
os._exit(1 if _failures else 0)
