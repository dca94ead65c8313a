"""Peer timeout (np >= 2, NVGROUP_TIMEOUT=2): the last rank freezes itself
(SIGSTOP); every other rank's pending request fails with UNAVAILABLE within
the timeout plus the liveness probe's grace, naming the frozen rank; their
loops stop and later submissions fail with the same error. Then rank 0
resumes the frozen rank, which finds its own loop timed out too.

Every rank prints OK and leaves with os._exit: the negotiation requests left
unfinished by design make MPI_Finalize unsafe, so the pytest side checks the OK
lines, not mpirun's exit code. Ranks coordinate through files in argv[1]
(MPI is unusable by then): the frozen rank is resumed only after every live
rank has finished its checks, and nobody exits before everyone is done, since
mpirun kills the others when the first rank exits without MPI_Finalize."""
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

from engine_common import E, _failures, check, expect_error

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
frozen = size - 1
pids = comm.allgather(os.getpid())
folder = sys.argv[1]


def wait_for_files(prefix, count, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline and len([f for f in os.listdir(folder) if f.startswith(prefix)]) < count:
        time.sleep(0.05)


E.init()
x = np.ones(4, np.float32)
y = np.zeros(4, np.float32)
E.wait(E.allreduce_async("before", x.ctypes.data, y.ctypes.data, [4], "float32"), 30)
comm.Barrier()
if rank == frozen:
    os.kill(os.getpid(), signal.SIGSTOP)  # frozen until rank 0 sends SIGCONT
    time.sleep(0.5)
    expect_error(lambda: E.wait(E.allreduce_async("after", x.ctypes.data, y.ctypes.data, [4], "float32"), 20),
                 "no answer from the other ranks", code="UNAVAILABLE")
else:
    start = time.time()
    h = E.allreduce_async("lost", x.ctypes.data, y.ctypes.data, [4], "float32")
    text = expect_error(lambda: E.wait(h, 20), "no answer from the other ranks for 2 s", "NVGROUP_TIMEOUT",
                        "ranks [%d] did not answer a liveness probe" % frozen, code="UNAVAILABLE")
    elapsed = time.time() - start
    check(elapsed < 7, "timeout took %.1f s (2 s timeout + 2 s liveness probe)" % elapsed)
    later = expect_error(lambda: E.allreduce_async("later", x.ctypes.data, y.ctypes.data, [4], "float32"),
                         code="UNAVAILABLE")
    check(later == text, "later submissions fail with the same error: %r vs %r" % (later, text))
    open(os.path.join(folder, "checked.%d" % rank), "w").close()
    if rank == 0:
        wait_for_files("checked.", size - 1)
        os.kill(pids[frozen], signal.SIGCONT)
start = time.time()
E.shutdown()
check(time.time() - start < 5, "shutdown after a timeout took %.1f s" % (time.time() - start))
print("[rank %d] %s" % (rank, "FAILED" if _failures else "OK"), flush=True)
open(os.path.join(folder, "done.%d" % rank), "w").close()
wait_for_files("done.", size)
os._exit(1 if _failures else 0)
