"""Fusion-threshold sweep (a benchmark, not a test; see Note [Fusion threshold]
in cc/engine/fusion.h). Each rank submits a ResNet-50-sized gradient set (161
float32 tensors, 25.6 M elements, 102 MB) all at once, as a step whose
gradients are all ready, and times the step for several NVGROUP_FUSION_THRESHOLD
values (re-initializing the engine for each). Prints a table; writes JSON to
argv[1] when given.

    mpirun -np 2 python tests/engine/workers/engine_fusion_sweep.py [out.json]
"""
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from engine_common import E

comm = MPI.COMM_WORLD
rng = np.random.default_rng(0)
# 53 conv kernels (log-uniform 4 K .. 2.4 M elements), 106 batch-norm vectors
# (64 .. 2048), the 2048x1000 classifier and its bias: ResNet-50's shape mix.
sizes = [int(s) for s in np.exp(rng.uniform(np.log(4096), np.log(2.4e6), 53))]
sizes = [int(s * 23.5e6 / sum(sizes)) for s in sizes]
sizes += [int(rng.choice([64, 128, 256, 512, 1024, 2048])) for _ in range(106)] + [2048 * 1000, 1000]
tensors = [np.random.default_rng(i).uniform(-1, 1, n).astype(np.float32) for i, n in enumerate(sizes)]
outs = [np.empty_like(t) for t in tensors]
total = sum(t.nbytes for t in tensors)

rows = []
for threshold in (0, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 128 << 20):
    os.environ["NVGROUP_FUSION_THRESHOLD"] = str(threshold)
    E.init()
    times = []
    for step in range(4):  # step 0 negotiates and warms up; 1..3 are timed (cached)
        comm.Barrier()
        start = time.perf_counter()
        hs = [E.allreduce_async("grad/%d" % i, t.ctypes.data, o.ctypes.data, [t.size], "float32", "average")
              for i, (t, o) in enumerate(zip(tensors, outs))]
        for h in hs:
            E.wait(h)
        times.append(time.perf_counter() - start)
    E.shutdown()
    t = float(np.mean(comm.allgather(float(np.median(times[1:])))))
    rows.append({"threshold_bytes": threshold, "step_ms": t * 1e3, "algbw_GBps": total / t / 1e9})

if comm.Get_rank() == 0:
    print("# fusion threshold sweep: %d ranks, %d float32 tensors, %d bytes per step" % (
        comm.Get_size(), len(tensors), total))
    print("# %14s %12s %12s" % ("threshold(B)", "step(ms)", "algbw(GB/s)"))
    for r in rows:
        print("  %14d %12.1f %12.3f" % (r["threshold_bytes"], r["step_ms"], r["algbw_GBps"]))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"ranks": comm.Get_size(), "bytes_per_step": total, "rows": rows}, f, indent=1)
