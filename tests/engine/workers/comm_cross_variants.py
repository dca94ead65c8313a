"""The two variants of the cross-group step (CrossExchange,
cc/algorithms/cross_exchange.h: reduce-scatter + allgather, and allgather +
local fold for small slices) and the chunked pipeline (Note [Chunk size] in
cc/algorithms/hierarchical_allreduce.h), bit for bit, on every rank.

Communicators of one launch, all through the hierarchy (CPU, forced):
  rsag       reduce-scatter + allgather only (NVGROUP_CROSS_ALLGATHER_MAX_BYTES=0),
             chunks of a quarter of the message between MIN_CHUNK and CHUNK
  allgather  allgather + fold for every slice, same chunks
  mixed      the variant by size: in one message the full chunks take one
             variant and a smaller last chunk the other
  whole      chunks of CHUNK (NVGROUP_PIPELINE_MIN_CHUNK = CHUNK), rsag
Groups of one rank (P = ranks: 2, 3 or 4 peers), and with --group-size 2 on 4
ranks two groups of two (P = 2; a chunk of 1 element leaves one group rank an
empty slice). Counts 0..100003, most not divisible by the peers.

Every rank checks its own result: bitwise against the fold in the documented
order computed here (group members by group_rank, then groups by group_index,
with cc/cpu/host_reduce.h's accumulation and rounding), and against the
float64 (integers: exact) reference of all ranks' inputs. Every rank also
checks the bytes it posted in cross exchanges, per call, against the chunk
geometry and the variant rule recomputed here (so a variant not taken fails).
With --serialized MPI has no MPI_THREAD_MULTIPLE: no progress thread.
"""
import os
import sys

import numpy as np

if "--serialized" in sys.argv:
    import mpi4py
    mpi4py.rc.thread_level = "serialized"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comm_common as cc  # noqa: E402

CHUNK = 8 << 10
MIN_CHUNK = 1 << 10
MIXED_ALLGATHER_MAX = 2000
REGISTERED = 1 << 20
COUNTS = [0, 1, 2, 3, 5, 7, 17, 129, 1000, 4099, 100003]
ESIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8}
CASES = [("float32", op) for op in cc.OPS] + [("float64", "sum"), ("float16", "sum"), ("float16", "average"),
                                              ("bfloat16", "sum"), ("int32", "sum"), ("int32", "average"),
                                              ("int64", "product")]
CONFIGS = {  # name: (NVGROUP_CROSS_ALLGATHER_MAX_BYTES, NVGROUP_PIPELINE_MIN_CHUNK)
    "rsag": (0, MIN_CHUNK),
    "allgather": (1 << 30, MIN_CHUNK),
    "mixed": (MIXED_ALLGATHER_MAX, MIN_CHUNK),
    "whole": (0, CHUNK),
}


def group_size_arg():
    return int(sys.argv[sys.argv.index("--group-size") + 1]) if "--group-size" in sys.argv else 1


def create(allgather_max, min_chunk, group_size):
    os.environ["NVGROUP_ALLREDUCE_ALGORITHM"] = "hierarchical"  # read at creation
    os.environ["NVGROUP_CROSS_ALLGATHER_MAX_BYTES"] = str(allgather_max)
    os.environ["NVGROUP_PIPELINE_MIN_CHUNK"] = str(min_chunk)
    return cc.make_communicator(group_size=group_size, registered_bytes=REGISTERED, pipeline_chunk=CHUNK)


