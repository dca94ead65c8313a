"""examples/resnet50/train.py runs data-parallel on 2 ranks through nvgrouprun
(tiny config), reports its result line (loss averaged over ranks), shows
Keras' progress bar on rank 0 only, only rank 0 writes checkpoints, and
--resume continues from them."""
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from mpi_util import MPI_ENV, REPO

pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(REPO, "nvgroup_tf", "lib", "libnvgroup_tf_ops.so")),
    reason="TF op library not built")


def read_rank_output(directory, rank):
    """(stdout, stderr) of one rank from nvgrouprun --output-filename DIR."""
    (rank_dir,) = glob.glob(os.path.join(directory, "rank.*%d" % rank))
    with open(os.path.join(rank_dir, "stdout")) as out, open(os.path.join(rank_dir, "stderr")) as err:
        # Keras colours its progress bar even into a file: drop the ANSI codes.
        return tuple(re.sub(r"\x1b\[[0-9;]*m", "", f.read()) for f in (out, err))


def test_resnet50_two_ranks_via_nvgrouprun(tmp_path):
    env = dict(os.environ, **MPI_ENV)
    ckpt = tmp_path / "ckpt"
    logs = tmp_path / "logs"
    train = [sys.executable, os.path.join(REPO, "examples", "resnet50", "train.py"), "--image-size", "32",
             "--batch-size", "2", "--num-classes", "10", "--steps", "2", "--warmup-steps", "1", "--log-every", "1",
             "--bucket-cap-mb", "4", "--checkpoint-dir", str(ckpt)]
    runner = [sys.executable, "-m", "nvgroup_tf.runner", "-np", "2"]
    # Each rank's stdout/stderr in its own file, so what rank 1 prints is seen apart from rank 0.
    proc = subprocess.run(runner + ["--output-filename", str(logs)] + train + ["--log-local-loss"], env=env,
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400)
    (out0, err0), (out1, err1) = read_rank_output(logs, 0), read_rank_output(logs, 1)
    everything = "\n".join([proc.stdout, "--- rank 0 stdout", out0, "--- rank 0 stderr", err0[-3000:],
                            "--- rank 1 stdout", out1, "--- rank 1 stderr", err1[-3000:]])
    assert proc.returncode == 0, everything[-12000:]
    results = [json.loads(l[len("NVG_RESULT "):]) for l in out0.splitlines() if l.startswith("NVG_RESULT ")]
    assert len(results) == 1, "rank 0 reports once:\n" + everything[-6000:]
    r = results[0]
    assert r["ranks"] == 2 and r["batch_size"] == 2 and r["steps"] == 2 and r["bucket_cap_mb"] == 4.0
    assert r["img_per_sec_per_rank"] > 0 and abs(r["img_per_sec_total"] - 2 * r["img_per_sec_per_rank"]) < 1e-9
    assert "img/s per rank" in out0
    assert [os.path.basename(p) for p in glob.glob(str(ckpt / "*"))] == ["resnet50-001.keras"]

    # Keras' progress bar on rank 0 only: rank 0's stdout has the epoch's final
    # bar ("3/3 ━━━━ ... - loss: X"); rank 1 prints no bar, no loss, no report.
    # (Written to a file, Keras also prints the last batch's update before the
    # final bar: that one shows rank 0's own running loss, as with Horovod,
    # whose MetricAverageCallback averages at the epoch's end.)
    bars = re.findall(r"^3/3 \S*━\S* .* - loss: ([-+.0-9e]+)", out0, re.M)
    assert len(bars) >= 1, "no final progress bar on rank 0:\n" + everything[-6000:]
    rank1_printed = out1 + "\n".join(l for l in err1.splitlines() if not l.startswith("# rank 1 local loss"))
    for mark in ("━", "loss", "NVG_RESULT", "img/s", "3/3"):
        assert mark not in rank1_printed, "rank 1 printed %r (progress bar or report):\n%s" % (
            mark, everything[-6000:])

    # The loss rank 0 prints is the average over ranks of each rank's own loss
    # (each rank's stderr has its local one, from --log-local-loss).
    local = []
    for rank, err in ((0, err0), (1, err1)):
        found = re.findall(r"^# rank %d local loss epoch 1: (\S+)$" % rank, err, re.M)
        assert len(found) == 1, "rank %d did not log its local loss:\n%s" % (rank, everything[-6000:])
        local.append(float(found[0]))
    mean = (local[0] + local[1]) / 2
    # Different data on each rank: the average is distinguishable from either rank's loss at the 4
    # decimals Keras prints (so printing rank 0's own loss fails below).
    assert abs(local[0] - local[1]) > 1e-3, local
    bar_loss = float(bars[-1])
    assert abs(bar_loss - mean) <= 5.1e-5, (bar_loss, local, everything[-4000:])  # Keras prints %.4f
    # The result line's loss (the last step's, averaged by one allreduce) is the same epoch mean.
    assert abs(r["loss_averaged_over_ranks"] - mean) <= 1e-5 * max(1.0, abs(mean)), (r, local)
    assert re.search(r"loss %.4f " % r["loss_averaged_over_ranks"], out0), out0[-3000:]

    cmd = runner + train
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
