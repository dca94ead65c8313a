"""A small elastic program for the campaign's elastic trials (elastic_campaign.py),
run by nvgrouprun's elastic mode. A dense model of ~0.6M weights (so a commit
writes a few MB) trained for STEPS batches, committed after every batch.

argv: STEPS RECORD_DIR. The fault comes from CAMPAIGN_FAULT = "phase launch rank
delay_s":
  train   -- the rank SIGKILLs itself delay_s after its training starts;
  commit  -- the rank SIGKILLs itself delay_s after entering the file write of
             commit number (launch's first commit + 20): inside or just after it;
  relaunch -- the rank SIGKILLs itself delay_s after the process starts
             (launch >= 1: during the relaunch's start-up, init or resume).
Each process appends lines to RECORD_DIR/<pid>.rec: START, FAULT <t> <batch>,
RESUMED <t> <batch>, RESULT <batch> <digest>.
"""
import hashlib
import os
import signal
import sys
import threading
import time

STEPS = int(sys.argv[1])
RECORD = os.path.join(sys.argv[2], "%d.rec" % os.getpid())
phase, f_launch, f_rank, delay = (os.environ.get("CAMPAIGN_FAULT", "none -1 -1 0").split() + ["0"] * 4)[:4]
f_launch, f_rank, delay = int(f_launch), int(f_rank), float(delay)
# The launch's number before TensorFlow is imported (the relaunch fault's clock
# starts at the process's start): the settings table through the engine's
# pybind11 module, which `import nvgroup_tf` loads without TensorFlow.
from nvgroup_tf import _engine  # noqa: E402
LAUNCH = int(_engine.setting_value("NVGROUP_ELASTIC_LAUNCH") or "0")
RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", "-1"))
victim = LAUNCH == f_launch and RANK == f_rank
# CAMPAIGN_FIRST=1 (the relaunch trials): launch 0 first loses rank 1 one second into training.
first_victim = os.environ.get("CAMPAIGN_FIRST") == "1" and LAUNCH == 0 and RANK == 1
current_batch = [-1]


def record(text):
    with open(RECORD, "a") as f:
        f.write(text + "\n")


def die_after(seconds, what=phase):
    def fire():
        time.sleep(seconds)
        record("FAULT %.6f %d %s" % (time.time(), current_batch[0], what))
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=fire, daemon=True).start()


record("START %d %d %.6f" % (RANK, LAUNCH, time.time()))
if victim and phase == "relaunch":
    die_after(delay)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import nvgroup_tf as hvd  # noqa: E402
import nvgroup_tf.elastic as elastic  # noqa: E402

hvd.init()
model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(1024, activation="relu"),
                             tf.keras.layers.Dense(512, activation="relu"), tf.keras.layers.Dense(1)])
opt = tf.keras.optimizers.SGD(0.01)
x = tf.constant(np.random.default_rng(RANK).normal(size=(32, 64)), tf.float32)
y = tf.reduce_sum(x, axis=1, keepdims=True)


@tf.function
def step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))


state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0)
if victim and phase == "commit":
    real_write = elastic._write_commit
    calls = [0]

    def write_and_die(job, counter, payload):
        calls[0] += 1
        if calls[0] == 20:
            die_after(delay)
        return real_write(job, counter, payload)
    elastic._write_commit = write_and_die


@hvd.elastic.run
def train(state):
    record("RESUMED %.6f %d" % (time.time(), state.batch))
    if victim and phase == "train":
        die_after(delay)
    if first_victim:
        die_after(1.0, "first")
    for state.batch in range(state.batch, STEPS):
        current_batch[0] = state.batch
        step()
        state.commit()


train(state)
digest = hashlib.sha256(b"".join(np.asarray(v.numpy()).tobytes() for v in model.weights)).hexdigest()
record("RESULT %d %s %d" % (state.batch, digest, hvd.size()))