def chunk_elements(count, esize, g, min_chunk):
    """PipelineChunking::ChunkElements."""
    unit = max(1, 16 // esize) * g
    most = max(unit, (CHUNK // esize) // unit * unit)
    least = min(most, -(-(min(min_chunk, CHUNK) // esize) // unit) * unit)
    quarter = -(-(-(-count // 4)) // unit) * unit
    return max(unit, min(most, max(least, quarter)))


def split(count, parts, esize):
    """ChunkSlices: `parts` contiguous 16-byte aligned pieces of `count` elements."""
    unit = max(1, 16 // esize)
    stride = -(-(-(-count // parts)) // unit) * unit
    return [(count if r + 1 == parts else min(count, (r + 1) * stride)) - min(count, r * stride)
            for r in range(parts)]


def expected_bytes(topo, count, esize, allgather_max, min_chunk):
    g, p = topo["group_size"], topo["group_count"]
    me, peer = topo["group_rank"], topo["group_index"]
    total = 0
    step = chunk_elements(count, esize, g, min_chunk) if count else 1
    for c0 in range(0, count, step):
        s = split(min(step, count - c0), g, esize)[me]
        if s == 0:
            continue
        if allgather_max > 0 and (p - 1) * s * esize <= allgather_max:
            total += (p - 1) * s * esize
        else:
            parts = split(s, p, esize)
            total += (sum(parts[q] for q in range(p) if q != peer) + (p - 1) * parts[peer]) * esize
    return total


def level_fold(values, dtype, op, divisor):
    """One level of the fold (host_reduce.h): left to right in list order."""
    wide = dtype in ("float16", "bfloat16")
    acc_type = np.float32 if wide else cc.STORAGE[dtype]
    if wide:
        vals = [cc.to_float64(v, dtype).astype(np.float32) for v in values]
    else:
        vals = [v.astype(acc_type) for v in values]
    acc = vals[0].copy()
    with np.errstate(over="ignore"):
        for v in vals[1:]:
            if op in ("sum", "average"):
                acc = acc + v
            elif op == "product":
                acc = acc * v
            elif op == "min":
                acc = np.where(v < acc, v, acc)
            else:
                acc = np.where(acc < v, v, acc)
    if divisor > 1:
        if dtype.startswith("int"):
            a = acc.astype(np.int64)
            acc = (np.sign(a) * (np.abs(a) // divisor)).astype(acc_type)
        else:
            acc = (acc / acc_type(divisor)).astype(acc_type)
    return cc.from_float32(acc, dtype) if wide else acc.astype(cc.STORAGE[dtype])


def expected_fold(inputs, places, dtype, op):
    """inputs[r] of rank r, places[r] = (group_index, group_rank): the documented order."""
    groups = sorted({gi for gi, _ in places})
    divisor = len(inputs) if op == "average" else 1
    group_results = []
    for gi in groups:
        members = sorted((gr, r) for r, (i, gr) in enumerate(places) if i == gi)
        group_results.append(level_fold([inputs[r] for _, r in members], dtype, op, 1))
    return level_fold(group_results, dtype, op, divisor)


def main():
    group_size = group_size_arg()
    check = cc.Checker()
    comms = {name: create(agm, mc, group_size) for name, (agm, mc) in CONFIGS.items()}
    topo = comms["rsag"].topology()
    check.expect(topo["group_size"] == group_size and topo["group_count"] == cc.SIZE // group_size,
                 "unexpected topology %s" % topo)
    places = cc.COMM.allgather((topo["group_index"], topo["group_rank"]))
    case = 0
    for dtype, op in CASES:
        for count in COUNTS:
            case += 1
            rng = np.random.default_rng([29, case, cc.RANK])
            x = cc.random_input(rng, dtype, op, count)
            inputs = cc.COMM.allgather(x)
            want = expected_fold(inputs, places, dtype, op)
            xs = cc.widen(inputs, dtype)
            ref = cc.reference(xs, dtype, op)
            tol = None if dtype.startswith("int") else cc.tolerance(xs, dtype, op)
            for name, comm in comms.items():
                label = "%s %s count=%d %s (P=%d)" % (dtype, op, count, name, topo["group_count"])
                out = np.empty_like(x)
                out.view(np.uint8).fill(0xFF)  # NaN (floats), -1 (integers)
                before = cc.engine.cross_bytes_sent()
                comm.allreduce(x.ctypes.data, out.ctypes.data, count, dtype, op)
                sent = cc.engine.cross_bytes_sent() - before
                agm, mc = CONFIGS[name]
                posted = expected_bytes(topo, count, ESIZE[dtype], agm, mc)
                check.expect(sent == posted, "%s: posted %d cross bytes, want %d" % (label, sent, posted))
                bits = "u%d" % ESIZE[dtype]
                bad = np.nonzero(out.view(bits) != want.view(bits))[0]
                check.expect(bad.size == 0, "%s: %d of %d elements differ from the ordered fold, first at %s" % (
                    label, bad.size, count, bad[:1].tolist()))
                got = cc.result_as_float64(out, dtype)
                off = np.nonzero(got != ref if tol is None else ~(np.abs(got - ref) <= tol))[0]
                check.expect(off.size == 0, "%s: %d of %d elements off the reference, first at %s: %r vs %r" % (
                    label, off.size, count, off[:1].tolist(), got[off[:1]].tolist(), ref[off[:1]].tolist()))
    if cc.RANK == 0:
        levels = {cc.MPI.THREAD_MULTIPLE: "multiple", cc.MPI.THREAD_SERIALIZED: "serialized"}
        print("cross variants checked on %d ranks, %d groups of %d; MPI thread level: %s" % (
            cc.SIZE, topo["group_count"], group_size, levels.get(cc.MPI.Query_thread(), "other")), flush=True)
    check.finish()


if __name__ == "__main__":
    cc.run_main(main)
