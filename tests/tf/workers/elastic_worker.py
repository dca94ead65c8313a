"""hvd.elastic with the same ranks: TensorFlowState and KerasState
commit/restore/sync, hvd.elastic.run retrying after HorovodInternalError and
after a real engine failure (shutdown with collectives in flight ->
AbortedError), no retry for a mismatch, the Keras elastic callbacks in fit, and
BestModelCheckpoint. argv[1]: a directory for checkpoint files."""
import os
import sys
import threading

import numpy as np

from common import Checker, hvd, run, tf

import nvgroup_tf.keras as hvdk  # noqa: E402


def equal_arrays(c, got, want, what):
    c.check(len(got) == len(want), "%s: %d arrays, want %d" % (what, len(got), len(want)))
    for i, (g, w) in enumerate(zip(got, want)):
        c.equal(g, w, "%s [%d]" % (what, i))


def same_on_all_ranks(c, arrays, what):
    blobs = hvd.allgather_object([np.asarray(a).tobytes() for a in arrays], name="same." + what)
    c.check(all(b == blobs[0] for b in blobs), "%s bitwise identical on all ranks" % what)


def check_tensorflow_state(c):
    n, me = hvd.size(), hvd.rank()
    init = [np.random.default_rng([71, me, i]).normal(size=s) for i, s in enumerate([(4, 3), (2,)])]
    variables = [tf.Variable(v) for v in init]
    state = hvd.elastic.TensorFlowState(variables, batch=me, epoch=10 * me)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.is_initialized())])
    attempts = []
    committed = {}

    @hvd.elastic.run
    def train(state, steps):
        attempts.append(1)
        if len(attempts) == 1:
            c.equal(variables[0].numpy(), np.random.default_rng([71, 0, 0]).normal(size=(4, 3)),
                    "sync gave rank 0's variables")
            c.equal((state.batch, state.epoch), (0, 0), "sync gave rank 0's attributes")
        else:
            equal_arrays(c, [v.numpy() for v in variables], committed["values"],
                         "retry starts from the last commit (variables)")
            c.equal(state.batch, committed["batch"], "retry starts from the last commit (batch)")
        for step in range(state.batch, steps):
            for v in variables:
                v.assign_add(hvd.allreduce(tf.ones_like(v) * (me + 1), op=hvd.Sum,
                                           name="elastic.step.%s" % v.name))
            state.batch = step + 1
            if step == 2:
                state.commit()
                committed["values"] = [v.numpy() for v in variables]
                committed["batch"] = state.batch
            if step == 3 and len(attempts) == 1:
                raise hvd.HorovodInternalError("simulated failure after step 3")
        return "done after %d attempts" % len(attempts)

    result = train(state, 6)
    c.equal(result, "done after 2 attempts", "run retried once after HorovodInternalError")
    c.equal(resets, [True], "reset callback ran once, after re-init")
    total = n * (n + 1) / 2
    c.equal(variables[1].numpy(), np.random.default_rng([71, 0, 1]).normal(size=(2,)) + 6 * total,
            "six steps in all (three redone after the failure are not double-counted)")
    same_on_all_ranks(c, [v.numpy() for v in variables], "TensorFlowState variables")


def check_engine_failure_is_retried(c):
    me = hvd.rank()
    state = hvd.elastic.TensorFlowState([tf.Variable([0.0])], attempt=0)
    attempts = []

    @hvd.elastic.run
    def train(state):
        attempts.append(1)
        if len(attempts) == 1:
            # A real engine failure on every rank: collectives in flight when
            # the engine shuts down fail with AbortedError.
            timer = threading.Timer(1.5, hvd.shutdown)
            timer.start()
            try:
                hvd.allreduce(tf.ones([3]), name="elastic.never.%d" % me)
            finally:
                timer.join()
        return float(hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="elastic.ok").numpy()[0])

    c.equal(train(state), float(hvd.size()), "run recovered from AbortedError")
    c.equal(len(attempts), 2, "one retry after the engine failure")

    attempts.clear()

    @hvd.elastic.run
    def mismatched(state):
        attempts.append(1)
        hvd.allreduce(tf.ones([me + 1]), name="elastic.mismatch")

    c.raises(tf.errors.FailedPreconditionError, lambda: mismatched(state),
             "a mismatch is not retried")
    c.equal(len(attempts), 1, "mismatch: one attempt")


def make_model(seed):
    keras = tf.keras
    tf.keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5)),
                  loss="mse")
    return model


