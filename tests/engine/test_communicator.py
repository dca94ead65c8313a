"""Multi-rank tests of the CPU Communicator (cc/cpu, cc/transport, cc/topology)
through the pybind11 bindings. Each test launches a worker under mpirun
(tests/mpi_util.run_mpi); the workers check every element against a float64
reference and compare all ranks' bytes (see workers/comm_common.py).

Needs the engine module: NVGROUP_WITHOUT_TF=1 python setup.py build_ext --inplace
"""
import importlib.util
import os

import pytest

from mpi_util import REPO, run_mpi

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
LARGE = (1 << 20) + 3
# Ranks outnumber the 2 cores of the CI box: let Open MPI yield while it polls.
ENV = {"OMPI_MCA_mpi_yield_when_idle": "1"}

if importlib.util.find_spec("nvgroup_tf._engine") is None:
    raise RuntimeError("nvgroup_tf._engine is not built: run "
                       "'NVGROUP_WITHOUT_TF=1 python setup.py build_ext --inplace' in " + REPO)


def worker(name):
    return os.path.join(WORKERS, name)


def run(script, np, args=(), env=None, timeout=240):
    full_env = dict(ENV)
    full_env.update(env or {})
    return run_mpi(worker(script), np, args=args, env=full_env, timeout=timeout)


# --- allreduce: every op x dtype, counts 0, 1, 7, 1000, 2^20+3 -------------------

@pytest.mark.parametrize("np_", [2, 3, 4])
def test_allreduce_one_group(np_):
    """Default topology: one group of all ranks (shared-memory group allreduce)."""
    # The largest count for every dtype at 3 ranks, for a subset elsewhere (time).
    largest = "float16,bfloat16,float32,float64,int32,int64" if np_ == 3 else "float16"
    run("comm_allreduce.py", np_, ["--largest-dtypes", largest])


def test_allreduce_two_groups_of_two():
    """NVGROUP_GROUP_SIZE=2 on 4 ranks: the pipelined hierarchical skeleton, with
    256 KiB chunks so the largest messages cross in many pipelined chunks."""
    run("comm_allreduce.py", 4, ["--expect-groups", 2, "--largest-dtypes", "float16,bfloat16,float32,int64"],
        env={"NVGROUP_GROUP_SIZE": 2, "NVGROUP_PIPELINE_CHUNK": 1 << 18})


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_allreduce_flat_mpi(np_):
    run("comm_allreduce.py", np_, ["--largest-dtypes", "float64"],
        env={"NVGROUP_ALLREDUCE_ALGORITHM": "mpi"})


@pytest.mark.parametrize("np_", [2, 3])
def test_allreduce_flat_mpi_in_many_pieces(np_):
    """The flat path with 4 KiB pieces: many pieces, two in flight, in the
    allgather + fold variant (a limit of 16 KiB sent per rank) and,
    with the limit 0, all in reduce-scatter + allgather."""
    for limit in (16384, 0):
        run("comm_allreduce.py", np_, ["--counts", "0,1,7,1000,5003,70001", "--largest-dtypes", "float16,float32"],
            env={"NVGROUP_ALLREDUCE_ALGORITHM": "mpi", "NVGROUP_PIPELINE_CHUNK": 4096,
                 "NVGROUP_CROSS_ALLGATHER_MAX_BYTES": limit})


def test_allreduce_forced_hierarchy_one_group():
    run("comm_allreduce.py", 3, ["--largest-dtypes", "int32"],
        env={"NVGROUP_ALLREDUCE_ALGORITHM": "hierarchical", "NVGROUP_PIPELINE_CHUNK": 1 << 16})


def test_allreduce_group_size_one():
    """3 groups of 1 on 3 ranks (auto takes the flat path; forced runs the skeleton)."""
    run("comm_allreduce.py", 3, ["--expect-groups", 3, "--largest-dtypes", "float32"],
        env={"NVGROUP_GROUP_SIZE": 1})
    run("comm_allreduce.py", 3, ["--expect-groups", 3, "--counts", "0,1,7,1000"],
        env={"NVGROUP_GROUP_SIZE": 1, "NVGROUP_ALLREDUCE_ALGORITHM": "hierarchical"})


