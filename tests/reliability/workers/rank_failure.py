"""Worker: one rank fails mid-loop; the survivors must learn which one.

    rank_failure.py VICTIM STEP kill|stop [allreduce|allgather|broadcast|reducescatter]

Every rank runs collectives (allreduce by default) through the engine (pybind
module). At STEP the
victim prints a timestamp and sends itself SIGKILL (dead: its sockets close)
or SIGSTOP (alive but silent: NVGROUP_TIMEOUT must fire). A survivor's wait()
must raise naming the victim; it prints "CAUGHT <unix time> <error>", then
"LATER <error>" for a collective submitted afterwards, and exits 3. Without
dead-rank detection (kill) the survivors sit in the collective until mpirun
kills them ~1 s later and never print CAUGHT; without the heartbeats (stop)
the timeout error cannot name the victim by host and pid.
"""
import os
import signal
import sys
import time

import numpy as np

import nvgroup_tf._engine as engine
from rel_common import say


def main():
    victim, at_step, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    kind = sys.argv[4] if len(sys.argv) > 4 else "allreduce"
    sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[how]
    engine.init()
    rank = engine.rank()
    rng = np.random.default_rng(100 + rank)
    try:
        for step in range(1000000):
            if rank == victim and step == at_step:
                say("rank %d: %s %.6f" % (rank, how.upper(), time.time()))
                os.kill(os.getpid(), sig)
            x = rng.standard_normal(257)
            y = np.empty_like(x)
            name = "%s/%d" % (kind, step % 4)
            if kind == "allreduce":
                h = engine.allreduce_async(name, x.ctypes.data, y.ctypes.data, list(x.shape), "float64", "sum",
                                           keepalive=(x, y))
            elif kind == "reducescatter":  # run with NVGROUP_GROUP_SIZE: the hierarchical reduce-scatter
                h = engine.reducescatter_async(name, x.ctypes.data, list(x.shape), "float64", "sum", keepalive=x)
            elif kind == "broadcast":
                h = engine.broadcast_async(name, x.ctypes.data, y.ctypes.data, list(x.shape), "float64",
                                           step % 3, keepalive=(x, y))
            else:
                h = engine.allgather_async(name, x.ctypes.data, list(x.shape), "float64", keepalive=x)
            engine.wait(h)
    except RuntimeError as e:
        say("rank %d: CAUGHT %.6f %s" % (rank, time.time(), e))
        # Later requests are refused at once with the same cause.
        x = np.ones(3)
        try:
            engine.wait(engine.allreduce_async("after", x.ctypes.data, x.ctypes.data, [3], "float64", "sum",
                                               keepalive=x))
            say("rank %d: a collective after the failure succeeded" % rank)
        except RuntimeError as later:
            say("rank %d: LATER %s" % (rank, later))
        sys.exit(3)
    say("rank %d: the loop ended without an error" % rank)
    sys.exit(4)


if __name__ == "__main__":
    main()
