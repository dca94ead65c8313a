"""Error worker: bad input fails with a clear error on every rank, never a hang.

Usage: comm_errors.py bad-group   (4 ranks, NVGROUP_GROUP_SIZE=3 in the environment)
       comm_errors.py bad-args
       comm_errors.py timeout     (3 ranks, one group)
       comm_errors.py abort       (3 ranks, one group)
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comm_common as cc  # noqa: E402


def expect_error(check, label, fragments, fn):
    try:
        fn()
    except RuntimeError as e:
        text = str(e)
        missing = [f for f in fragments if f not in text]
        check.expect(not missing, "%s: error %r lacks %r" % (label, text, missing))
        return text
    check.expect(False, "%s: no error raised" % label)
    return None


def allreduce_works(comm, check, label):
    a = np.arange(1, 6, dtype=np.float64) * (cc.RANK + 1)
    out = np.empty_like(a)
    comm.allreduce(a.ctypes.data, out.ctypes.data, a.size, "float64", "sum")
    total = cc.SIZE * (cc.SIZE + 1) // 2
    check.expect(np.array_equal(out, np.arange(1, 6) * float(total)), label + ": allreduce after the error is wrong")


def bad_group(check):
    expect_error(check, "env group size", ["INVALID_ARGUMENT", "NVGROUP_GROUP_SIZE=3", "does not divide",
                                           "4 ranks per node"], cc.make_communicator)
    os.environ.pop("NVGROUP_GROUP_SIZE")
    expect_error(check, "option group size", ["INVALID_ARGUMENT", "NVGROUP_GROUP_SIZE=3", "does not divide"],
                 lambda: cc.make_communicator(group_size=3))
    # Rank-dependent requests: every rank gets the same verdict.
    expect_error(check, "mismatched group size", ["differs across ranks"],
                 lambda: cc.make_communicator(group_size=1 if cc.RANK == 0 else 2))
    allreduce_works(cc.make_communicator(group_size=2), check, "after bad group sizes")


def bad_args(check):
    comm = cc.make_communicator()
    a = np.ones(16, np.uint8)
    for dtype in ("bool",):  # every numeric dtype reduces
        expect_error(check, dtype + " allreduce", ["INVALID_ARGUMENT", "does not support dtype " + dtype],
                     lambda: comm.allreduce(a.ctypes.data, a.ctypes.data, 16, dtype, "sum"))
    f = np.ones(4, np.float32)
    expect_error(check, "unknown op", ["unknown reduce op 'mean'"],
                 lambda: comm.allreduce(f.ctypes.data, f.ctypes.data, 4, "float32", "mean"))
    expect_error(check, "unknown dtype", ["unknown dtype 'complex64'"],
                 lambda: comm.allreduce(f.ctypes.data, f.ctypes.data, 4, "complex64", "sum"))
    expect_error(check, "null pointer", ["null"],
                 lambda: comm.allreduce(0, f.ctypes.data, 4, "float32", "sum"))
    expect_error(check, "root out of range", ["broadcast root %d is not a rank" % cc.SIZE],
                 lambda: comm.broadcast(f.ctypes.data, 16, cc.SIZE))
    expect_error(check, "roots disagree", ["ranks disagree on root"],
                 lambda: comm.broadcast(f.ctypes.data, 16, cc.RANK))
    expect_error(check, "allgatherv list length", ["bytes_per_rank has %d entries" % (cc.SIZE + 1)],
                 lambda: comm.allgatherv(f.ctypes.data, f.ctypes.data, [0] * (cc.SIZE + 1)))
    sizes = [4] * cc.SIZE
    sizes[0] = 4 if cc.RANK == 0 else 8  # rank 0 sends 4 bytes; the others expect 8
    out = np.zeros(8 * cc.SIZE, np.uint8)
    expect_error(check, "allgatherv disagreement", ["expects different per-rank byte counts"],
                 lambda: comm.allgatherv(f.ctypes.data, out.ctypes.data, sizes))
    # A bad pointer on one rank only: the argument check turns it into the same
    # error on every rank (no rank is left waiting in the data exchange).
    expect_error(check, "allgatherv null output on rank 0", ["rank 0 passed a null input or output pointer"],
                 lambda: comm.allgatherv(f.ctypes.data, 0 if cc.RANK == 0 else out.ctypes.data,
                                         [4] * cc.SIZE))
    expect_error(check, "broadcast null on the last rank", ["a rank passed a null pointer"],
                 lambda: comm.broadcast(0 if cc.RANK == cc.SIZE - 1 else f.ctypes.data, 16, 0))
    reg = cc.registered_view(comm, "float32", 64)
    expect_error(check, "output inside the registered buffer", ["output overlaps the registered buffer"],
                 lambda: comm.allreduce(f.ctypes.data, reg.ctypes.data + 16, 4, "float32", "sum"))
    expect_error(check, "input inside the registered buffer", ["input overlaps the registered buffer"],
                 lambda: comm.allreduce(reg.ctypes.data + 4, f.ctypes.data, 4, "float32", "sum"))
    expect_error(check, "cuda device", ["UNIMPLEMENTED", "NVGROUP_WITH_CUDA=1"],
                 lambda: cc.engine.Communicator(cc.COMM.py2f(), "cuda:0"))
    expect_error(check, "negative group size", ["group_size must be >= 0"],
                 lambda: cc.make_communicator(group_size=-2))
    expect_error(check, "zero timeout", ["peer_timeout_s must be positive"],
                 lambda: cc.make_communicator(timeout=0))
    expect_error(check, "unknown device", ["unknown device 'tpu'"],
                 lambda: cc.engine.Communicator(cc.COMM.py2f(), "tpu"))
    allreduce_works(comm, check, "after bad arguments")


def timeout(check):
    comm = cc.make_communicator(timeout=1.0)
    a = np.ones(1000, np.float32)
    if cc.RANK == cc.SIZE - 1:
        time.sleep(3.0)  # arrives after the others gave up
        expect_error(check, "late rank", ["UNAVAILABLE", "failed"],
                     lambda: comm.allreduce(a.ctypes.data, a.ctypes.data, a.size, "float32", "sum"))
    else:
        last = cc.SIZE - 1
        expect_error(check, "timeout", ["UNAVAILABLE", "timed out", "group ranks %d (rank %d) did not arrive" % (last, last)],
                     lambda: comm.allreduce(a.ctypes.data, a.ctypes.data, a.size, "float32", "sum"))


def abort(check):
    comm = cc.make_communicator(timeout=60.0)
    a = np.ones(1000, np.float32)
    cc.COMM.Barrier()
    if cc.RANK == 0:
        comm.abort()
        expect_error(check, "aborted rank", ["ABORTED"],
                     lambda: comm.allreduce(a.ctypes.data, a.ctypes.data, a.size, "float32", "sum"))
    else:
        start = time.time()
        expect_error(check, "peer of aborted rank", ["UNAVAILABLE", "group rank 0 (rank 0) failed"],
                     lambda: comm.allreduce(a.ctypes.data, a.ctypes.data, a.size, "float32", "sum"))
        check.expect(time.time() - start < 30, "peers waited for the timeout instead of seeing the abort")


def main():
    check = cc.Checker()
    {"bad-group": bad_group, "bad-args": bad_args, "timeout": timeout, "abort": abort}[sys.argv[1]](check)
    check.finish()


if __name__ == "__main__":
    cc.run_main(main)
