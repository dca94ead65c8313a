"""Peer timeout (np = 2, NVGROUP_TIMEOUT=2): rank 1 freezes itself (SIGSTOP);
rank 0's pending request fails with UNAVAILABLE within the timeout, its loop
stops, and later submissions fail with the same error. Rank 0 then resumes rank
1, which finds its own loop timed out too. Both print OK and leave with
os._exit: the negotiation requests left unfinished by design make MPI_Finalize
unsafe, so the pytest side checks the OK lines, not mpirun's exit code. The
ranks wait for each other through files in argv[1] before leaving, since mpirun
kills the others when the first rank exits without MPI_Finalize."""
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

from engine_common import E, check, expect_error, rank_size_from_env

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
pids = comm.allgather(os.getpid())
E.init()
x = np.ones(4, np.float32)
y = np.zeros(4, np.float32)
E.wait(E.allreduce_async("before", x.ctypes.data, y.ctypes.data, [4], "float32"), 30)
comm.Barrier()
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # frozen until rank 0 sends SIGCONT
    time.sleep(0.5)
    expect_error(lambda: E.wait(E.allreduce_async("after", x.ctypes.data, y.ctypes.data, [4], "float32"), 20),
                 "no answer from the other ranks", code="UNAVAILABLE")
else:
    start = time.time()
    h = E.allreduce_async("lost", x.ctypes.data, y.ctypes.data, [4], "float32")
    text = expect_error(lambda: E.wait(h, 20), "no answer from the other ranks for 2 s", "NVGROUP_TIMEOUT",
                        code="UNAVAILABLE")
    elapsed = time.time() - start
    check(elapsed < 6, "timeout took %.1f s" % elapsed)
    later = expect_error(lambda: E.allreduce_async("later", x.ctypes.data, y.ctypes.data, [4], "float32"),
                         code="UNAVAILABLE")
    check(later == text, "later submissions fail with the same error: %r vs %r" % (later, text))
    os.kill(pids[1], signal.SIGCONT)
start = time.time()
E.shutdown()
check(time.time() - start < 5, "shutdown after a timeout took %.1f s" % (time.time() - start))
from engine_common import _failures  # noqa: E402
print("[rank %d] %s" % (rank_size_from_env()[0], "FAILED" if _failures else "OK"), flush=True)
open(os.path.join(sys.argv[1], "done.%d" % rank), "w").close()
deadline = time.time() + 30
while time.time() < deadline and len(os.listdir(sys.argv[1])) < len(pids):
    time.sleep(0.05)
os._exit(1 if _failures else 0)