@pytest.mark.parametrize("np_,group_size", [(4, 2), (3, 0)])
def test_allreduce_larger_than_registered_buffer(np_, group_size):
    """64 KiB registered buffer: 2^20+3 elements go through in many pieces."""
    run("comm_allreduce.py", np_,
        ["--registered-bytes", 1 << 16, "--expect-groups", np_ // group_size if group_size else 1,
         "--counts", "7,1000,%d" % LARGE, "--largest-dtypes", "bfloat16,int64"],
        env={"NVGROUP_GROUP_SIZE": group_size})


# --- determinism across algorithms --------------------------------------------------

def test_hierarchical_equals_flat_on_dyadic_data():
    run("comm_algorithms.py", 4, ["dyadic"], env={"NVGROUP_GROUP_SIZE": 2})


@pytest.mark.parametrize("threads", ["multiple", "serialized"])
def test_cross_step_groups_of_one_and_two_match_flat_and_send_rs_ag_bytes(threads):
    """4 ranks as 4 groups of 1 and as 2 groups of 2: the cross-group step
    (reduce-scatter + allgather among peers, allgather + fold for small slices)
    gives the flat result bit for bit on dyadic data, float64-close on random
    data, and posts exactly the byte count of each chunk's variant
    (workers/comm_cross_step.py); with MPI_THREAD_MULTIPLE (progress thread)
    and without (progress in Start and Wait)."""
    res = run("comm_cross_step.py", 4, args=["--serialized"] if threads == "serialized" else [],
              timeout=400)
    assert "g1: " in res.output and "g2: " in res.output, res.output
    assert "MPI thread level: %s" % threads in res.output, res.output


@pytest.mark.parametrize("np_,args", [(2, []), (3, []), (4, []), (4, ["--group-size", "2"]), (3, ["--serialized"])])
def test_cross_step_variants_and_chunks_match_the_ordered_fold_bitwise(np_, args):
    """Reduce-scatter + allgather, allgather + fold, both in one message, and
    quarter-message chunks against whole chunks (workers/comm_cross_variants.py):
    every rank's result bitwise the fold in the documented order and within the
    float64 (exact) reference, counts 0..100003 not divisible by the peers, and
    the bytes of each chunk's variant posted (3 and 4 peers tell the variants
    apart by their bytes)."""
    res = run("comm_cross_variants.py", np_, args=args, timeout=300)
    assert "cross variants checked on %d ranks" % np_ in res.output, res.output


@pytest.mark.parametrize("np_,args", [(2, []), (3, []), (4, []), (3, ["--serialized"])])
def test_cross_exchange_posts_first_round_receives_before_its_slice_is_ready(np_, args):
    """workers/comm_cross_gated.py: with rank 0's slice held back until the
    peers' copies of its part arrived, they arrive (its receives are posted and
    progressed ahead of its sends) and every rank's sum is exact; when `ready`
    fails on every rank with those receives posted, each rank's Wait returns
    that error within the bound and the exchange is destroyed."""
    res = run("comm_cross_gated.py", np_, args=args, timeout=120)
    assert "cross gated checked on %d ranks" % np_ in res.output, res.output


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_one_group_paths_compute_the_same_fold(np_):
    run("comm_algorithms.py", np_, ["same-fold"])


# --- allgatherv / broadcast -----------------------------------------------------------

@pytest.mark.parametrize("np_", [2, 3, 4])
def test_allgatherv_and_broadcast(np_):
    run("comm_gather_bcast.py", np_)


# --- errors: same error on every rank, never a hang -------------------------------------

def test_bad_group_size_fails_on_every_rank():
    run("comm_errors.py", 4, ["bad-group"], env={"NVGROUP_GROUP_SIZE": 3}, timeout=60)


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_bad_arguments(np_):
    run("comm_errors.py", np_, ["bad-args"], timeout=60)


def test_barrier_timeout_names_missing_rank():
    run("comm_errors.py", 3, ["timeout"], timeout=60)


def test_abort_releases_group_members():
    run("comm_errors.py", 3, ["abort"], timeout=60)