def check_keras_state(c):
    me = hvd.rank()
    c.raises(ValueError, lambda: hvd.elastic.TensorFlowKerasState(
        tf.keras.Sequential([tf.keras.layers.Dense(2)]), optimizer=tf.keras.optimizers.SGD()),
        "unbuilt model", contains="built")
    model = make_model(100 + me)  # different weights per rank: sync must fix that
    rng = np.random.default_rng([81, me])
    x = rng.normal(size=(32, 5)).astype(np.float32)
    y = rng.normal(size=(32, 1)).astype(np.float32)
    state = hvdk.elastic.KerasState(model, batch=0, epoch=0)
    epochs, attempts, seen = 3, [], {}

    class FailOnce(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if len(attempts) == 1 and state.epoch == 1 and batch == 2:
                seen["weights"] = [w.numpy() for w in state._saved_model_state]
                seen["iterations"] = int(model.optimizer.iterations.numpy())
                seen["batch"] = state._saved_state["batch"]  # committed before this batch's update
                raise hvd.HorovodInternalError("simulated failure in epoch 1")

    @hvdk.elastic.run
    def train(state):
        attempts.append(1)
        if len(attempts) == 2:
            equal_arrays(c, model.get_weights(), seen["weights"], "KerasState restored the commit")
            c.equal(state.epoch, 1, "state.epoch restored")
            c.equal(state.batch, seen["batch"], "state.batch restored (last committed batch)")
        same_on_all_ranks(c, model.get_weights(), "weights after sync (attempt %d)" % len(attempts))
        model.fit(x, y, batch_size=4, epochs=epochs - state.epoch, verbose=0, shuffle=False,
                  callbacks=[hvdk.elastic.CommitStateCallback(state),
                             hvdk.elastic.UpdateBatchStateCallback(state),
                             hvdk.elastic.UpdateEpochStateCallback(state), FailOnce()])
        return state.epoch

    c.equal(train(state), epochs, "state.epoch counts epochs across the reset")
    c.equal(len(attempts), 2, "KerasState: one retry")
    c.check(seen.get("iterations", 0) > 8, "the failure happened in the second epoch")
    same_on_all_ranks(c, model.get_weights(), "weights after elastic fit")
    same_on_all_ranks(c, [v.numpy() for v in model.optimizer.variables], "optimizer state after fit")


def check_best_model_checkpoint(c, out_dir):
    me = hvd.rank()
    keras = tf.keras
    c.raises(ValueError, lambda: make_model(1).fit(np.zeros((4, 5)), np.zeros((4, 1)), verbose=0,
                                                   callbacks=[hvdk.callbacks.BestModelCheckpoint()]),
             "BestModelCheckpoint without a filepath", contains="filepath")
    rng = np.random.default_rng([91, me])
    x = rng.normal(size=(32, 5)).astype(np.float32)
    y = rng.normal(size=(32, 1)).astype(np.float32)
    for weights_only in (False, True):
        model = make_model(5)
        path = os.path.join(out_dir, "best_rank%d%s" % (me, ".weights.h5" if weights_only
                                                        else ".keras"))
        best = hvdk.callbacks.BestModelCheckpoint(monitor="loss", save_weights_only=weights_only)
        best.filepath = path
        history = []
        # Small steps first (loss falls), then a huge rate (loss rises): only
        # the best epoch may be saved.
        schedule = keras.callbacks.LearningRateScheduler(lambda e, lr: 0.05 if e < 3 else 3.0)
        record = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: history.append(
            (logs["loss"], [w.copy() for w in model.get_weights()])))
        model.fit(x, y, batch_size=8, epochs=5, verbose=0, shuffle=False,
                  callbacks=[schedule, record, best])
        losses = [h[0] for h in history]
        best_epoch = int(np.argmin(losses))
        c.check(best_epoch < 4, "the rate jump made a later epoch worse: %s" % losses)
        if weights_only:
            loaded = make_model(6)
            loaded.load_weights(path)
        else:
            loaded = keras.models.load_model(path, compile=False)
        equal_arrays(c, loaded.get_weights(), history[best_epoch][1],
                     "saved weights are the best epoch's (weights_only=%s)" % weights_only)


def main():
    c = Checker("elastic")
    hvd.init()
    legacy = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    c.check(tf.keras.__name__.startswith("tf_keras") == legacy,
            "Keras in use: %s (TF_USE_LEGACY_KERAS=%s)" % (tf.keras.__name__, legacy))
    check_tensorflow_state(c)
    check_engine_failure_is_retried(c)
    check_keras_state(c)
    check_best_model_checkpoint(c, sys.argv[1])
    c.finish()


if __name__ == "__main__":
    run(main)
