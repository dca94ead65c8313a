"""The TF GPU suite: nvgroup_tf's DEVICE_GPU kernels through TensorFlow.

Skipped unless TensorFlow sees a GPU and the op library was built with CUDA
(NVGROUP_WITH_CUDA=1, against a TF GPU build). On the GPU machines, which have
no TensorFlow, scripts/device/tfgpu_suite.sh runs it through the kit in
../shared/tfgpu (README 'Builds and checks'). 1 rank, and 2-4 ranks sharing
one GPU (local_rank % GPUs).

The tests named *memory* take the GPU's free memory: run them on their own
(`-k memory`), not beside other GPU jobs (the suite script does).
"""
import functools
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest

from mpi_util import REPO, run_mpi

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
# PYTHONPATH as run_mpi sets it (the repo), plus whatever this process has (the
# kit puts TensorFlow's GPU wheel there).
ENV = {"PYTHONPATH": os.pathsep.join(p for p in [REPO, WORKERS, os.environ.get("PYTHONPATH", "")] if p),
       "OMPI_MCA_mpi_yield_when_idle": "1"}


@functools.lru_cache(maxsize=1)
def tf_gpu_setup():
    """(number of GPUs TensorFlow sees, op library built with CUDA), asked in a
    child process so this one never initializes CUDA."""
    code = ("import tensorflow as tf, nvgroup_tf as hvd; "
            "print('TFGPU', len(tf.config.list_physical_devices('GPU')), int(hvd.cuda_built()))")
    env = dict(os.environ)
    env["PYTHONPATH"] = ENV["PYTHONPATH"]
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             env=env, cwd=REPO).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0, False
    m = re.search(r"^TFGPU (\d+) (\d)$", out, flags=re.MULTILINE)
    return (int(m.group(1)), m.group(2) == "1") if m else (0, False)


@pytest.fixture
def tf_gpu():
    gpus, cuda_built = tf_gpu_setup()
    if gpus == 0:
        pytest.skip("TensorFlow sees no GPU (tensorflow-cpu, or no GPU here)")
    if not cuda_built:
        pytest.skip("the op library was built without CUDA (NVGROUP_WITH_CUDA=1)")
    return gpus


def worker(name):
    return os.path.join(WORKERS, name)


def passed(result, np_):
    return result.output.count("] PASSED") == np_


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_every_collective_dtype_and_mode_on_gpu(tf_gpu, np_):
    r = run_mpi(worker("tf_gpu_collectives.py"), np_, env=ENV, timeout=900, check=False)
    assert not r.timed_out and r.returncode == 0 and passed(r, np_), r.output[-20000:]


@pytest.mark.parametrize("np_", [1, 2])
def test_every_collective_with_ops_finishing_on_tf_stream(tf_gpu, np_):
    # NVGROUP_TF_CUDA_WAIT=stream: each op finishes once its collective was
    # enqueued, TF's compute stream waiting on the engine's completion event
    # (ops/adapter.h); the default, host, is the test above.
    r = run_mpi(worker("tf_gpu_collectives.py"), np_, env=dict(ENV, NVGROUP_TF_CUDA_WAIT="stream"), timeout=900,
                check=False)
    assert not r.timed_out and r.returncode == 0 and passed(r, np_), r.output[-20000:]


@pytest.mark.parametrize("np_", [1, 2])
def test_xla_collectives_on_gpu_with_the_default_lowering(tf_gpu, np_):
    """tests/tf/workers/xla.py on XLA GPU with NVGROUP_XLA_START_DONE unset: every collective lowers to a
    start and a done (auto on a GPU; the worker counts the custom calls and checks their chain in the
    compiled program), values against the non-XLA op and a float64 reference, identical on every rank;
    with 2 ranks also the mismatch errors; Keras fit under XLA."""
    if os.environ.get("NVGROUP_TEST_TF_GPU_DENSE") != "1":
        pytest.skip("XLA on a GPU initializes cuDNN and cuBLAS (NVGROUP_TEST_TF_GPU_DENSE=1: TFGPU_FULL=1 kit mode "
                    "or a real TF GPU install)")
    sections = ["collectives", "fit"] + (["errors"] if np_ > 1 else [])
    env = dict(ENV, NVGROUP_XLA_START_DONE="auto", TF_FORCE_GPU_ALLOW_GROWTH="true")
    r = run_mpi(os.path.join(REPO, "tests", "tf", "workers", "xla.py"), np_, args=sections, env=env, timeout=600,
                check=False)
    assert not r.timed_out and r.returncode == 0, r.output[-20000:]
    assert r.output.count(" 0 failures") == np_, r.output[-20000:]


@pytest.mark.parametrize("np_", [1, 2, 4])
def test_keras_fit_on_gpu_matches_one_process(tf_gpu, np_):
    # TFGPU_FULL=1 kit mode (or a real TF GPU install) has cuBLAS: Dense layers too.
    # With cuBLAS/cuDNN also Dense and Conv models, and each with XLA (jit_compile=True: the collectives
    # as XLA custom calls on the GPU; XLA's GPU backend needs the real libraries too).
    kinds = [["elementwise"]]
    if os.environ.get("NVGROUP_TEST_TF_GPU_DENSE") == "1":
        kinds += [["dense"], ["conv"], ["elementwise", "xla"], ["dense", "xla"], ["conv", "xla"]]
    for kind in kinds:
        r = run_mpi(worker("tf_gpu_keras.py"), np_, args=kind, env=ENV, timeout=600, check=False)
        assert not r.timed_out and r.returncode == 0 and passed(r, np_), " ".join(kind) + "\n" + r.output[-20000:]


