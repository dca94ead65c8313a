"""Worker: a stranger process reaches rank 0's dead-rank detection port before
the job's own ranks and impersonates them; the job must not care.

    liveness_stranger.py DELAY_S VICTIM          (under mpirun, pybind engine)
    liveness_stranger.py --stranger SIZE HOLD_S RECORD_DIR ADDR:PORT...

Every rank delays its connection to rank 0 by DELAY_S
(engine.testing.set_liveness_connect_delay). Meanwhile a thread of rank 0
waits for the listening addresses (engine.testing.liveness_listen_addresses)
and starts the stranger: a separate process that connects to each of them and
sends, each on its own connection, a HELLO with the public magic for every
rank number (also 0 and SIZE), the same followed by a guessed secret, random
garbage, half a HELLO, and nothing at all; it then sends forged heartbeats on
them for HOLD_S seconds and hangs up. Before the fix any of these HELLOs took
the rank's place, and the hang-up made rank 0 declare a live rank dead.

The job runs allreduces checked exactly (integer-valued float64) until the
stranger is gone, prints "rank R: ALLREDUCES_OK <steps>", then VICTIM prints
"rank V: KILL <time>" and SIGKILLs itself: the survivors' next collective must
fail naming it ("rank R: CAUGHT <time> <error>", exit 3).
"""
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

MAGIC = 0x4E56474C  # "NVGL", public: cc/transport/liveness_wire.h
HELLO, HEARTBEAT = 1, 2


def frame(kind, rank, a=0):
    return struct.pack("=IIiIQQ", MAGIC, kind, rank, 0, a, 0)


def stranger(size, hold_s, record, addresses):
    """Connects first, forges every rank's HELLO, sends garbage, hangs up."""
    conns = []
    forged = []
    for text in addresses:
        host, port = text.rsplit(":", 1)
        payloads = []
        for r in list(range(size + 1)) + [-1]:
            payloads.append((True, frame(HELLO, r)))
            payloads.append((True, frame(HELLO, r) + os.urandom(32)))
            payloads.append((True, frame(HELLO, r) + bytes(32)))
        payloads += [(False, os.urandom(64)), (False, os.urandom(7)), (False, frame(HELLO, 1)[:16]), (False, b"")]
        for is_hello, data in payloads:
            try:
                s = socket.create_connection((host, int(port)), timeout=2)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if data:
                    s.sendall(data)
            except OSError:
                continue
            conns.append(s)
            if is_hello:
                forged.append(s)
    connected_at = time.time()
    with open(os.path.join(record, "stranger.log"), "a") as f:
        f.write("STRANGER CONNECTED %.6f connections=%d\n" % (connected_at, len(conns)))
    end = time.monotonic() + hold_s
    beat = 0
    while time.monotonic() < end:  # heartbeats in the ranks' names
        beat += 1
        for s in forged:
            try:
                s.sendall(frame(HEARTBEAT, 1, beat))
            except OSError:
                pass
        time.sleep(0.2)
    for s in conns:
        s.close()
    with open(os.path.join(record, "stranger.log"), "a") as f:
        f.write("STRANGER HUNG UP %.6f\n" % time.time())


def start_stranger(size, hold_s, holder):
    import nvgroup_tf._engine as engine
    deadline = time.monotonic() + 60
    addresses = []
    while not addresses and time.monotonic() < deadline:
        addresses = engine.testing.liveness_listen_addresses()
        time.sleep(0.005)
    if not addresses:
        return
    holder.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--stranger", str(size), str(hold_s),
                                    os.environ["REL_RECORD_DIR"]] + ["%s:%d" % a for a in addresses]))


def job(delay_s, victim):
    import numpy as np

    import nvgroup_tf._engine as engine
    from rel_common import say

    world_rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    world_size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    engine.testing.set_liveness_connect_delay(delay_s)
    holder = []
    starter = None
    if world_rank == 0:
        starter = threading.Thread(target=start_stranger, args=(world_size, delay_s + 2.0, holder))
        starter.start()
    say("rank %d: CONNECTS_AFTER %.6f" % (world_rank, time.time() + delay_s))
    engine.init()
    rank, size = engine.rank(), engine.size()
    if starter is not None:
        starter.join()
        if not holder:
            say("rank 0: FAILED the stranger was not started")
            sys.exit(5)
    n = 33
    step = 0
    while True:
        # Element n: rank 0 says whether the stranger still runs, so every rank
        # leaves the loop at the same step.
        x = np.array([(rank + 1) * (step + k) % 1009 for k in range(n)] + [0.0], dtype=np.float64)
        if rank == 0:
            x[n] = 1.0 if (step < 20 or holder[0].poll() is None) else 0.0
        y = np.empty_like(x)
        engine.wait(engine.allreduce_async("stranger/%d" % (step % 4), x.ctypes.data, y.ctypes.data, [n + 1],
                                           "float64", "sum", keepalive=(x, y)))
        want = [sum((r + 1) * (step + k) % 1009 for r in range(size)) for k in range(n)]
        if list(y[:n]) != want:
            say("rank %d: FAILED step %d: got %r, want %r" % (rank, step, list(y[:n]), want))
            sys.exit(6)
        step += 1
        if y[n] == 0:
            break
        time.sleep(0.01)
    if rank == 0:
        say("rank 0: STRANGER_EXIT %d" % holder[0].wait())
    say("rank %d: ALLREDUCES_OK %d" % (rank, step))
    x = np.ones(5)
    engine.wait(engine.allreduce_async("before_kill", x.ctypes.data, x.ctypes.data, [5], "float64", "sum",
                                       keepalive=x))
    if rank == victim:
        say("rank %d: KILL %.6f" % (rank, time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for step in range(1000000):
            x = np.ones(9)
            engine.wait(engine.allreduce_async("after/%d" % (step % 3), x.ctypes.data, x.ctypes.data, [9],
                                               "float64", "sum", keepalive=x))
    except RuntimeError as e:
        say("rank %d: CAUGHT %.6f %s" % (rank, time.time(), e))
        sys.exit(3)
    say("rank %d: the loop ended without an error" % rank)
    sys.exit(4)


if __name__ == "__main__":
    if sys.argv[1] == "--stranger":
        stranger(int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5:])
    else:
        job(float(sys.argv[1]), int(sys.argv[2]))
