"""Multi-rank tests of the TF ops and the Python API (nvgroup_tf).

Each test launches one worker under mpirun (tests/mpi_util.run_mpi); the worker
batches many checks per launch, because importing TensorFlow costs seconds per
rank. See the workers' docstrings for what each checks.
"""
import os

import numpy as np
import pytest

from mpi_util import run_mpi

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")


def worker(name):
    return os.path.join(WORKERS, name)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_collectives(ranks):
    result = run_mpi(worker("collectives.py"), ranks, timeout=420)
    assert "0 failures" in result.output


@pytest.mark.parametrize("ranks", [2, 3])
def test_mismatches_raise_on_every_rank(ranks):
    result = run_mpi(worker("errors.py"), ranks, timeout=300)
    assert result.output.count(" 0 failures") == ranks


def test_lifecycle():
    result = run_mpi(worker("lifecycle.py"), 2, timeout=300)
    assert result.output.count(" 0 failures") == 2


def _results(out_dir, tag, ranks):
    return [dict(np.load(os.path.join(out_dir, "%s_rank%d.npz" % (tag, r))))
            for r in range(ranks)]


def _assert_bitwise_equal(a, b, what):
    assert sorted(a) == sorted(b), what
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, (what, key)
        assert a[key].tobytes() == b[key].tobytes(), "%s: %s differs" % (what, key)


def test_fused_equals_unfused_and_ranks_agree(tmp_path):
    ranks = 2
    run_mpi(worker("determinism.py"), ranks, args=[tmp_path, "fused", "random"], timeout=300)
    run_mpi(worker("determinism.py"), ranks, args=[tmp_path, "unfused", "random"],
            env={"NVGROUP_FUSION_THRESHOLD": "0"}, timeout=300)
    fused, unfused = _results(tmp_path, "fused", ranks), _results(tmp_path, "unfused", ranks)
    for r in range(ranks):
        _assert_bitwise_equal(fused[r], unfused[r], "rank %d fused vs unfused" % r)
        _assert_bitwise_equal(fused[0], fused[r], "rank 0 vs rank %d" % r)


def test_hierarchical_equals_flat_on_dyadic_data(tmp_path):
    ranks = 4
    run_mpi(worker("determinism.py"), ranks, args=[tmp_path, "hier", "dyadic"],
            env={"NVGROUP_GROUP_SIZE": "2", "NVGROUP_ALLREDUCE_ALGORITHM": "hierarchical"},
            timeout=300)
    run_mpi(worker("determinism.py"), ranks, args=[tmp_path, "flat", "dyadic"],
            env={"NVGROUP_ALLREDUCE_ALGORITHM": "mpi"}, timeout=300)
    hier, flat = _results(tmp_path, "hier", ranks), _results(tmp_path, "flat", ranks)
    for r in range(ranks):
        _assert_bitwise_equal(hier[r], flat[r], "rank %d hierarchical vs flat" % r)
        _assert_bitwise_equal(hier[0], hier[r], "rank 0 vs rank %d" % r)


@pytest.mark.parametrize("ranks", [2, 3])
def test_one_name_for_two_collectives_in_a_function_fails_on_every_rank(ranks):
    """An allreduce and an allgather of one name in one tf.function, 20 calls:
    each ends on every rank alike (an error naming it, or right values), within
    seconds; a checked allreduce after each (workers/duplicate_names.py)."""
    result = run_mpi(worker("duplicate_names.py"), ranks, timeout=300)
    assert result.output.count(" 0 failures") == ranks


@pytest.mark.parametrize("ranks", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_grouped_kernels_launch_registered_groups(ranks, tmp_path):
    """A grouped allreduce kernel registers its group once and launches it at
    every step; a second trace, ranks taking different ways, eager shape
    changes and shutdown/init stay right on every rank (workers/
    registered_groups.py). At 2 ranks also run with
    NVGROUP_TF_REGISTERED_GROUPS=0: every result bitwise the same."""
    result = run_mpi(worker("registered_groups.py"), ranks, args=[tmp_path, "registered"], timeout=300)
    assert result.output.count(" 0 failures") == ranks
    if ranks != 2:
        return
    result = run_mpi(worker("registered_groups.py"), ranks, args=[tmp_path, "by_name"],
                     env={"NVGROUP_TF_REGISTERED_GROUPS": "0"}, timeout=300)
    assert result.output.count(" 0 failures") == ranks
    registered, by_name = _results(tmp_path, "registered", ranks), _results(tmp_path, "by_name", ranks)
    for r in range(ranks):
        _assert_bitwise_equal(registered[r], by_name[r], "rank %d registered vs by name" % r)
        _assert_bitwise_equal(registered[0], registered[r], "rank 0 vs rank %d" % r)