@pytest.mark.parametrize("np_", [1, 2])
def test_resnet50_example_trains_on_gpu(tf_gpu, np_):
    """examples/resnet50/train.py on the GPU (real cuDNN: TFGPU_FULL=1 kit mode or a real TF GPU install),
    with XLA (Keras' default) and DistributedOptimizer: it trains (finite loss, every step ran, ranks agree
    on the averaged loss) and reports img/s, which the suite prints (never asserted)."""
    if os.environ.get("NVGROUP_TEST_TF_GPU_DENSE") != "1":
        pytest.skip("needs cuDNN (NVGROUP_TEST_TF_GPU_DENSE=1: TFGPU_FULL=1 kit mode or a real TF GPU install)")
    args = ["--batch-size", "64", "--image-size", "224", "--steps", "20", "--warmup-steps", "5", "--log-every", "10"]
    r = run_mpi(os.path.join(REPO, "examples", "resnet50", "train.py"), np_, args=args,
                env=dict(ENV, TF_FORCE_GPU_ALLOW_GROWTH="true"), timeout=600, check=False)
    assert not r.timed_out and r.returncode == 0, r.output[-20000:]
    results = [json.loads(line.split(" ", 1)[1]) for line in r.output.splitlines() if line.startswith("NVG_RESULT ")]
    assert results, r.output[-20000:]
    for res in results:
        print("RESNET50_GPU np=%d %s" % (np_, json.dumps(res)))
    losses = re.findall(r"loss ([-+0-9.eE]+|nan|inf)", r.output)
    assert losses and all(math.isfinite(float(v)) for v in losses), r.output[-20000:]


def test_dead_rank_during_gpu_collectives_is_named_by_every_survivor(tf_gpu, tmp_path):
    record = tmp_path / "record"
    record.mkdir()
    env = dict(ENV, NVGROUP_TIMEOUT=60, REL_RECORD_DIR=str(record))
    start = time.monotonic()
    r = run_mpi(worker("tf_gpu_rank_failure.py"), 3, args=[1, 25], env=env, timeout=300, check=False)
    seconds = time.monotonic() - start
    for f in sorted(record.iterdir()):
        r.output += "\n" + f.read_text()
    assert not r.timed_out and r.returncode != 0, r.output[-20000:]
    killed = re.findall(r"^rank 1: KILL ([0-9.]+)$", r.output, flags=re.MULTILINE)
    assert killed, r.output[-20000:]
    for survivor in (0, 2):
        caught = re.findall(r"^rank %d: CAUGHT ([0-9.]+) UnavailableError .*rank 1 \(host [^,]+, pid \d+\) died"
                            % survivor, r.output, flags=re.MULTILINE)
        assert caught, "rank %d did not raise UnavailableError naming rank 1:\n%s" % (survivor, r.output[-20000:])
        assert float(caught[0]) - float(killed[0]) < 5.0, r.output[-20000:]
    assert seconds < 120, "the job took %.0f s to end after a rank died" % seconds


def test_dead_rank_inside_an_xla_program_on_gpu_is_named_by_every_survivor(tf_gpu, tmp_path):
    """tests/tf/workers/xla.py's dead section on the GPU with the default lowering (a start/done pair per
    collective): rank 1 is SIGKILLed while the others run the compiled step; each survivor's XLA program
    raises UnavailableError naming rank 1, within 5 s of its first step after the death."""
    if os.environ.get("NVGROUP_TEST_TF_GPU_DENSE") != "1":
        pytest.skip("XLA on a GPU initializes cuDNN and cuBLAS (NVGROUP_TEST_TF_GPU_DENSE=1: TFGPU_FULL=1 kit mode "
                    "or a real TF GPU install)")
    env = dict(ENV, NVGROUP_TIMEOUT=60, NVGROUP_XLA_START_DONE="auto", XLA_RECORD_DIR=str(tmp_path),
               TF_FORCE_GPU_ALLOW_GROWTH="true")
    start = time.monotonic()
    r = run_mpi(os.path.join(REPO, "tests", "tf", "workers", "xla.py"), 3, args=["dead", 1], env=env, timeout=300,
                check=False)
    seconds = time.monotonic() - start
    for f in sorted(tmp_path.iterdir()):  # lines mpirun may have dropped when it ended the job
        r.output += "\n" + f.read_text()
    assert not r.timed_out and r.returncode != 0, r.output[-20000:]
    assert "rank 1: KILL" in r.output, r.output[-20000:]
    for survivor in (0, 2):
        caught = re.findall(r"^rank %d: CAUGHT UnavailableError after ([0-9.]+) s: .*rank 1" % survivor, r.output,
                            flags=re.MULTILINE)
        assert caught, "rank %d did not raise UnavailableError naming rank 1:\n%s" % (survivor, r.output[-20000:])
        assert float(caught[0]) < 5.0, r.output[-20000:]
    assert seconds < 120, "the job took %.0f s to end after a rank died" % seconds


@pytest.mark.parametrize("np_", [1, 2])
def test_memory_registered_at_init_survives_tf_taking_the_gpu(tf_gpu, np_):
    r = run_mpi(worker("tf_gpu_memory.py"), np_, args=["after_init"], env=ENV, timeout=300, check=False)
    assert not r.timed_out and r.returncode == 0 and passed(r, np_), r.output[-20000:]


def test_memory_missing_at_init_is_a_clear_error_on_every_rank(tf_gpu):
    r = run_mpi(worker("tf_gpu_memory.py"), 2, args=["before_init"], env=ENV, timeout=300, check=False)
    assert not r.timed_out and r.returncode == 0 and passed(r, 2), r.output[-20000:]
