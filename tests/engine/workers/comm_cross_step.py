"""The cross-group step (reduce-scatter + allgather among the peers, CrossExchange)
against the flat path, on 4 ranks in one launch:

  flat  NVGROUP_ALLREDUCE_ALGORITHM=mpi (the cross exchange over all ranks)
  g1    4 groups of 1 (group_size=1, forced hierarchy): the whole reduction is cross steps
  g2    2 groups of 2 (group_size=2): group step + cross step between 2 groups

With --serialized, MPI is initialized without MPI_THREAD_MULTIPLE, so the
exchange has no progress thread and Wait() progresses the jobs itself.
Small registered buffer and pipeline chunk so every large call runs in several
pieces of many pipelined chunks (two chunks in the cross step at a time).
Checks: dyadic data (sums exact in any order) give the flat result bit for bit
for every dtype/op/count; random data match the float64 reference within the
fold-order tolerance and are bitwise identical on all ranks; and the bytes this
rank posted in cross exchanges (engine.cross_bytes_sent) and the cross jobs it
started as allgather + fold (engine.cross_allgather_jobs) by a hierarchical
call equal, call by call, the counts of the skeleton's geometry recomputed
here: per chunk, for a slice whose (P-1) copies exceed ALLGATHER_MAX
(NVGROUP_CROSS_ALLGATHER_MAX_BYTES; twice that for P = 2) the reduce-scatter +
allgather count (the peers' parts of our slice plus (P-1) copies of our own
part), else (P-1) copies of the slice (allgather + fold). With P = 2 both
counts of bytes are the same, so there only the job count tells the variants
apart.
"""
import os
import sys

import numpy as np

if "--serialized" in sys.argv:  # MPI without THREAD_MULTIPLE: CrossExchange progresses in Wait()
    import mpi4py
    mpi4py.rc.thread_level = "serialized"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comm_common as cc  # noqa: E402

REGISTERED = 1 << 18
CHUNK = 1 << 14
COUNTS = [1, 7, 1000, 100003]
ALLGATHER_MAX = 4096  # below the 16 KiB chunk: both variants in one launch
ESIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8}


def create(algorithm, group_size):
    os.environ["NVGROUP_ALLREDUCE_ALGORITHM"] = algorithm  # read at creation
    os.environ["NVGROUP_CROSS_ALLGATHER_MAX_BYTES"] = str(ALLGATHER_MAX)
    return cc.make_communicator(group_size=group_size, registered_bytes=REGISTERED, pipeline_chunk=CHUNK)


