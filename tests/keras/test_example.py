"""examples/resnet50/train.py runs data-parallel on 2 ranks through nvgrouprun
(tiny config), reports its result line (loss averaged over ranks), shows
Keras' progress bar on rank 0 only, only rank 0 writes checkpoints, and
--resume continues from them (issue 9 item 9)."""
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
    assert [os.path.basename(p) for p in glob.glob(str(ckpt / "*"))] == ["resnet50-001.keras"]
    # Keras' progress bar on rank 0 only: one final bar line per epoch ("3/3 ...").
    assert "3/3" in proc.stdout, proc.stdout[-4000:]
    assert r["loss_averaged_over_ranks"] is not None

    # --resume: every rank loads rank 0's newest checkpoint (optimizer state
    # included) and trains the remaining epoch; pinned to one core each.
    cmd2 = cmd[:cmd.index("--checkpoint-dir")] + ["--checkpoint-dir", str(ckpt), "--epochs", "2", "--resume",
                                                   "--cores-per-rank", "1", "--intra-op-threads", "1"]
    proc = subprocess.run(cmd2, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-8000:]
    # 1 untimed + 2 timed steps per epoch: the resumed optimizer has counted 3.
    assert "resumed from %s (epoch 1, optimizer iterations 3)" % (ckpt / "resnet50-001.keras") in proc.stdout, \
        proc.stdout[-4000:]
    assert "each rank pinned to 1 core(s)" in proc.stdout
    assert sorted(os.path.basename(p) for p in glob.glob(str(ckpt / "*"))) == ["resnet50-001.keras",
                                                                               "resnet50-002.keras"]
    assert proc.stdout.count("Epoch 2/2") == 1 and "Epoch 1/2" not in proc.stdout, proc.stdout[-4000:]


def test_train_rejects_bad_flags():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", "resnet50", "train.py"),
                           "--image-size", "16"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--image-size must be >= 32" in proc.stderr, proc.stderr


def test_make_dataset_reads_image_dirs_and_tfrecords(tmp_path):
    """--data-dir: class-per-directory images and ImageNet-style TFRecords,
    sharded by rank, batched, scaled to [0, 1], labels from 0."""
    import importlib.util

    import numpy as np
    tf = pytest.importorskip("tensorflow")
    spec = importlib.util.spec_from_file_location("resnet50_train", os.path.join(REPO, "examples", "resnet50",
                                                                                "train.py"))
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    rng = np.random.default_rng(0)
    images = {}
    for cls in ("cat", "dog"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for k in range(4):
            img = rng.integers(1, 255, size=(40, 48, 3), dtype=np.uint8)
            tf.io.write_file(str(tmp_path / "imgs" / cls / ("%d.png" % k)), tf.io.encode_png(img))
            images[(cls, k)] = img
    args = train.parse_args(["--data-dir", str(tmp_path / "imgs"), "--image-size", "32", "--batch-size", "2",
                             "--num-classes", "2"])
    x, y = next(iter(train.make_dataset(args, 0, 2, tf, np)))
    assert x.shape == (2, 32, 32, 3) and y.dtype == tf.int32
    assert 0.0 <= float(tf.reduce_min(x)) and float(tf.reduce_max(x)) <= 1.0 and float(tf.reduce_max(x)) > 0.5
    assert set(y.numpy().tolist()) <= {0, 1}

    (tmp_path / "rec").mkdir()
    for shard in range(2):
        with tf.io.TFRecordWriter(str(tmp_path / "rec" / ("train-%05d-of-00002" % shard))) as w:
            for k in range(3):
                img = rng.integers(1, 255, size=(36, 36, 3), dtype=np.uint8)
                ex = tf.train.Example(features=tf.train.Features(feature={
                    "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(
                        value=[tf.io.encode_jpeg(img).numpy()])),
                    "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[shard + 1]))}))
                w.write(ex.SerializeToString())
    args = train.parse_args(["--data-dir", str(tmp_path / "rec"), "--image-size", "32", "--batch-size", "3"])
    for rank in range(2):  # each rank reads its own file: labels 1 -> 0 on rank 0, 2 -> 1 on rank 1
        x, y = next(iter(train.make_dataset(args, rank, 2, tf, np)))
        assert x.shape == (3, 32, 32, 3) and y.numpy().tolist() == [rank] * 3
