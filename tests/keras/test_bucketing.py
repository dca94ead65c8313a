"""assign_buckets: the pure bucketing function (no MPI, no TensorFlow)."""
import importlib.util
import os
import random

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("nvg_bucketing", os.path.join(REPO, "nvgroup_tf", "bucketing.py"))
bucketing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bucketing)
assign_buckets, bucket_name = bucketing.assign_buckets, bucketing.bucket_name

MiB = 1 << 20


def test_ddp_style_first_bucket_then_cap():
    sizes = [MiB // 2, MiB // 2, MiB // 2, 10 * MiB, 10 * MiB, 10 * MiB, 1 * MiB]
    assert assign_buckets(sizes, ["float32"] * 7, 25 * MiB, MiB) == [[0, 1], [2, 3, 4], [5, 6]]


def test_oversized_gradient_travels_alone_and_order_kept():
    sizes = [100, 5000, 100, 100]
    assert assign_buckets(sizes, ["f"] * 4, 1000, 1000) == [[0], [1], [2, 3]]


def test_dtypes_never_mix_and_buckets_sorted_by_readiness():
    sizes = [400, 400, 400, 400, 400]
    dtypes = ["float32", "float16", "float32", "float16", "float32"]
    assert assign_buckets(sizes, dtypes, 800, 800) == [[0, 2], [1, 3], [4]]


def test_cap_zero_disables_fusion_and_empty_input():
    assert assign_buckets([4, 4, 4], ["f"] * 3, 0, 0) == [[0], [1], [2]]
    assert assign_buckets([], [], 25 * MiB, MiB) == []


def test_first_cap_larger_than_cap_is_clipped():
    assert assign_buckets([6, 6, 6], ["f"] * 3, 12, 100) == [[0, 1], [2]]


@pytest.mark.parametrize("seed", range(25))
def test_random_inputs_invariants(seed):
    rng = random.Random(seed)
    n = rng.randint(0, 60)
    sizes = [rng.choice([0, 4, 64, 4096, rng.randint(1, 3 * MiB)]) for _ in range(n)]
    dtypes = [rng.choice(["float32", "float16", "bfloat16"]) for _ in range(n)]
    cap, first = rng.choice([MiB, 2 * MiB, 25 * MiB]), rng.choice([MiB // 4, MiB])
    buckets = assign_buckets(sizes, dtypes, cap, first)
    assert sorted(i for b in buckets for i in b) == list(range(n))           # a partition
    assert [b[0] for b in buckets] == sorted(b[0] for b in buckets)          # readiness order
    first_seen = set()
    for b in buckets:
        assert b == sorted(b) and len({dtypes[i] for i in b}) == 1           # one dtype, order kept
        total = sum(sizes[i] for i in b)
        this_cap = cap if dtypes[b[0]] in first_seen else first
        first_seen.add(dtypes[b[0]])
        assert total <= this_cap or len(b) == 1, (b, total, this_cap)
    assert buckets == assign_buckets(list(sizes), list(dtypes), cap, first)  # deterministic


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="2 sizes but 1 dtypes"):
        assign_buckets([1, 2], ["f"], 10, 10)
    with pytest.raises(ValueError, match=r"sizes_bytes\[1\] = -3"):
        assign_buckets([1, -3], ["f", "f"], 10, 10)


def test_bucket_names_deterministic_and_distinct():
    a = bucket_name(0, ["dense/kernel", "dense/bias"])
    assert a == bucket_name(0, ["dense/kernel", "dense/bias"])
    assert a.startswith("nvg_grad_bucket_0_")
    assert a != bucket_name(1, ["dense/kernel", "dense/bias"])
    assert a != bucket_name(0, ["dense/bias", "dense/kernel"])
