"""reducescatter, alltoall, grouped allgather, broadcast_ and process sets under
XLA (ops/xla_lowering.cc and the handlers): one launch per rank count runs every check of
tests/tf/workers/xla_scatter_alltoall.py (see its docstring)."""
import os

import pytest

from mpi_util import REPO, run_mpi

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "xla_scatter_alltoall.py")

pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(REPO, "nvgroup_tf", "lib", "libnvgroup_tf_ops.so")),
    reason="TF op library not built (python setup.py build_ext --inplace)")


# 2 and 3 ranks (even and odd); the 4-rank launch (~4 min on the 2-core CI machine) runs with
# NVGROUP_TEST_XLA_FOUR_RANKS=1. The engine paths of these collectives are tested at 4 ranks without
# XLA (tests/engine/test_engine_scatter_alltoall.py, tests/tf/test_tf_scatter_alltoall.py).
@pytest.mark.parametrize("ranks", [2, 3] + ([4] if os.environ.get("NVGROUP_TEST_XLA_FOUR_RANKS") == "1" else []))
def test_scatter_alltoall_gradients_and_errors_under_xla(ranks):
    result = run_mpi(WORKER, ranks, args=["collectives", "gradients", "errors"], timeout=900)
    assert result.output.count(" 0 failures") == ranks, result.output[-20000:]


def test_scatter_alltoall_as_start_done_pairs():
    """NVGROUP_XLA_START_DONE=1 (ops/xla_ops.h Note [Start and done]) on 3 ranks."""
    result = run_mpi(WORKER, 3, args=["collectives", "gradients", "errors"], env={"NVGROUP_XLA_START_DONE": "1"},
                     timeout=900)
    assert result.output.count(" 0 failures") == 3, result.output[-20000:]
