"""Multi-rank tests of the TF ops reducescatter, alltoall, grouped_allgather,
broadcast_, join and process sets (and their gradients): see
tests/tf/workers/scatter_alltoall.py."""
import os

import pytest

from mpi_util import run_mpi

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "scatter_alltoall.py")


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_scatter_alltoall_join_process_sets(ranks):
    result = run_mpi(WORKER, ranks, timeout=420)
    assert result.output.count(" 0 failures") == ranks, result.output[-20000:]
