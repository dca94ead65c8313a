"""Allreduce worker: every op x dtype x count against a float64 reference,
every element, and bitwise equality across ranks.

Usage: comm_allreduce.py [--registered-bytes N] [--expect-groups G] [--counts c,c,...]
                         [--largest-dtypes d,d,...]
--largest-dtypes limits the largest count to those dtypes (every op), to keep
the slow configurations short; the other counts always run for every dtype.
The algorithm and group size come from NVGROUP_* in the environment.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comm_common as cc  # noqa: E402

VARIANTS = ["out", "inplace", "reg", "reg-inplace"]


def run_case(comm, check, case_id, dtype, op, count, variant):
    mine = cc.random_input(np.random.default_rng([7, case_id, cc.RANK]), dtype, op, count)
    itemsize = np.dtype(cc.STORAGE[dtype]).itemsize
    if variant.startswith("reg") and count * itemsize > comm.registered_capacity():
        variant = "out"  # does not fit: exercise the piecewise path instead
    if variant == "out":
        src, dst = mine.copy(), np.empty_like(mine)
    elif variant == "inplace":
        src = dst = mine.copy()
    elif variant == "reg":
        src = cc.registered_view(comm, dtype, count)
        src[:] = mine
        dst = np.empty_like(mine)
    else:
        src = dst = cc.registered_view(comm, dtype, count)
        src[:] = mine
    before = src.copy()
    comm.allreduce(src.ctypes.data, dst.ctypes.data, count, dtype, op)
    out = dst.copy()
    label = "%s %s count=%d %s" % (dtype, op, count, variant)
    check.compare(label, out, mine, dtype, op)
    if variant == "out":
        check.expect(np.array_equal(src.view(np.uint8), before.view(np.uint8)),
                     label + ": out-of-place allreduce modified its input")


def check_fusion_invariance(comm, check, dtype):
    """A fused buffer gives the same bits as its parts reduced one by one."""
    rng = np.random.default_rng([11, cc.RANK])
    a = cc.random_input(rng, dtype, "sum", 1000)
    b = cc.random_input(rng, dtype, "sum", (1 << 16) + 5)
    fused = np.concatenate([a, b])
    comm.allreduce(fused.ctypes.data, fused.ctypes.data, fused.size, dtype, "sum")
    for part in (a, b):
        comm.allreduce(part.ctypes.data, part.ctypes.data, part.size, dtype, "sum")
    check.expect(np.array_equal(fused.view(np.uint8), np.concatenate([a, b]).view(np.uint8)),
                 "%s: fused allreduce differs bitwise from the unfused parts" % dtype)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--registered-bytes", type=int, default=0)
    p.add_argument("--expect-groups", type=int, default=1)
    p.add_argument("--counts", default="0,1,7,1000,%d" % ((1 << 20) + 3))
    p.add_argument("--largest-dtypes", default=",".join(cc.DTYPES))
    args = p.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    largest_dtypes = args.largest_dtypes.split(",")
    comm = cc.make_communicator(registered_bytes=args.registered_bytes)
    check = cc.Checker()
    # Segments are unlinked once mapped: nothing named after any rank's pid remains.
    pids = cc.COMM.allgather(os.getpid())
    cc.COMM.Barrier()
    leaked = [f for f in os.listdir("/dev/shm") if any(f.startswith("nvgroup.%d." % p) for p in pids)]
    check.expect(not leaked, "shared-memory names left in /dev/shm: %s" % leaked)
    topo = comm.topology()
    check.expect(topo["rank"] == cc.RANK and topo["size"] == cc.SIZE, "topology %r" % topo)
    check.expect(topo["group_count"] == args.expect_groups,
                 "expected %d groups, topology %r" % (args.expect_groups, topo))
    check.expect(topo["group_count"] * topo["group_size"] == cc.SIZE, "topology %r" % topo)
    if args.registered_bytes:
        check.expect(comm.registered_capacity() == args.registered_bytes,
                     "capacity %d" % comm.registered_capacity())

    case_id = 0
    for dtype in cc.DTYPES:
        for op in cc.OPS:
            for count in counts:
                if count == counts[-1] and dtype not in largest_dtypes:
                    continue
                run_case(comm, check, case_id, dtype, op, count, VARIANTS[case_id % len(VARIANTS)])
                case_id += 1
    # Every variant (in/out of place, in/outside the registered buffer) for a few
    # combinations at the second largest count, and for float32 sum at the largest.
    for dtype, op, sizes in (("float32", "sum", counts[-2:]), ("bfloat16", "average", counts[-2:-1]),
                             ("int64", "max", counts[-2:-1])):
        for count in sizes:
            for variant in VARIANTS:
                run_case(comm, check, case_id, dtype, op, count, variant)
                case_id += 1
    for dtype in ("float32", "float16"):
        check_fusion_invariance(comm, check, dtype)
    check.finish()


if __name__ == "__main__":
    cc.run_main(main)
