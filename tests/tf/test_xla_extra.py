"""The collectives added for Horovod parity under XLA (ops/xla_ops.cc): one launch
per rank count runs every check of tests/tf/workers/xla_extra.py (see its
docstring)."""
import os

import pytest

from mpi_util import REPO, run_mpi

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "xla_extra.py")

pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(REPO, "nvgroup_tf", "lib", "libnvgroup_tf_ops.so")),
    reason="TF op library not built (python setup.py build_ext --inplace)")


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_new_collectives_gradients_and_errors_under_xla(ranks):
    result = run_mpi(WORKER, ranks, args=["collectives", "gradients", "errors"], timeout=900)
    assert result.output.count(" 0 failures") == ranks, result.output[-20000:]
