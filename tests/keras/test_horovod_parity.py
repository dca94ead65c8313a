"""Horovod's results for a Horovod program (issue 30): the LR schedule of a
number multiplier, optimizer settings kept through DistributedOptimizer, saved
models that load without nvgroup_tf, process sets on non-member ranks. See
parity_worker.py for the checks."""
import os

import pytest

from mpi_util import REPO, run_mpi

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "parity_worker.py")
CHECKS = ["lr_schedule_number_multiplier", "optimizer_settings_survive_wrapping",
          "saved_model_loads_without_nvgroup"]

pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(REPO, "nvgroup_tf", "lib", "libnvgroup_tf_ops.so")),
    reason="TF op library not built (python setup.py build_ext --inplace)")


def _check_all_ok(result, checks, np_):
    for name in checks:
        for r in range(np_):
            assert "[rank %d] ok %s" % (r, name) in result.output, "%s missing on rank %d:\n%s" % (
                name, r, result.output[-20000:])


@pytest.mark.parametrize("np_", [2, 3])
def test_keras3_horovod_parity(np_):
    res = run_mpi(WORKER, np_, CHECKS, timeout=400)
    _check_all_ok(res, CHECKS, np_)


def test_process_sets_four_ranks():
    checks = ["tape_process_set_non_members", "optimizer_process_set_non_members", "process_set_ids_reused"]
    res = run_mpi(WORKER, 4, checks, timeout=400)
    _check_all_ok(res, checks, 4)
