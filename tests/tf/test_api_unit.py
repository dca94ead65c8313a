"""Single-process checks of the Python package (no mpirun)."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_python(code):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_import_is_lazy():
    # nvgroup_tf.runner and nvgroup_tf._engine users must not pay for TensorFlow.
    proc = run_python("import sys, nvgroup_tf, nvgroup_tf.runner\n"
                      "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
                      "print('lazy ok')")
    assert proc.returncode == 0 and "lazy ok" in proc.stdout, proc.stdout + proc.stderr


def test_public_names_resolve_and_match_horovod():
    proc = run_python(
        "import nvgroup_tf as hvd\n"
        "missing = [n for n in hvd.__all__ if getattr(hvd, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == "
        "(0, 1, 2, 3, 4, 5)\n"
        "assert hvd.mpi_ops.allgather is hvd.allgather and not hvd.is_initialized()\n"
        "try:\n    hvd.nonexistent\nexcept AttributeError as e:\n    print('attr ok', e)\n")
    assert proc.returncode == 0 and "attr ok" in proc.stdout, proc.stdout + proc.stderr
