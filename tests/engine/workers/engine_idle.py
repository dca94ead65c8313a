"""An idle engine sleeps (Note [An idle rank sleeps] in cc/engine/wait_policy.h),
np = 2 or 3:
  1. after a grouped step, a second with nothing submitted runs a handful of
     background cycles, not one per NVGROUP_CYCLE_TIME (1 ms: about 1000);
  2. a rank that submits while its peers sleep gets the right result once
     they submit 0.3 s later (the first waits in the agreement), and a 4-byte
     allreduce right after a quiet spell is right on every rank;
  3. the background thread is named nvg-loop;
  4. one rank shuts down while the others still sleep: every rank's shutdown
     returns and a later init works."""
import os
import time

import numpy as np
from mpi4py import MPI

from engine_common import E, check, check_close, finish, rank_data, reference

comm = MPI.COMM_WORLD
E.init()
rank, size = E.rank(), E.size()


def run_group(prefix, shapes, seed):
    xs = [rank_data(seed + i, rank, s, "float32") for i, s in enumerate(shapes)]
    ys = [np.zeros_like(x) for x in xs]
    items = [("%s/%d" % (prefix, i), x.ctypes.data, y.ctypes.data, list(x.shape), "float32")
             for i, (x, y) in enumerate(zip(xs, ys))]
    E.wait_all(E.grouped_allreduce_async(items))
    for i, (s, y) in enumerate(zip(shapes, ys)):
        check_close("%s/%d" % (prefix, i), y, reference(seed + i, size, s, "float32", "sum"), "float32")


shapes = [[7], [33, 3], [100]]
for _ in range(3):
    run_group("g", shapes, 10)

# 1. A quiet second: the loop waits for its queue, not for the 1 ms cycle.
comm.Barrier()
before = E.stats()["cycles"]
time.sleep(1.0)
cycles = E.stats()["cycles"] - before
# 1 s / 50 ms = 20 idle cycles; the old loop ran one per millisecond.
check(cycles <= 40, "%d background cycles in an idle second" % cycles)

# 2. One rank submits 0.3 s before the others.
comm.Barrier()
if rank != 0:
    time.sleep(0.3)
run_group("late", shapes, 30)
x = np.array([rank + 1], np.float32)
y = np.zeros(1, np.float32)
comm.Barrier()
time.sleep(0.2)
E.wait(E.allreduce_async("small", x.ctypes.data, y.ctypes.data, [1], "float32"), 30)
check(y[0] == size * (size + 1) / 2, "4-byte allreduce after a quiet spell: %r" % y)

# 3. The thread's name.
names = []
for tid in os.listdir("/proc/self/task"):
    try:
        with open("/proc/self/task/%s/comm" % tid) as f:
            names.append(f.read().strip())
    except OSError:
        pass
check("nvg-loop" in names, "no thread named nvg-loop among %r" % names)

# 4. Shutdown while the peers sleep.
if rank != 0:
    time.sleep(0.3)
E.shutdown()
E.init()
run_group("again", shapes, 50)
E.shutdown()
finish()
