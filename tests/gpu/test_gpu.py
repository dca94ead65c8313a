"""GPU tests: skip cleanly on machines without (enough) NVIDIA GPUs.

Run on the GPU machine by scripts/device/run_all.sh (stage `pytest`):
  * the C++ correctness suite (cc/tools/allreduce_check, built by
    scripts/device/build_tools.sh) on every GPU, quick mode;
  * the Python worker: Communicator and engine on cuda:N through cupy.
"""
import os
import shutil
import subprocess

import pytest

from mpi_util import MPI_ENV, REPO, run_mpi


def _gpu_count():
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


NGPU = _gpu_count()
needs_two_gpus = pytest.mark.skipif(NGPU < 2, reason="needs at least 2 NVIDIA GPUs (found %d)" % NGPU)
CHECK = os.path.join(REPO, "build", "tools", "allreduce_check")


@needs_two_gpus
def test_allreduce_check_tool_quick():
    if not os.path.exists(CHECK):
        subprocess.run([os.path.join(REPO, "scripts", "device", "build_tools.sh")], check=True, cwd=REPO)
    env = dict(os.environ)
    env.update(MPI_ENV)
    res = subprocess.run(["mpirun", "-np", str(NGPU), "--bind-to", "none", CHECK, "--quick"], env=env,
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert res.returncode == 0 and "PASSED" in res.stdout, res.stdout[-5000:]


@needs_two_gpus
def test_python_communicator_and_engine_on_cuda():
    pytest.importorskip("cupy")
    engine = pytest.importorskip("nvgroup_tf._engine")
    del engine
    worker = os.path.join(os.path.dirname(__file__), "workers", "cuda_communicator_worker.py")
    res = run_mpi(worker, NGPU, timeout=600, check=False)
    assert res.returncode == 0 and "PASSED" in res.output, res.output[-5000:]
