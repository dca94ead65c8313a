"""Soak worker: many collectives of random sizes, dtypes and ops, submitted in a
different random order on every rank, each result checked against a float64
(exact int64) reference, results compared bitwise across ranks, and the
resident set size compared after warm-up and at the end.

    soak.py ROUNDS PER_ROUND RSS_SLACK_MIB

Every rank draws the same specs from a seed shared by all ranks and its own
input from a seed naming (round, collective, rank), so each rank can rebuild
every other rank's input for the reference. Half of the names are stable for
the whole run (response-cache path), half are new every round (negotiation
path, cache evictions).
"""
import hashlib
import sys
import time
import traceback

import numpy as np
from mpi4py import MPI

import nvgroup_tf._engine as engine
from rel_common import DTYPES, FLOATS, OPS, check_allreduce, random_input, rss_bytes, say

COMM = MPI.COMM_WORLD


def draw_spec(rng, size):
    """(kind, dtype, op, count, root, prescale, postscale); mostly small."""
    kind = rng.choice(["allreduce"] * 8 + ["allgather", "broadcast"])
    dtype = str(rng.choice(DTYPES))
    op = str(rng.choice(OPS))
    u = rng.random()
    count = int(rng.integers(0, 65)) if u < 0.7 else int(rng.integers(65, 4097)) if u < 0.97 else \
        int(rng.integers(4097, 65537))
    root = int(rng.integers(0, size))
    prescale = postscale = 1.0
    if dtype in FLOATS and op in ("sum", "average") and rng.random() < 0.3:
        prescale, postscale = float(rng.choice([0.5, 2.0, 0.25])), float(rng.choice([0.5, 3.0]))
    return str(kind), dtype, op, count, root, prescale, postscale


def rank_input(round_, k, r, kind, dtype, op, count):
    rng = np.random.default_rng([round_, k, r, 7])
    if kind == "allgather":
        rows, cols = int(rng.integers(0, 4)), max(count // 16, 1)
        return random_input(rng, dtype, "sum", rows * cols).reshape(rows, cols)
    return random_input(rng, dtype, op, count)


def main():
    rounds, per_round, slack_mib = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    engine.init()
    rank, size = engine.rank(), engine.size()
    stable_rng = np.random.default_rng(12345)
    stable = [draw_spec(stable_rng, size) for _ in range(per_round // 2)]
    digest = hashlib.sha256()
    checked = 0
    warm_rss = None
    start = time.time()
    for round_ in range(rounds):
        spec_rng = np.random.default_rng([round_, 99])
        specs = []
        for k in range(per_round):
            if k < len(stable):
                specs.append(("s%d" % k,) + stable[k])
            else:
                specs.append(("r%d/v%d" % (round_, k),) + draw_spec(spec_rng, size))
        order = np.random.default_rng([round_, rank, 5]).permutation(per_round)
        handles, outputs = {}, {}
        for k in order:
            name, kind, dtype, op, count, root, pre, post = specs[k]
            x = rank_input(round_, k, rank, kind, dtype, op, count)
            if kind == "allreduce":
                y = np.empty_like(x)
                h = engine.allreduce_async(name, x.ctypes.data, y.ctypes.data, list(x.shape), dtype, op,
                                           pre, post, keepalive=(x, y))
            elif kind == "broadcast":
                y = np.empty_like(x)
                h = engine.broadcast_async(name, x.ctypes.data, y.ctypes.data, list(x.shape), dtype, root,
                                           keepalive=(x, y))
            else:
                y = None
                h = engine.allgather_async(name, x.ctypes.data, list(x.shape), dtype, keepalive=x)
            handles[k] = (h, y)
        for k in np.random.default_rng([round_, rank, 6]).permutation(per_round):
            name, kind, dtype, op, count, root, pre, post = specs[k]
            h, y = handles[k]
            out = engine.wait(h)
            if kind == "allgather":
                y = out
            inputs = [rank_input(round_, k, r, kind, dtype, op, count) for r in range(size)]
            if kind == "allreduce":
                why = check_allreduce(y, inputs, dtype, op, pre, post)
            elif kind == "broadcast":
                why = "" if np.array_equal(y.view(np.uint8), inputs[root].view(np.uint8)) else "differs from root"
            else:
                want = np.concatenate(inputs, axis=0)
                why = "" if y.shape == want.shape and np.array_equal(y.view(np.uint8), want.view(np.uint8)) \
                    else "got shape %s, want %s" % (y.shape, want.shape)
            if why:
                raise AssertionError("round %d %s %s %s %s count=%d: %s" % (round_, name, kind, dtype, op,
                                                                            count, why))
            outputs[k] = np.ascontiguousarray(y).tobytes()
            checked += 1
        for k in range(per_round):  # in spec order: ranks waited in different orders
            digest.update(outputs[k])
        if round_ == rounds // 4:
            warm_rss = rss_bytes()
    end_rss = rss_bytes()
    digests = COMM.allgather(digest.hexdigest())
    if len(set(digests)) != 1:
        raise AssertionError("results differ across ranks: %s" % digests)
    growth_mib = (end_rss - warm_rss) / 2.0 ** 20
    say("rank %d: SOAK checked=%d seconds=%.1f rss_warm_mib=%.1f rss_end_mib=%.1f growth_mib=%.2f"
        % (rank, checked, time.time() - start, warm_rss / 2.0 ** 20, end_rss / 2.0 ** 20, growth_mib))
    if growth_mib > slack_mib:
        raise AssertionError("RSS grew by %.2f MiB after warm-up (allowed %.1f)" % (growth_mib, slack_mib))
    engine.shutdown()


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001 -- report which rank failed, then fail the job
        say("rank %d: FAILED\n%s" % (COMM.rank, traceback.format_exc()))
        sys.stdout.flush()
        COMM.Abort(1)
