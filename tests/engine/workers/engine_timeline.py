"""NVGROUP_TIMELINE (np = 2): rank 0 writes a valid Chrome trace with B/E
pairs for every phase of every tensor; argv[1] is the file."""
import json
import os
import sys

import numpy as np

from engine_common import E, check, finish

path = sys.argv[1]
os.environ["NVGROUP_TIMELINE"] = path
E.init()
rank, size = E.rank(), E.size()
xs = [np.full(100 * (i + 1), i, np.float32) for i in range(3)]
ys = [np.zeros_like(v) for v in xs]
for step in range(2):  # a group: one fused bucket, so the fusion phases appear
    hs = E.grouped_allreduce_async([("tl/w%d" % i, xs[i].ctypes.data, ys[i].ctypes.data, [xs[i].size], "float32")
                                    for i in range(3)])
    for h in hs:
        E.wait(h, 30)
solo = E.allreduce_async("tl/solo", xs[2].ctypes.data, ys[2].ctypes.data, [xs[2].size], "float32")
E.wait(solo, 30)
g = E.wait(E.allgather_async("tl/gather", xs[0].ctypes.data, [10], "float32", keepalive=xs[0]), 30)
E.wait(E.broadcast_async("tl/bcast", xs[1].ctypes.data, ys[1].ctypes.data, [xs[1].size], "float32", 0), 30)
E.shutdown()

if rank == 0:
    with open(path) as f:
        events = json.load(f)  # valid JSON after shutdown
    rows = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    check(set(rows.values()) == {"tl/w0", "tl/w1", "tl/w2", "tl/solo", "tl/gather", "tl/bcast"}, "rows %s" % rows)
    phases = {}
    for e in events:
        if e["ph"] in "BE":
            phases.setdefault((rows[e["tid"]], e["name"]), []).append((e["ph"], e["ts"]))
    for name in ("tl/w0", "tl/w1", "tl/w2"):
        for phase in ("QUEUE", "NEGOTIATE", "FUSION_COPY_IN", "ALLREDUCE", "FUSION_COPY_OUT"):
            seq = phases.get((name, phase), [])
            check([p for p, _ in seq] == ["B", "E"] * 2, "%s %s: %s" % (name, phase, seq))
            check(all(seq[i][1] <= seq[i + 1][1] for i in range(0, len(seq), 2)), "%s %s: E before B" % (name, phase))
    # A lone tensor is a bucket of one on the fused path: the same phases.
    for phase in ("FUSION_COPY_IN", "ALLREDUCE", "FUSION_COPY_OUT"):
        check([p for p, _ in phases.get(("tl/solo", phase), [])] == ["B", "E"], "solo %s phase" % phase)
    check([p for p, _ in phases.get(("tl/gather", "ALLGATHER"), [])] == ["B", "E"], "allgather phase")
    check([p for p, _ in phases.get(("tl/bcast", "BROADCAST"), [])] == ["B", "E"], "broadcast phase")
E.finalize_mpi()  # the engine initialized MPI (no mpi4py here), so it finalizes it
finish()
