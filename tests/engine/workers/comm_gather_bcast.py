"""Allgatherv and broadcast worker: uneven sizes (including 0), in-place
allgatherv, broadcast from every root; random bytes, every byte checked."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comm_common as cc  # noqa: E402


def payload(seed, rank, nbytes):
    return np.random.default_rng([seed, rank]).integers(0, 256, nbytes, dtype=np.uint8)


def check_allgatherv(comm, check, seed, sizes, in_place):
    expected = np.concatenate([payload(seed, r, sizes[r]) for r in range(cc.SIZE)])
    out = np.zeros(max(1, sum(sizes)), np.uint8)
    offset = sum(sizes[:cc.RANK])
    if in_place:
        out[offset:offset + sizes[cc.RANK]] = payload(seed, cc.RANK, sizes[cc.RANK])
        src = out.ctypes.data + offset
    else:
        mine = payload(seed, cc.RANK, sizes[cc.RANK])
        src = mine.ctypes.data
    comm.allgatherv(src, out.ctypes.data, sizes)
    label = "allgatherv sizes=%s in_place=%s" % (sizes, in_place)
    check.expect(np.array_equal(out[:sum(sizes)], expected), label + ": wrong bytes")
    check.same_on_all_ranks(label, out)


def main():
    comm = cc.make_communicator()
    check = cc.Checker()
    n = cc.SIZE
    patterns = [
        [(37 * r) % 11 for r in range(n)],            # uneven, rank 0 sends 0
        [0] * n,                                       # nothing at all
        [(1 << 20) + 3 if r == n - 1 else 0 for r in range(n)],  # one big, others empty
        [1000 + r for r in range(n)],
    ]
    for i, sizes in enumerate(patterns):
        for in_place in (False, True):
            check_allgatherv(comm, check, 100 + i, sizes, in_place)
    for root in range(n):
        for nbytes in (0, 1, 1000, (1 << 20) + 3):
            expected = payload(200 + root, root, nbytes)
            buf = expected.copy() if cc.RANK == root else np.zeros(nbytes, np.uint8)
            comm.broadcast(buf.ctypes.data, nbytes, root)
            check.expect(np.array_equal(buf, expected),
                         "broadcast root=%d bytes=%d: wrong bytes" % (root, nbytes))
    check.finish()


if __name__ == "__main__":
    cc.run_main(main)
