"""The hierarchical reduce-scatter over several NV-groups (CPU;
cc/algorithms/hierarchical_reduce_scatter.h), run with NVGROUP_GROUP_SIZE so
one machine has several groups (4 ranks as 2 x 2, 3 ranks as 3 groups of 1).

Communicator level: every dtype (incl. 8/16-bit integers) and op, Horovod-like
uneven row counts (zero rows for some ranks, all rows on one rank), a 4 KiB
registered buffer with a 1 KiB pipeline chunk (many pieces, many chunks per
piece) and the defaults; random data. Each rank's rows are checked against the
float64 / exact-integer reference of all ranks' inputs (every element),
bitwise against the same rows of the hierarchical Allreduce of the same input,
and the ranks' rows together must make up that allreduce exactly.

Traffic: the bytes this process posts in cross-group exchanges
(engine.cross_bytes_sent) during one reduce-scatter must be exactly the
reduce-scatter's: for group rank l of group g, the rows of the ranks (j, l),
j != g, once. The old path (the full allreduce, then this rank's rows) posts
the allreduce's reduce-scatter + allgather bytes instead, and with groups of
one rank it went through the flat MPI path (no cross exchange at all).

Engine level: reducescatter and grouped_reducescatter (Sum/Average with
pre/postscale) against the float64 reference and bitwise against the engine's
allreduce rows, with the same traffic check.

Arguments: --groups P --group-size G (what the topology must be).
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comm_common as cc  # noqa: E402
from numeric_data import DTYPES, OPS, STORAGE, random_input, to_float64  # noqa: E402

SMALL_INTS = ["uint8", "int8", "uint16", "int16"]
NP_OF = dict(STORAGE, uint8=np.uint8, int8=np.int8, uint16=np.uint16, int16=np.int16)
E = cc.engine


def owners(comm):
    """rank_of[(group_index, group_rank)] over all ranks, from each rank's own topology."""
    t = comm.topology()
    places = cc.COMM.allgather((t["group_index"], t["group_rank"]))
    return {p: r for r, p in enumerate(places)}, t


def expected_cross_bytes(counts, esize, rank_of, topo):
    """Bytes the hierarchical reduce-scatter posts: our group partials of the
    rows of the same group rank in every other group, once."""
    l, g = topo["group_rank"], topo["group_index"]
    return sum(counts[rank_of[(j, l)]] for j in range(topo["group_count"]) if j != g) * esize


def inputs_for(seed, dtype, op, total):
    """Every rank's input (all ranks draw all inputs: the reference needs them)."""
    xs = []
    for r in range(cc.SIZE):
        rng = np.random.default_rng([seed, r])
        if dtype in SMALL_INTS:  # small values: no wrap-around, so the reference is exact
            lo = -3 if dtype.startswith("int") else 0
            x = rng.integers(lo, 4, total).astype(NP_OF[dtype])
            if total:
                x[0] = 3  # never all zero
        else:
            x = random_input(rng, dtype, op, total)
        xs.append(x)
    return xs


def reference_rows(xs, dtype, op, a, b):
    parts = [x[a:b] for x in xs]
    if dtype in SMALL_INTS or dtype in ("int32", "int64"):
        return cc.reference([p.astype(np.int64) for p in parts], "int64", op), None
    w = [to_float64(p, dtype) for p in parts]
    return cc.reference(w, dtype, op), cc.tolerance(w, dtype, op)


def check_rows(check, label, got, dtype, xs, op, a, b):
    want, tol = reference_rows(xs, dtype, op, a, b)
    if tol is None:
        bad = np.nonzero(got.astype(np.int64) != want)[0]
    else:
        bad = np.nonzero(~(np.abs(to_float64(got, dtype) - want) <= tol))[0]
    check.expect(bad.size == 0, "%s: %d of %d rows' elements off the reference, first at %s" % (
        label, bad.size, got.size, bad[:1].tolist()))


def communicator_cases(check, comm, tag, rank_of, topo):
    n, me = cc.SIZE, cc.RANK
    count_sets = [
        [(7 * r + 3) % 5 for r in range(n)],            # uneven, small
        [0] * (n - 1) + [3001],                          # all rows on the last rank
        [3001] + [0] * (n - 1),                          # all rows on the first rank
        [1000 + 37 * r if r % 2 else 0 for r in range(n)],  # zero rows for every other rank
        [4099 + r for r in range(n)],                    # several pieces of the 4 KiB buffer
    ]
    for d, dtype in enumerate(DTYPES + SMALL_INTS):
        for o, op in enumerate(OPS):
            for s, counts in enumerate(count_sets):
                total = sum(counts)
                xs = inputs_for([d, o, s, len(tag)], dtype, op, total)
                x = xs[me]
                esize = x.dtype.itemsize
                out = np.zeros(max(1, counts[me]), x.dtype)
                before = E.cross_bytes_sent()
                comm.reduce_scatter(x.ctypes.data, out.ctypes.data, counts, dtype, op)
                sent = E.cross_bytes_sent() - before
                full = np.zeros(max(1, total), x.dtype)
                comm.allreduce(x.ctypes.data, full.ctypes.data, total, dtype, op)
                a = sum(counts[:me])
                got = out[:counts[me]]
                label = "%s reduce_scatter %s %s counts=%s" % (tag, dtype, op, counts)
                check.expect(got.tobytes() == full[a:a + counts[me]].tobytes(),
                             label + ": differs from the allreduce's rows")
                want_bytes = expected_cross_bytes(counts, esize, rank_of, topo)
                check.expect(sent == want_bytes, "%s: posted %d cross-group bytes, the reduce-scatter's are %d"
                             % (label, sent, want_bytes))
                check_rows(check, label, got, dtype, xs, op, a, a + counts[me])
                every = cc.COMM.allgather(got.tobytes())
                check.expect(b"".join(every) == full[:total].tobytes(),
                             label + ": the ranks' rows do not make up the allreduce")


