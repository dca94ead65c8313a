"""Communicator::ReduceScatter and Alltoallv (CPU): reduce-scatter over uneven
row counts (incl. 0) for every dtype and op, with a registered buffer small
enough that the group step runs in several pieces, each rank's part bitwise
equal to the Allreduce of the same input; Alltoallv with uneven and zero byte
counts, every byte checked; mismatched Alltoallv counts fail on every rank."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comm_common as cc  # noqa: E402
from numeric_data import DTYPES, OPS, STORAGE, random_input  # noqa: E402



def main():
    check = cc.Checker()
    n, me = cc.SIZE, cc.RANK
    small = cc.make_communicator(registered_bytes=4096)  # pieces of 4 KiB
    default = cc.make_communicator()
    for comm, tag in ((small, "4KiB"), (default, "default")):
        for dtype in DTYPES + ["uint8", "int8", "uint16", "int16"]:
            for op in OPS:
                for counts in ([(7 * r + 3) % 5 for r in range(n)], [0] * (n - 1) + [3001], [1000 + r for r in range(n)]):
                    total = sum(counts)
                    rng = np.random.default_rng([len(counts), total, me, OPS.index(op)])
                    if dtype in STORAGE:
                        x = random_input(rng, dtype, op, total)
                    else:
                        x = rng.integers(-3 if dtype.startswith("int") else 0, 4, total).astype(dtype)
                    out = np.zeros(max(1, counts[me]), x.dtype)
                    comm.reduce_scatter(x.ctypes.data, out.ctypes.data, counts, dtype, op)
                    full = np.zeros(max(1, total), x.dtype)
                    comm.allreduce(x.ctypes.data, full.ctypes.data, total, dtype, op)
                    a = sum(counts[:me])
                    label = "%s reduce_scatter %s %s counts=%s" % (tag, dtype, op, counts)
                    check.expect(out[:counts[me]].tobytes() == full[a:a + counts[me]].tobytes(),
                                 label + ": differs from the allreduce's rows")
                    if dtype in STORAGE:  # the allreduce itself against the float64 reference
                        check.compare(label + " (allreduce)", full[:total], x, dtype, op)
    # Alltoallv: rank s sends (s + d) % 4 * 1000 + d bytes to rank d (some zero).
    def nbytes(s, d):
        return ((s + d) % 4) * 1000 + (d if (s + d) % 4 else 0)

    send = [nbytes(me, d) for d in range(n)]
    recv = [nbytes(s, me) for s in range(n)]
    data = np.random.default_rng([9, me]).integers(0, 256, max(1, sum(send)), dtype=np.uint8)
    out = np.zeros(max(1, sum(recv)), np.uint8)
    default.alltoallv(data.ctypes.data, send, out.ctypes.data, recv)
    want = []
    for s in range(n):
        theirs = np.random.default_rng([9, s]).integers(0, 256, max(1, sum(nbytes(s, d) for d in range(n))),
                                                         dtype=np.uint8)
        start = sum(nbytes(s, d) for d in range(me))
        want.append(theirs[start:start + nbytes(s, me)])
    check.expect(np.array_equal(out[:sum(recv)], np.concatenate(want)), "alltoallv bytes")
    # A rank that expects different counts: the same error everywhere, no hang.
    wrong = list(recv)
    if me == 0:
        wrong[n - 1] += 1
    try:
        default.alltoallv(data.ctypes.data, send, out.ctypes.data, wrong)
        check.expect(False, "mismatched alltoallv counts were accepted")
    except RuntimeError as e:  # the communicator binding raises RuntimeError
        check.expect("expects different byte counts" in str(e), "alltoallv mismatch text: %s" % e)
    default.alltoallv(data.ctypes.data, send, out.ctypes.data, recv)  # still usable
    check.expect(np.array_equal(out[:sum(recv)], np.concatenate(want)), "alltoallv after the error")
    check.finish()


cc.run_main(main)
