"""Multi-rank checks of nvgroup_tf.keras with tf_keras (TF_USE_LEGACY_KERAS=1).
Same protocol as keras_worker.py: "[rank r] ok name" or "[rank r] FAIL name".
"""
import os
import sys
import traceback

assert os.environ.get("TF_USE_LEGACY_KERAS") == "1", "run with TF_USE_LEGACY_KERAS=1"

import numpy as np
import tensorflow as tf
import tf_keras

import nvgroup_tf.keras as hvd

assert tf.keras is tf_keras or tf.keras.__name__.startswith("tf_keras"), tf.keras.__name__
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
B, STEPS, LR = 4, 5, 0.05
RTOL, ATOL = 2e-5, 1e-6


def model_fn(seed, dtype=None):
    tf.keras.utils.set_random_seed(seed)
    kw = {} if dtype is None else {"dtype": dtype}
    return tf.keras.Sequential([tf.keras.layers.Dense(8, activation="tanh", input_shape=(6,), **kw),
                                tf.keras.layers.Dense(3, **kw)])


def data(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((STEPS * SIZE * B, 6)).astype(np.float32)
    y = rng.standard_normal((STEPS * SIZE * B, 3)).astype(np.float32)
    return x, y


def rank_slice(a):
    return np.concatenate([a[(s * SIZE + RANK) * B:(s * SIZE + RANK + 1) * B] for s in range(STEPS)])


def reference(init, x, y, opt):
    ref = model_fn(0)
    ref.set_weights(init)
    ref.compile(optimizer=opt, loss="mse")
    ref.fit(x, y, batch_size=SIZE * B, epochs=1, shuffle=False, verbose=0)
    return ref.get_weights()


def same_on_all_ranks(arrays, what):
    gathered = hvd.allgather_object([np.asarray(a).tobytes() for a in arrays])
    for r, blobs in enumerate(gathered):
        assert blobs == gathered[0], "%s differ bitwise between rank 0 and rank %d" % (what, r)


def close(actual, expected, what):
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(np.float64(a), np.float64(e), rtol=RTOL, atol=ATOL, err_msg="%s %d" % (what, i))


def check_fit_matches_reference():
    x, y = data(1)
    for make_opt in (lambda: tf.keras.optimizers.SGD(LR), lambda: tf.keras.optimizers.legacy.SGD(LR)):
        model = model_fn(7)
        init = model.get_weights()
        opt = hvd.DistributedOptimizer(make_opt())
        assert type(opt).__module__ != "keras" and "tf_keras" in type(opt).__mro__[2].__module__, type(opt).__mro__
        model.compile(optimizer=opt, loss="mse")
        model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
        what = type(make_opt()).__module__
        same_on_all_ranks(model.get_weights(), what)
        close(model.get_weights(), reference(init, x, y, make_opt()), what)


def check_broadcast_callback():
    x, y = data(2)
    model = model_fn(100 + RANK)
    root_init = hvd.broadcast_object(model.get_weights(), root_rank=0)
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(LR, momentum=0.9)), loss="mse")
    model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    same_on_all_ranks(model.get_weights(), "weights")
    same_on_all_ranks([v.numpy() for v in model.optimizer.variables()], "optimizer state")
    close(model.get_weights(), reference(root_init, x, y, tf.keras.optimizers.legacy.SGD(LR, momentum=0.9)),
          "broadcast + fit vs reference")


def check_backward_passes_per_step():
    rng = np.random.default_rng(5)
    steps, passes = 4, 2
    x = rng.standard_normal((steps * SIZE * B, 5)).astype(np.float32)
    y = rng.standard_normal((steps * SIZE * B, 2)).astype(np.float32)
    w0 = rng.standard_normal((5, 2)).astype(np.float32)
    for make_opt in (lambda: tf.keras.optimizers.SGD(LR), lambda: tf.keras.optimizers.legacy.SGD(LR)):
        model = tf.keras.Sequential([tf.keras.layers.Dense(2, use_bias=False, input_shape=(5,))])
        model.set_weights([w0])
        opt = hvd.DistributedOptimizer(make_opt(), backward_passes_per_step=passes)
        model.compile(optimizer=opt, loss="mse")
        xr = np.concatenate([x[(s * SIZE + RANK) * B:(s * SIZE + RANK + 1) * B] for s in range(steps)])
        yr = np.concatenate([y[(s * SIZE + RANK) * B:(s * SIZE + RANK + 1) * B] for s in range(steps)])
        model.fit(xr, yr, batch_size=B, epochs=1, shuffle=False, verbose=0)
        w = w0.astype(np.float64)
        acc = [np.zeros_like(w) for _ in range(SIZE)]
        for s in range(steps):
            for r in range(SIZE):
                rows = slice((s * SIZE + r) * B, (s * SIZE + r + 1) * B)
                xb, yb = x[rows].astype(np.float64), y[rows].astype(np.float64)
                err = xb @ w - yb
                acc[r] += 2.0 * xb.T @ err / err.size
            if (s + 1) % passes == 0:
                w = w - LR * np.mean(acc, axis=0)
                acc = [np.zeros_like(w) for _ in range(SIZE)]
        assert int(opt.iterations.numpy()) == steps, int(opt.iterations.numpy())
        same_on_all_ranks(model.get_weights(), "bpps weights")
        close(model.get_weights(), [w], "backward_passes_per_step (%s)" % type(make_opt()).__module__)


def check_mixed_precision():
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = data(3)
        model = model_fn(11)
        opt = hvd.DistributedOptimizer(tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.SGD(LR)))
        model.compile(optimizer=opt, loss="mse")
        model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
        same_on_all_ranks(model.get_weights(), "mixed precision weights")
        before = model.get_weights()
        xb = rank_slice(x)[:B].copy()
        if RANK == SIZE - 1:
            xb[0, 0] = np.inf
        model.fit(xb, rank_slice(y)[:B], batch_size=B, epochs=1, shuffle=False, verbose=0)
        same_on_all_ranks(model.get_weights(), "weights after inf on one rank")
        for a, b in zip(model.get_weights(), before):
            assert np.array_equal(a, b), "the non-finite step must be skipped on every rank"
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")


def main(names):
    failed = 0
    for name in names:
        try:
            globals()["check_" + name]()
            print("[rank %d] ok %s" % (RANK, name), flush=True)
        except Exception:
            failed += 1
            print("[rank %d] FAIL %s:\n%s" % (RANK, name, traceback.format_exc()), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