def split(count, parts, esize):
    """ChunkSlices: `parts` contiguous 16-byte aligned pieces of `count` elements."""
    unit = max(1, 16 // esize)
    per = -(-count // parts)
    stride = -(-per // unit) * unit
    return [(count if r + 1 == parts else min(count, (r + 1) * stride)) - min(count, r * stride)
            for r in range(parts)]


def expected_cross_bytes(topo, count, esize):
    """Bytes one allreduce of `count` elements makes this rank post in cross
    steps, and the ideal of its variants without the geometry's rounding:
    2 (P-1)/P of each slice by reduce-scatter + allgather, (P-1) slices by
    allgather + fold; and how many of its cross jobs take allgather + fold."""
    g, p = topo["group_size"], topo["group_count"]
    me, peer = topo["group_rank"], topo["group_index"]
    total = ideal = allgather_jobs = 0
    piece_elems = REGISTERED // esize  # numpy inputs are outside the registered buffer
    for first in range(0, count, piece_elems):
        n = min(piece_elems, count - first)
        unit = max(1, 16 // esize) * g
        chunk_elems = max(unit, (CHUNK // esize) // unit * unit)
        for c0 in range(0, n, chunk_elems):
            s = split(min(chunk_elems, n - c0), g, esize)[me]
            if s == 0:
                continue
            # two peers: twice the setting (both variants send the same bytes there)
            if (p - 1) * s * esize <= (2 * ALLGATHER_MAX if p == 2 else ALLGATHER_MAX):
                total += (p - 1) * s * esize
                ideal += (p - 1) * s * esize
                allgather_jobs += 1
                continue
            parts = split(s, p, esize)
            total += sum(parts[q] for q in range(p) if q != peer) * esize + (p - 1) * parts[peer] * esize
            ideal += 2 * (p - 1) / p * s * esize
    return total, ideal, allgather_jobs


def main():
    comms = {"flat": create("mpi", 0), "g1": create("hierarchical", 1), "g2": create("auto", 2)}
    check = cc.Checker()
    topo = {k: c.topology() for k, c in comms.items()}
    check.expect((topo["g1"]["group_count"], topo["g2"]["group_count"]) == (4, 2),
                 "unexpected group counts %s" % {k: t["group_count"] for k, t in topo.items()})
    bytes_total = {"g1": [0, 0], "g2": [0, 0]}  # measured, the variants' ideal
    allgather_total = {"g1": 0, "g2": 0}

    def run(name, x, dtype, op, label):
        out = np.empty_like(x)
        before = cc.engine.cross_bytes_sent()
        jobs_before = cc.engine.cross_allgather_jobs()
        comms[name].allreduce(x.ctypes.data, out.ctypes.data, x.size, dtype, op)
        sent = cc.engine.cross_bytes_sent() - before
        allgather_jobs = cc.engine.cross_allgather_jobs() - jobs_before
        # the flat path is itself a cross exchange over all ranks (FlatAllreduce): its
        # bytes follow its own piece geometry, not the skeleton's; only the hierarchy is counted
        if name != "flat":
            want, ideal, want_jobs = expected_cross_bytes(topo[name], x.size, ESIZE[dtype])
            check.expect(sent == want, "%s %s: posted %d cross bytes, want %d" % (label, name, sent, want))
            check.expect(allgather_jobs == want_jobs, "%s %s: %d cross jobs by allgather + fold, want %d"
                         % (label, name, allgather_jobs, want_jobs))
            allgather_total[name] += allgather_jobs
            bytes_total[name][0] += sent
            bytes_total[name][1] += ideal
        return out

    case = 0
    for dtype in cc.DTYPES:
        for op in cc.OPS:
            for count in COUNTS:
                case += 1
                rng = np.random.default_rng([14, case, cc.RANK])
                label = "dyadic %s %s count=%d" % (dtype, op, count)
                x = cc.dyadic_input(rng, dtype, op, count)
                outs = {name: run(name, x, dtype, op, label) for name in comms}
                check.compare(label + " flat", outs["flat"], x, dtype, op)
                for name in ("g1", "g2"):
                    check.expect(np.array_equal(outs[name].view(np.uint8), outs["flat"].view(np.uint8)),
                                 "%s: %s differs bitwise from the flat path" % (label, name))
    for dtype in ("float16", "bfloat16", "float32", "float64", "int32"):
        for op in ("sum", "average", "product"):
            for count in (1000, 100003):
                case += 1
                rng = np.random.default_rng([41, case, cc.RANK])
                x = cc.random_input(rng, dtype, op, count)
                for name in ("g1", "g2"):
                    label = "random %s %s count=%d %s" % (dtype, op, count, name)
                    check.compare(label, run(name, x, dtype, op, label), x, dtype, op)
    for name, (got, ideal) in bytes_total.items():
        # The geometry's alignment rounding only: within 1% of 2 (P-1)/P of the slices.
        check.expect(abs(got - ideal) <= 0.01 * ideal,
                     "%s: %d cross bytes in all, ideal of the variants %.0f" % (name, got, ideal))
        if cc.RANK == 0:
            print("%s: %d cross bytes posted by rank 0 (ideal of the variants: %.0f)"
                  % (name, got, ideal), flush=True)
    # Both variants ran at each group count (the launch covers both sides of the limit).
    for name, jobs in allgather_total.items():
        check.expect(jobs > 0, "%s: no cross job took allgather + fold" % name)
    if cc.RANK == 0:
        print("cross jobs by allgather + fold on rank 0: %s" % allgather_total, flush=True)
        levels = {cc.MPI.THREAD_MULTIPLE: "multiple", cc.MPI.THREAD_SERIALIZED: "serialized"}
        print("MPI thread level: %s" % levels.get(cc.MPI.Query_thread(), "other"), flush=True)
    check.finish()


if __name__ == "__main__":
    cc.run_main(main)
