"""Multi-rank tests of the TF ops added for Horovod parity (issue 10): see
tests/tf/workers/collectives_extra.py."""
import os

import pytest

from mpi_util import run_mpi

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "collectives_extra.py")


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_extra_collectives(ranks):
    result = run_mpi(WORKER, ranks, timeout=420)
    assert result.output.count(" 0 failures") == ranks, result.output[-20000:]
