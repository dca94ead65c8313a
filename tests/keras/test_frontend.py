"""Front-end correctness under mpirun: one launch per rank count runs every
check of frontend_worker.py (what each covers is listed next to its name)."""
import os

import pytest

from mpi_util import REPO, run_mpi

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "frontend_worker.py")

CHECKS = [
    "broadcast_callback_lazily_built_models",       # BroadcastGlobalVariablesCallback, models built lazily
    "auto_names_survive_uneven_retrace",            # collective names inside tf.function
    "collectives_not_pruned_folded_or_chained",     # stateful, independent collective ops
    "unique_names_per_tape_and_reduction",          # unique names per tape and per reduction
    "eager_tape_runs_buckets_traced",               # eager loops: the reduction runs traced
    "per_model_mixed_precision",                    # Model(dtype="mixed_float16"): reduce before the finite check
    "horovod_arguments",                            # Horovod's DistributedOptimizer/Tape arguments
    "horovod_collective_gradients",                 # allgather/broadcast gradients
    "horovod_example_script",                       # Horovod's examples: sycl_built, experimental_run_tf_function
    "horovod_tf2_example_script",                   # Horovod's TF2 examples: opt.variables() on Keras 3
    "local_variables_and_compute_gradients",        # Partial*, register_local_var, compute_gradients
]


def _ops_built():
    return os.path.exists(os.path.join(REPO, "nvgroup_tf", "lib", "libnvgroup_tf_ops.so"))


pytestmark = pytest.mark.skipif(not _ops_built(), reason="TF op library not built (python setup.py build_ext --inplace)")


def _check_all_ok(result, checks, np):
    for name in checks:
        for r in range(np):
            assert "[rank %d] ok %s" % (r, name) in result.output, "%s missing on rank %d:\n%s" % (
                name, r, result.output[-20000:])


def test_frontend_two_ranks():
    res = run_mpi(WORKER, 2, CHECKS, timeout=500)
    _check_all_ok(res, CHECKS, 2)


HOROVOD_BEHAVIOUR_CHECKS = [
    "repeated_init_process_sets",   # init(process_sets=) again, mpi_ops._basics, unregistered ids
    "tf1_optimizer_reduces",        # DistributedOptimizer(tf.compat.v1.train optimizer) in a Session
    "local_variable_refs",          # v.ref() of Keras 3 variables as local variables
]


def test_horovod_behaviours_two_ranks():
    res = run_mpi(WORKER, 2, HOROVOD_BEHAVIOUR_CHECKS, timeout=400)
    _check_all_ok(res, HOROVOD_BEHAVIOUR_CHECKS, 2)


def test_checkpoint_resume_in_new_processes(tmp_path):
    """Train + checkpoint on rank 0, then load on all ranks in
    a new launch, continue: equal to the uninterrupted run."""
    env = {"NVG_CKPT_DIR": str(tmp_path)}
    res = run_mpi(WORKER, 2, ["checkpoint_save"], env=env, timeout=300)
    _check_all_ok(res, ["checkpoint_save"], 2)
    res = run_mpi(WORKER, 2, ["checkpoint_resume"], env=env, timeout=300)
    _check_all_ok(res, ["checkpoint_resume"], 2)
