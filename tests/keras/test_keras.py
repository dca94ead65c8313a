"""nvgroup_tf.keras under mpirun: few launches, many checks each (importing
TensorFlow costs seconds per rank; see keras_worker.py for the checks)."""
import os

import pytest

from mpi_util import REPO, run_mpi

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "keras_worker.py")
LEGACY_WORKER = os.path.join(HERE, "legacy_worker.py")

ALL_CHECKS = ["fit_average_matches_single_process", "fit_sum_equals_scaled_lr", "fp16_compression",
              "backward_passes_per_step",
              "broadcast_callback_equalizes_ranks", "broadcast_callback_keeps_per_rank_dropout_seeds",
              "metric_average_callback", "lr_warmup_and_schedule",
              "mixed_precision_loss_scale", "sparse_embedding_gradients", "distributed_gradient_tape",
              "load_model_makes_optimizer_distributed", "bad_input_errors",
              "bucket_cap_is_the_agreed_value", "bucket_cap_argument_must_agree"]
THREE_RANK_CHECKS = ["fit_average_matches_single_process", "backward_passes_per_step",
                     "broadcast_callback_equalizes_ranks", "mixed_precision_loss_scale",
                     "sparse_embedding_gradients", "bucket_cap_argument_must_agree"]


def _ops_built():
    return os.path.exists(os.path.join(REPO, "nvgroup_tf", "lib", "libnvgroup_tf_ops.so"))


pytestmark = pytest.mark.skipif(not _ops_built(), reason="TF op library not built (python setup.py build_ext --inplace)")


def _check_all_ok(result, checks, np):
    for name in checks:
        for r in range(np):
            assert "[rank %d] ok %s" % (r, name) in result.output, "%s missing on rank %d:\n%s" % (
                name, r, result.output[-20000:])


def test_keras3_two_ranks():
    res = run_mpi(WORKER, 2, ALL_CHECKS, timeout=400)
    _check_all_ok(res, ALL_CHECKS, 2)


def test_keras3_three_ranks():
    res = run_mpi(WORKER, 3, THREE_RANK_CHECKS, timeout=400)
    _check_all_ok(res, THREE_RANK_CHECKS, 3)


# Horovod's tf_keras optimizer/tape API (_compute_gradients, _agg_helper,
# get_local_and_global_gradients), checked against float64 references.
LEGACY_HOROVOD_API_CHECKS = ["compute_gradients_matches_reference", "compute_gradients_aggregation",
                             "aggregation_clears_infinite_gradient", "fit_agg_helper_counter",
                             "get_local_and_global_gradients"]


def test_legacy_tf_keras_two_ranks():
    pytest.importorskip("tf_keras", reason="tf-keras not installed (scripts/setup.sh installs it)")
    checks = ["fit_matches_reference", "broadcast_callback", "backward_passes_per_step", "mixed_precision"]
    res = run_mpi(LEGACY_WORKER, 2, checks, env={"TF_USE_LEGACY_KERAS": "1"}, timeout=300)
    _check_all_ok(res, checks, 2)


def test_legacy_tf_keras_process_set_non_members():
    """tf_keras DistributedOptimizer(process_set=[0, 2]) on 4 ranks: ranks 1 and
    3 step with their own gradients (legacy_worker.py)."""
    pytest.importorskip("tf_keras", reason="tf-keras not installed (scripts/setup.sh installs it)")
    checks = ["optimizer_process_set_non_members"]
    res = run_mpi(LEGACY_WORKER, 4, checks, env={"TF_USE_LEGACY_KERAS": "1"}, timeout=300)
    _check_all_ok(res, checks, 4)


@pytest.mark.parametrize("np_", [2, 3])
def test_legacy_tf_keras_horovod_api(np_):
    pytest.importorskip("tf_keras", reason="tf-keras not installed (scripts/setup.sh installs it)")
    res = run_mpi(LEGACY_WORKER, np_, LEGACY_HOROVOD_API_CHECKS, env={"TF_USE_LEGACY_KERAS": "1"}, timeout=400)
    _check_all_ok(res, LEGACY_HOROVOD_API_CHECKS, np_)
