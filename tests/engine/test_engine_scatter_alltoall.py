"""Multi-rank tests of reducescatter, alltoall, grouped allgather, join, process
sets, small-integer allreduce and the cross-rank mismatch errors, through the
engine's pybind11 module: see tests/engine/workers/engine_scatter_alltoall.py."""
import os

import pytest

from mpi_util import assert_all_ranks_ok, run_mpi

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "engine_scatter_alltoall.py")


@pytest.mark.parametrize("np", [2, 3, 4])
def test_scatter_alltoall_join_process_sets(np):
    result = run_mpi(WORKER, np, timeout=240)
    assert_all_ranks_ok(result, np)


def test_scatter_alltoall_join_process_sets_hierarchical():
    """4 ranks as 2 NV-groups of 2: reducescatter through the hierarchical reduce-scatter."""
    result = run_mpi(WORKER, 4, env={"NVGROUP_GROUP_SIZE": "2"}, timeout=240)
    assert_all_ranks_ok(result, 4)


@pytest.mark.parametrize("np_,env", [(2, {}), (3, {}), (4, {"NVGROUP_GROUP_SIZE": "2"})])
def test_communicator_reduce_scatter_and_alltoallv(np_, env):
    """Communicator level (tests/engine/workers/comm_scatter.py): every dtype and
    op, pieces of a 4 KiB registered buffer, rows bitwise equal to Allreduce."""
    script = os.path.join(os.path.dirname(WORKER), "comm_scatter.py")
    result = run_mpi(script, np_, env=env, timeout=300)
    assert "0 failures over all ranks" in result.output, result.output[-20000:]


@pytest.mark.parametrize("np_,group_size", [(4, 2), (3, 1)])
def test_hierarchical_reduce_scatter_over_several_groups(np_, group_size):
    """Several NV-groups (4 ranks as 2 x 2; 3 ranks as 3 groups of one rank, the
    odd case the topology allows: G must divide the ranks per node), CPU
    (tests/engine/workers/comm_scatter_groups.py): the group fold + cross-group
    reduce-scatter of cc/algorithms/hierarchical_reduce_scatter.h, every dtype
    and op, uneven and zero row counts, pieces and pipelined chunks, plain and
    grouped engine reducescatter with scale factors. Rows match the float64 /
    exact reference and the hierarchical allreduce's rows bitwise, and the
    cross-group bytes are exactly the reduce-scatter's (the old full-allreduce
    path posts twice as many, or none through the flat path)."""
    script = os.path.join(os.path.dirname(WORKER), "comm_scatter_groups.py")
    result = run_mpi(script, np_, args=["--groups", np_ // group_size, "--group-size", group_size],
                     env={"NVGROUP_GROUP_SIZE": str(group_size), "OMPI_MCA_mpi_yield_when_idle": "1"},
                     timeout=400)
    assert "0 failures over all ranks" in result.output, result.output[-20000:]