def engine_cases(check, rank_of, topo):
    """Engine reducescatter / grouped_reducescatter: Horovod's dim-0 split."""
    n, me = cc.SIZE, cc.RANK
    E.init(cc.COMM.py2f())

    def rows(dim0, r):
        return dim0 // n + (1 if r < dim0 % n else 0)

    def check_member(label, got, shape, dtype, op, pre, post, xs, full):
        row = int(np.prod(shape[1:]))
        a = sum(rows(shape[0], r) for r in range(me)) * row
        b = a + rows(shape[0], me) * row
        got = np.frombuffer(np.ascontiguousarray(got).tobytes(), NP_OF[dtype])  # bfloat16: its uint16 bits
        check.expect(got.tobytes() == full[a:b].tobytes(), label + ": differs from the engine allreduce's rows")
        # roundings: prescale, group fold, fold over groups, postscale (each <= eps relative)
        w = [to_float64(x[a:b], dtype) * pre for x in xs]
        want = sum(w[1:], w[0].copy()) * post / (n if op == "average" else 1)
        tol = sum(np.abs(v) for v in w) * abs(post) / (n if op == "average" else 1) * (
            4 * cc.EPS[dtype] + (n + 3) * (2.0 ** -24 if dtype in ("float16", "bfloat16") else cc.EPS[dtype]))
        bad = np.nonzero(~(np.abs(to_float64(got, dtype) - want) <= tol))[0]
        check.expect(bad.size == 0, "%s: %d of %d elements off the float64 reference, first at %s: got %r want %r" % (
            label, bad.size, got.size, bad[:1].tolist(), to_float64(got[bad[:1]], dtype).tolist(),
            want[bad[:1]].tolist()))

    k = 0
    for dtype in ("float32", "float64", "float16", "bfloat16"):
        for op, pre, post in (("sum", 1.0, 1.0), ("average", 1.0, 1.0), ("sum", 0.5, 3.0), ("average", 3.0, 0.25)):
            k += 1
            shapes = [[2 * n + 1, 3], [1, 5], [n - 1, 2, 2], [257 * n + 3, 4]]
            xs_all = [inputs_for([77, k, i], dtype, "sum", int(np.prod(s))) for i, s in enumerate(shapes)]
            esize = np.dtype(NP_OF[dtype]).itemsize
            want_bytes = sum(expected_cross_bytes([rows(s[0], r) * int(np.prod(s[1:])) for r in range(n)], esize,
                                                  rank_of, topo) for s in shapes)
            # one reducescatter per shape, then all of them as one grouped call
            before = E.cross_bytes_sent()
            singles = [E.wait(E.reducescatter_async("hrs/%d/%d" % (k, i), xs[me].ctypes.data, s, dtype, op, pre,
                                                    post), 60) for i, (s, xs) in enumerate(zip(shapes, xs_all))]
            sent_single = E.cross_bytes_sent() - before
            before = E.cross_bytes_sent()
            hs = E.grouped_reducescatter_async([("hrsg/%d/%d" % (k, i), xs[me].ctypes.data, s, dtype)
                                                for i, (s, xs) in enumerate(zip(shapes, xs_all))], op, pre, post)
            grouped = [E.wait(h, 60) for h in hs]
            sent_grouped = E.cross_bytes_sent() - before
            tag = "engine %s %s pre=%g post=%g" % (dtype, op, pre, post)
            check.expect(sent_single == want_bytes, "%s: reducescatters posted %d cross-group bytes, want %d" % (
                tag, sent_single, want_bytes))
            check.expect(sent_grouped == want_bytes, "%s: grouped reducescatter posted %d cross-group bytes, "
                         "want %d" % (tag, sent_grouped, want_bytes))
            for i, (s, xs) in enumerate(zip(shapes, xs_all)):
                full = np.zeros(int(np.prod(s)), NP_OF[dtype])
                E.wait(E.allreduce_async("hrsa/%d/%d" % (k, i), xs[me].ctypes.data, full.ctypes.data, s, dtype,
                                         op, pre, post), 60)
                check_member("%s reducescatter %s" % (tag, s), singles[i], s, dtype, op, pre, post, xs, full)
                check_member("%s grouped member %s" % (tag, s), grouped[i], s, dtype, op, pre, post, xs, full)
    E.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, required=True)
    ap.add_argument("--group-size", type=int, required=True)
    args = ap.parse_args()
    check = cc.Checker()
    small = cc.make_communicator(registered_bytes=4096, pipeline_chunk=1024)
    default = cc.make_communicator()
    rank_of, topo = owners(default)
    if (topo["group_count"], topo["group_size"]) != (args.groups, args.group_size):
        raise SystemExit("[rank %d] topology %s, expected %d groups of %d" % (
            cc.RANK, topo, args.groups, args.group_size))
    for comm, tag in ((small, "4KiB/1KiB"), (default, "default")):
        communicator_cases(check, comm, tag, rank_of, topo)
    engine_cases(check, rank_of, topo)
    check.finish()


cc.run_main(main)
