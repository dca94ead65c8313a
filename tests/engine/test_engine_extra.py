"""Multi-rank tests of the collectives added for Horovod parity (issue 10),
through the engine's pybind11 module: see tests/engine/workers/engine_extra.py."""
import os

import pytest

from mpi_util import run_mpi

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "engine_extra.py")


@pytest.mark.parametrize("np", [2, 3, 4])
def test_extra_collectives(np):
    result = run_mpi(WORKER, np, timeout=240)
    for r in range(np):
        assert "[rank %d] OK" % r in result.output, result.output[-20000:]


def test_extra_collectives_hierarchical():
    """4 ranks as 2 NV-groups of 2: reducescatter through the allreduce's fold."""
    result = run_mpi(WORKER, 4, env={"NVGROUP_GROUP_SIZE": "2"}, timeout=240)
    for r in range(4):
        assert "[rank %d] OK" % r in result.output, result.output[-20000:]


@pytest.mark.parametrize("np_,env", [(2, {}), (3, {}), (4, {"NVGROUP_GROUP_SIZE": "2"})])
def test_communicator_reduce_scatter_and_alltoallv(np_, env):
    """Communicator level (tests/engine/workers/comm_scatter.py): every dtype and
    op, pieces of a 4 KiB registered buffer, rows bitwise equal to Allreduce."""
    script = os.path.join(os.path.dirname(WORKER), "comm_scatter.py")
    result = run_mpi(script, np_, env=env, timeout=300)
    assert "0 failures over all ranks" in result.output, result.output[-20000:]
