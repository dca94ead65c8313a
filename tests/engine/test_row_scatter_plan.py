"""The hierarchical reduce-scatter's plan (cc/algorithms/hierarchical_reduce_scatter.h),
pure geometry through nvgroup_tf._engine._row_scatter_plan, for placements one
machine cannot produce under mpirun: groups whose ranks are not consecutive
(jsrun's cyclic distribution, Slurm's round-robin over nodes), random uneven
counts with zeros, small pieces and buffers. Every rank's plan must agree with
its peers' (same chunks, same parts: they post the same exchanges), the parts
(j, l) over all chunks must tile rank (j, l)'s rows exactly, in order, and each
chunk must fit the send/receive buffers."""
import importlib.util
import itertools

import numpy as np
import pytest

if importlib.util.find_spec("nvgroup_tf._engine") is None:
    pytest.skip("nvgroup_tf._engine is not built", allow_module_level=True)
import nvgroup_tf._engine as engine  # noqa: E402


def placements(G, P):
    """rank_of tables: consecutive groups, cyclic over groups, and a random permutation."""
    n = G * P
    yield "consecutive", [j * G + l for j in range(P) for l in range(G)]
    yield "cyclic", [l * P + j for j in range(P) for l in range(G)]
    perm = np.random.default_rng([G, P]).permutation(n)
    yield "random", [int(v) for v in perm]


@pytest.mark.parametrize("G,P", [(2, 2), (2, 3), (1, 3), (3, 2), (4, 5), (2, 17)])
def test_plans_agree_and_tile_every_rank_rows(G, P):
    n = G * P
    rng = np.random.default_rng([G, P, 1])
    for (name, rank_of), trial in itertools.product(placements(G, P), range(4)):
        counts = [int(c) for c in rng.integers(0, 300, n)]
        counts[int(rng.integers(n))] = 0
        if trial == 3:
            counts = [0] * n
            counts[rank_of[-1]] = 1000  # all rows on one rank
        total = sum(counts)
        begin = np.concatenate([[0], np.cumsum(counts)])
        piece = int(rng.integers(17, 400))
        send_cap, recv_cap = P + 1 + int(rng.integers(0, 40)), P * (1 + int(rng.integers(0, 20)))
        label = "%s G=%d P=%d counts=%s piece=%d caps=%d/%d" % (name, G, P, counts, piece, send_cap, recv_cap)
        plans = {(j, l): engine._row_scatter_plan(counts, rank_of, G, P, l, j, piece, send_cap, recv_cap)
                 for j in range(P) for l in range(G)}
        first = plans[(0, 0)]
        covered = np.zeros(total, np.int64)
        for (j, l), plan in plans.items():
            assert [c[:4] for c in plan] == [c[:4] for c in first], label + ": chunk sequences differ"
            assert plan == plans[(0, l)], label + ": peers of group rank %d disagree on the parts" % l
            r = rank_of[j * G + l]
            at = begin[r]
            for piece_begin, piece_count, k, K, parts in plan:
                assert len(parts) == P
                assert sum(c for _, c in parts) <= send_cap, label + ": chunk exceeds the send buffer"
                assert all(P * c <= recv_cap for _, c in parts), label + ": part exceeds the receive buffer"
                b, c = parts[j]
                if c:
                    assert b == at and piece_begin <= b and b + c <= piece_begin + piece_count, label
                    covered[b:b + c] += 1
                    at = b + c
            assert at == begin[r] + counts[r], label + ": rank %d's rows are not all covered" % r
        assert np.all(covered == 1), label + ": some element is not covered exactly once"
        pieces = -(-total // piece) if total else 0
        assert len({c[0] for c in first}) == pieces, label


def test_too_small_buffers_are_a_clear_error():
    with pytest.raises(RuntimeError, match="NVGROUP_PIPELINE_CHUNK"):
        engine._row_scatter_plan([5, 5, 5, 5], [0, 1, 2, 3], 1, 4, 0, 0, 100, 4, 100)
