"""examples/resnet50/train.py runs data-parallel on 2 ranks through nvgrouprun
(tiny config), reports its result line, and only rank 0 writes checkpoints."""
import glob
import json
import os
import subprocess
import sys

import pytest

from mpi_util import MPI_ENV, REPO

pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(REPO, "nvgroup_tf", "lib", "libnvgroup_tf_ops.so")),
    reason="TF op library not built")


def test_resnet50_two_ranks_via_nvgrouprun(tmp_path):
    env = dict(os.environ, **MPI_ENV)
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "nvgroup_tf.runner", "-np", "2", sys.executable,
           os.path.join(REPO, "examples", "resnet50", "train.py"), "--image-size", "32", "--batch-size", "2",
           "--num-classes", "10", "--steps", "2", "--warmup-steps", "1", "--log-every", "1",
           "--bucket-cap-mb", "4", "--checkpoint-dir", str(ckpt)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-8000:]
    results = [json.loads(l[len("NVG_RESULT "):]) for l in proc.stdout.splitlines() if l.startswith("NVG_RESULT ")]
    assert len(results) == 1, "exactly rank 0 reports:\n" + proc.stdout[-4000:]
    r = results[0]
    assert r["ranks"] == 2 and r["batch_size"] == 2 and r["steps"] == 2 and r["bucket_cap_mb"] == 4.0
    assert r["img_per_sec_per_rank"] > 0 and abs(r["img_per_sec_total"] - 2 * r["img_per_sec_per_rank"]) < 1e-9
    assert "img/s per rank" in proc.stdout
    assert [os.path.basename(p) for p in glob.glob(str(ckpt / "*"))] == ["resnet50-001.weights.h5"]


def test_train_rejects_bad_flags():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", "resnet50", "train.py"),
                           "--image-size", "16"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--image-size must be >= 32" in proc.stderr, proc.stderr
