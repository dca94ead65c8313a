"""Two collectives with one name in flight at once (np = 2, 3): whichever
ranks refuse the second one, every rank ends with the duplicate-name error
within seconds, and the engine keeps working (the name again, and a fresh one,
with exact sums on every rank).

Each trial forces one ordering, deterministically. The refusing ranks submit A
and then B while A is surely still in flight (the other ranks submit A only
after the barrier), so Push refuses B there. The other ranks submit A after
the barrier, wait for it, and then submit B, which their queue accepts: A has
completed on them. Their B can only end through rank 0 hearing of the refusal
on the other ranks. Refusing sets: rank 0 alone, the last rank alone, all but
the last, and every rank; B is an allgather (A's name, another collective), an
allreduce of A's signature (so B could meet a cached response), or a group of B
and a fresh member; the name is fresh or one reused by every trial (cached).
A last case swaps A and B on odd ranks (A's types differ: a mismatch, then B's
refusals)."""
import time

import numpy as np
from mpi4py import MPI

from engine_common import E, check, expect_error, finish

comm = MPI.COMM_WORLD
E.init()
rank, size = E.rank(), E.size()
MAX_SECONDS = 5.0   # an error within this long (a hang is caught by the wait below)
WAIT_S = 20.0       # longest wait of any handle
SUM = size * (size + 1) / 2  # every rank contributes rank + 1
DUP = "duplicate name"

mine = np.full(8, rank + 1, np.float32)


def allreduce(name, out):
    return E.allreduce_async(name, mine.ctypes.data, out.ctypes.data, [8], "float32")


def submit_b(kind, name, out, mate_out):
    """B: a second collective named `name`; returns its handles."""
    if kind == "allgather":
        return [E.allgather_async(name, mine.ctypes.data, [8], "float32")]
    if kind == "allreduce":
        return [allreduce(name, out)]
    return list(E.grouped_allreduce_async([(name, mine.ctypes.data, out.ctypes.data, [8], "float32"),
                                           (name + "/mate", mine.ctypes.data, mate_out.ctypes.data, [8],
                                            "float32")]))


def checked_allreduce(name, what):
    out = np.zeros(8, np.float32)
    try:
        E.wait(allreduce(name, out), WAIT_S)
    except Exception as e:  # noqa: BLE001 (reported)
        check(False, "%s: %s" % (what, e))
        return
    check(np.all(out == SUM), "%s: got %s, want %s" % (what, out[:2], SUM))


def trial(t, refusers, kind, name):
    what = "trial %d (refusing ranks %s, B %s, name %r)" % (t, sorted(refusers), kind, name)
    out_a, out_b, mate_out = (np.zeros(8, np.float32) for _ in range(3))
    texts = []
    start = time.monotonic()
    if rank in refusers:
        h_a = allreduce(name, out_a)
        texts.append(expect_error(lambda: submit_b(kind, name, out_b, mate_out), DUP, "'%s'" % name,
                                  code="INVALID_ARGUMENT"))
        comm.Barrier()
        E.wait(h_a, WAIT_S)
        check(np.all(out_a == SUM), "%s: A got %s" % (what, out_a[:2]))
    else:
        comm.Barrier()
        E.wait(allreduce(name, out_a), WAIT_S)
        check(np.all(out_a == SUM), "%s: A got %s" % (what, out_a[:2]))
        start = time.monotonic()
        for h in submit_b(kind, name, out_b, mate_out):
            texts.append(expect_error(lambda: E.wait(h, WAIT_S), DUP, code="INVALID_ARGUMENT"))
    elapsed = time.monotonic() - start
    check(elapsed < MAX_SECONDS, "%s: the error took %.1f s" % (what, elapsed))
    check(all("Stalled" not in s for s in texts), "%s: a stall error: %s" % (what, texts))
    # The same text on every rank for B's name: the refusing ranks' own
    # error, and the one rank 0 sent to the others.
    firsts = comm.allgather(texts[0] if texts else "")
    if len(refusers) == 1:
        check(len(set(firsts)) == 1, "%s: different errors across ranks: %s" % (what, firsts))
    check(all(("'%s'" % name) in s for s in firsts), "%s: errors not naming %r: %s" % (what, name, firsts))
    # The name completed everywhere: reusing it is legal and works, on every rank.
    checked_allreduce(name, what + ", the name again")
    checked_allreduce("fresh/%d" % t, what + ", a fresh name")


def swapped(t, name):
    """Every rank refuses B, but odd ranks submit the allgather first: A's
    types differ (a mismatch on every rank), then B's refusals meet."""
    what = "trial %d (A and B swapped on odd ranks, name %r)" % (t, name)
    out_a, out_b = np.zeros(8, np.float32), np.zeros(8, np.float32)
    first_gather = rank % 2 == 1
    h_a = (E.allgather_async(name, mine.ctypes.data, [8], "float32") if first_gather
           else allreduce(name, out_a))
    expect_error(lambda: (allreduce(name, out_b) if first_gather
                          else E.allgather_async(name, mine.ctypes.data, [8], "float32")),
                 DUP, "'%s'" % name, code="INVALID_ARGUMENT")
    comm.Barrier()
    start = time.monotonic()
    expect_error(lambda: E.wait(h_a, WAIT_S), "Mismatched collective types for '%s'" % name,
                 code="FAILED_PRECONDITION")
    check(time.monotonic() - start < MAX_SECONDS, "%s: the mismatch took too long" % what)
    checked_allreduce(name, what + ", the name again")
    checked_allreduce("fresh/%d" % t, what + ", a fresh name")


refusing_sets = []
for s in ({0}, {size - 1}, set(range(size - 1)), set(range(size))):
    if s not in refusing_sets:
        refusing_sets.append(s)
t = 0
for repeat in range(2):
    for refusers in refusing_sets:
        for kind in ("allgather", "allreduce", "group"):
            for name in ("dup/%d" % t, "dup/reused"):
                trial(t, refusers, kind, name)
                t += 1
for repeat in range(3):
    swapped(t, "dup/swapped")
    t += 1
print("[rank %d] %d trials" % (rank, t), flush=True)
E.shutdown()
finish()
