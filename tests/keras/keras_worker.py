"""Multi-rank checks of nvgroup_tf.keras (Keras 3). Run under mpirun by
test_keras.py: `keras_worker.py check1 check2 ...`. Each check raises
AssertionError on failure; the worker prints "[rank r] FAIL name: why" for
every failed check and exits 1 if any failed (so all checks run each launch).

Reference for training checks: one process (this one, no communication) fitting
the same model from the same initial weights with plain SGD on the
concatenation of all ranks' batches. With equal per-rank batch sizes the
average of per-rank mean-loss gradients is the gradient of the global mean loss,
so Average-reduced training must match it up to float rounding.
"""
import os
import sys
import traceback

import numpy as np
import tensorflow as tf
import keras

import nvgroup_tf.keras as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
B = 4           # per-rank batch
STEPS = 5
LR = 0.05
RTOL, ATOL = 2e-5, 1e-6


def dense_model(seed, dtype=None):
    keras.utils.set_random_seed(seed)
    kw = {} if dtype is None else {"dtype": dtype}
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh", **kw),
                             keras.layers.Dense(3, **kw)])


def global_data(seed=1234, steps=STEPS, n_in=6, n_out=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps * SIZE * B, n_in)).astype(np.float32)
    y = rng.standard_normal((steps * SIZE * B, n_out)).astype(np.float32)
    return x, y


def rank_slice(a, rank=RANK, steps=STEPS):
    """Rows of `rank` for each step of the global stream of SIZE*B rows per step."""
    return np.concatenate([a[(s * SIZE + rank) * B:(s * SIZE + rank + 1) * B] for s in range(steps)])


def reference_fit(init_weights, x, y, lr, model_fn=dense_model, loss="mse", epochs=1):
    ref = model_fn(0)
    ref.set_weights(init_weights)
    ref.compile(optimizer=keras.optimizers.SGD(lr), loss=loss)
    ref.fit(x, y, batch_size=SIZE * B, epochs=epochs, shuffle=False, verbose=0)
    return ref.get_weights()


def assert_same_on_all_ranks(arrays, what):
    gathered = hvd.allgather_object([np.asarray(a).tobytes() for a in arrays])
    for r, blobs in enumerate(gathered):
        assert blobs == gathered[0], "%s differ bitwise between rank 0 and rank %d" % (what, r)


def assert_close(actual, expected, what, rtol=RTOL, atol=ATOL):
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=rtol, atol=atol,
                                   err_msg="%s: weight %d" % (what, i))


# ---------------------------------------------------------------------------- checks


def check_fit_average_matches_single_process():
    x, y = global_data()
    for cap in (None, 0, 64):  # default buckets, one per gradient, tiny buckets
        model = dense_model(7)
        init = model.get_weights()
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), bucket_cap_bytes=cap)
        model.compile(optimizer=opt, loss="mse")  # default jit_compile="auto"
        # CPU-only machine: Keras resolves "auto" to off, as without nvgroup_tf.
        assert model.jit_compile is False, "jit_compile='auto' must resolve as Keras does on CPU"
        model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == STEPS
        assert_same_on_all_ranks(model.get_weights(), "weights (cap=%s)" % cap)
        assert_close(model.get_weights(), reference_fit(init, x, y, LR), "Average vs reference (cap=%s)" % cap)
        assert any(np.abs(a - b).max() > 1e-3 for a, b in zip(model.get_weights(), init)), "weights did not move"


def check_fit_sum_equals_scaled_lr():
    x, y = global_data(seed=99)
    model = dense_model(8)
    init = model.get_weights()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR), op=hvd.Sum), loss="mse",
                  jit_compile=True)  # explicitly asked: kept (the collectives have XLA lowerings)
    assert model.jit_compile is True
    model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_same_on_all_ranks(model.get_weights(), "weights (Sum)")
    # Sum of per-rank mean gradients = SIZE x the global mean gradient.
    assert_close(model.get_weights(), reference_fit(init, x, y, LR * SIZE), "Sum vs reference with lr*size")


def _linear_grads_np(w, xb, yb):
    """d/dw of mean((xb @ w - yb)^2) (mse over all elements), float64."""
    err = xb @ w - yb
    return 2.0 * xb.T @ err / err.size


def check_fp16_compression():
    x, y = global_data(seed=55)
    model = dense_model(14)
    init = model.get_weights()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR), compression=hvd.Compression.fp16),
                  loss="mse")
    model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_same_on_all_ranks(model.get_weights(), "weights (fp16 compression)")
    # Gradients travel as float16 (~3 significant digits): close, not equal, to the reference.
    assert_close(model.get_weights(), reference_fit(init, x, y, LR), "fp16 compression vs reference",
                 rtol=1e-3, atol=1e-4)
    plain = dense_model(14)
    plain.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    plain.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert any(not np.array_equal(a, b) for a, b in zip(model.get_weights(), plain.get_weights())), \
        "fp16 compression had no effect on the result"


def check_backward_passes_per_step():
    rng = np.random.default_rng(5)
    n_in, n_out, passes, steps = 5, 2, 2, 6
    x = rng.standard_normal((steps * SIZE * B, n_in)).astype(np.float32)
    y = rng.standard_normal((steps * SIZE * B, n_out)).astype(np.float32)
    w0 = rng.standard_normal((n_in, n_out)).astype(np.float32)
    for average_aggregated, use_fit in ((False, True), (True, False)):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((n_in,)), keras.layers.Dense(n_out, use_bias=False)])
        model.set_weights([w0])
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), backward_passes_per_step=passes,
                                       average_aggregated_gradients=average_aggregated)
        xr, yr = rank_slice(x, steps=steps), rank_slice(y, steps=steps)
        if use_fit:
            model.compile(optimizer=opt, loss="mse")
            model.fit(xr, yr, batch_size=B, epochs=1, shuffle=False, verbose=0)
        else:  # custom eager loop through apply_gradients
            for s in range(steps):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(model(xr[s * B:(s + 1) * B]) - yr[s * B:(s + 1) * B]))
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
        # Hand computation in float64.
        w = w0.astype(np.float64)
        acc = [np.zeros_like(w) for _ in range(SIZE)]
        for s in range(steps):
            for r in range(SIZE):
                rows = slice((s * SIZE + r) * B, (s * SIZE + r + 1) * B)
                acc[r] += _linear_grads_np(w, x[rows].astype(np.float64), y[rows].astype(np.float64))
            if (s + 1) % passes == 0:
                per_rank = [a / passes if average_aggregated else a for a in acc]
                w = w - LR * np.mean(per_rank, axis=0)
                acc = [np.zeros_like(w) for _ in range(SIZE)]
        what = "backward_passes_per_step=%d average_aggregated=%s" % (passes, average_aggregated)
        assert int(opt.iterations.numpy()) == steps, "%s: iterations %d" % (what, int(opt.iterations.numpy()))
        assert_same_on_all_ranks(model.get_weights(), what)
        assert_close(model.get_weights(), [w], what)


def check_broadcast_callback_equalizes_ranks():
    x, y = global_data(seed=77)
    model = dense_model(100 + RANK)  # different init on every rank
    root_init = hvd.broadcast_object(model.get_weights(), root_rank=0)
    if SIZE > 1:
        other = hvd.allgather_object(model.get_weights()[0].tobytes())
        assert other[0] != other[1], "test setup: ranks should start different"
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)), loss="mse")
    model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert_same_on_all_ranks(model.get_weights(), "weights after broadcast + fit")
    assert_same_on_all_ranks([v.numpy() for v in model.optimizer.variables], "optimizer state")
    ref = dense_model(0)
    ref.set_weights(root_init)
    ref.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.9), loss="mse")
    ref.fit(x, y, batch_size=SIZE * B, epochs=1, shuffle=False, verbose=0)
    assert_close(model.get_weights(), ref.get_weights(), "broadcast + fit vs reference from rank 0's init")


def check_broadcast_callback_keeps_per_rank_dropout_seeds():
    x, y = global_data(seed=78)
    keras.utils.set_random_seed(200 + RANK)  # different weights and seed states per rank
    model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(8),
                              keras.layers.Dropout(0.5), keras.layers.Dense(y.shape[1])])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert_same_on_all_ranks(model.get_weights(), "weights after broadcast + fit")
    seeds = [v.numpy() for v in model.variables if v.path.endswith("seed_generator_state")]
    assert seeds, "test setup: the model should have a dropout seed state"
    if SIZE > 1:
        gathered = hvd.allgather_object([s.tobytes() for s in seeds])
        assert len(set(g[0] for g in gathered)) == SIZE, "dropout seed states were made equal across ranks"


class _SetRankMetric(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        logs["rank_metric"] = 1.5 * RANK + epoch


def check_metric_average_callback():
    x, y = global_data(seed=11)
    model = dense_model(9)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse", metrics=["mae"])
    hist = model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=2, shuffle=False, verbose=0,
                     callbacks=[_SetRankMetric(), hvd.callbacks.MetricAverageCallback()])
    for epoch in range(2):
        expected = 1.5 * (SIZE - 1) / 2.0 + epoch
        got = hist.history["rank_metric"][epoch]
        assert abs(got - expected) < 1e-9, "rank_metric epoch %d: %r != %r" % (epoch, got, expected)
    assert_same_on_all_ranks([np.float64(hist.history["loss"][-1]), np.float64(hist.history["mae"][-1])],
                             "averaged loss/mae")


class _LrRecorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.lrs = []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(self.model.optimizer.learning_rate.numpy()))


def check_lr_warmup_and_schedule():
    x, y = global_data(seed=12, steps=3)
    lr0, warmup, spe = 0.4, 2, 3
    model = dense_model(10)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr0)), loss="mse")
    rec = _LrRecorder()
    hist = model.fit(rank_slice(x, steps=3), rank_slice(y, steps=3), batch_size=B, epochs=3, shuffle=False,
                     verbose=0, callbacks=[hvd.callbacks.LearningRateWarmupCallback(lr0, warmup_epochs=warmup,
                                                                                    verbose=0), rec])
    expected = []
    for epoch in range(3):
        for batch in range(spe):
            if epoch < warmup:
                e = epoch + (batch + 1) / spe
                expected.append(lr0 / SIZE * (e * (SIZE - 1) / warmup + 1))
            else:
                expected.append(expected[-1])
    np.testing.assert_allclose(rec.lrs, expected, rtol=1e-6, err_msg="warmup lr per batch")
    # End of each warmup epoch: exactly lr0 * (epoch+1 warmup fraction); after: lr0.
    np.testing.assert_allclose(hist.history["lr"], [lr0 / SIZE * (1 * (SIZE - 1) / warmup + 1), lr0, lr0],
                               rtol=1e-6, err_msg="warmup lr per epoch")
    # Staircase schedule: x0.5 per epoch from epoch 1 on.
    model2 = dense_model(10)
    model2.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr0)), loss="mse")
    rec2 = _LrRecorder()
    model2.fit(rank_slice(x, steps=3), rank_slice(y, steps=3), batch_size=B, epochs=3, shuffle=False, verbose=0,
               callbacks=[hvd.callbacks.LearningRateScheduleCallback(lr0, lambda e: 0.5 ** e, start_epoch=1), rec2])
    np.testing.assert_allclose(rec2.lrs, [lr0] * 3 + [lr0 * 0.5] * 3 + [lr0 * 0.25] * 3, rtol=1e-6,
                               err_msg="staircase schedule lr per batch")


def check_mixed_precision_loss_scale():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = global_data(seed=13)
        model = dense_model(11)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR))
        model.compile(optimizer=opt, loss="mse")
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer), type(model.optimizer)
        assert model.optimizer is opt, "compile must not wrap our optimizer in a second LossScaleOptimizer"
        model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
        assert_same_on_all_ranks(model.get_weights(), "mixed precision weights")
        before = model.get_weights()
        scale_before = float(opt.dynamic_scale.numpy())
        # Only the last rank sees an overflowing batch: every rank must skip the
        # step together (and halve its loss scale), not hang or diverge.
        xb = rank_slice(x)[:B].copy()
        if RANK == SIZE - 1:
            xb[0, 0] = np.inf  # non-finite activations and gradients on this rank only
        model.fit(xb, rank_slice(y)[:B], batch_size=B, epochs=1, shuffle=False, verbose=0)
        assert_same_on_all_ranks(model.get_weights(), "weights after a step with inf on one rank")
        for a, b in zip(model.get_weights(), before):
            assert np.array_equal(a, b), "the non-finite step must be skipped on every rank"
        scale_after = float(opt.dynamic_scale.numpy())
        assert scale_after == scale_before / 2, (scale_before, scale_after)
        # An explicit LossScaleOptimizer is distributed itself (reduce before its check).
        opt2 = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LR)))
        model2 = dense_model(11)
        model2.compile(optimizer=opt2, loss="mse")
        assert model2.optimizer is opt2
        model2.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
        assert_same_on_all_ranks(model2.get_weights(), "explicit LossScaleOptimizer weights")
    finally:
        keras.mixed_precision.set_global_policy("float32")


def embedding_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(40, 4),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])


def check_sparse_embedding_gradients():
    rng = np.random.default_rng(21)
    x = rng.integers(0, 40, size=(STEPS * SIZE * B, 5)).astype(np.int32)
    y = rng.standard_normal((STEPS * SIZE * B, 1)).astype(np.float32)
    probe = embedding_model(4)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(probe(x[:B]) - y[:B]))
    g = tape.gradient(loss, probe.trainable_variables)[0]
    assert isinstance(g, tf.IndexedSlices), "test setup: embedding gradient is %s" % type(g).__name__
    for sparse_as_dense in (False, True):
        model = embedding_model(4)
        init = model.get_weights()
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), sparse_as_dense=sparse_as_dense),
                      loss="mse")
        model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
        what = "embedding sparse_as_dense=%s" % sparse_as_dense
        assert_same_on_all_ranks(model.get_weights(), what)
        assert_close(model.get_weights(), reference_fit(init, x, y, 0.5, model_fn=embedding_model), what)


def check_distributed_gradient_tape():
    x, y = global_data(seed=31)
    model = dense_model(12)
    init = model.get_weights()
    opt = keras.optimizers.SGD(LR)
    xr, yr = rank_slice(x), rank_slice(y)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        tape = hvd.DistributedGradientTape(tape, bucket_cap_bytes=128)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for s in range(STEPS):
        step(xr[s * B:(s + 1) * B], yr[s * B:(s + 1) * B])
    assert_same_on_all_ranks(model.get_weights(), "DistributedGradientTape weights")
    assert_close(model.get_weights(), reference_fit(init, x, y, LR), "DistributedGradientTape vs reference")


def check_bad_input_errors():
    try:
        hvd.DistributedOptimizer(object())
        raise AssertionError("a non-optimizer must be rejected")
    except TypeError as e:
        assert "expects a Keras optimizer" in str(e), e
    for kwargs, needle in (({"backward_passes_per_step": 0}, "backward_passes_per_step"),
                           ({"bucket_cap_bytes": -1}, "bucket_cap_bytes"),
                           ({"num_groups": 2, "groups": [[]]}, "num_groups or groups")):
        try:
            hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **kwargs)
            raise AssertionError("%s must be rejected" % kwargs)
        except ValueError as e:
            assert needle in str(e), e


def check_bucket_cap_is_the_agreed_value():
    """Without bucket_cap_bytes the cap is NVGROUP_BUCKET_CAP_MB as the ranks
    agreed it at init: the environment changed afterwards (even to a value the
    settings table refuses) does not change it."""
    from nvgroup_tf import basics
    from nvgroup_tf.gradient_reducer import GradientReducer
    agreed = int(float(basics.agreed_setting_value("NVGROUP_BUCKET_CAP_MB")) * (1 << 20))
    launched = os.environ.get("NVGROUP_BUCKET_CAP_MB")
    assert agreed == int(float(launched or "25") * (1 << 20)), (agreed, launched)
    try:
        for later in ("lots", "2.5", "0"):
            os.environ["NVGROUP_BUCKET_CAP_MB"] = later
            assert GradientReducer().cap_bytes == agreed, later
            hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))  # builds: the environment is not read again
    finally:
        if launched is None:
            del os.environ["NVGROUP_BUCKET_CAP_MB"]
        else:
            os.environ["NVGROUP_BUCKET_CAP_MB"] = launched


def check_bucket_cap_argument_must_agree():
    """bucket_cap_bytes decides the buckets: ranks passing different values get
    a ValueError on every rank, naming each rank's value, at the first
    reduction; equal values reduce as usual."""
    from nvgroup_tf.gradient_reducer import GradientReducer, ReduceOptions
    rng = np.random.default_rng(7 + RANK)
    variables = [tf.Variable(np.zeros((5, 3), np.float32), name="v%d" % i) for i in range(3)]
    grads = [tf.constant(rng.standard_normal((5, 3)).astype(np.float32)) for _ in variables]
    mine = 64 + 16 * RANK
    try:
        GradientReducer(ReduceOptions(bucket_cap_bytes=mine), name_prefix="CapMismatch").reduce(grads, variables)
        raise AssertionError("different bucket_cap_bytes on the ranks must be refused")
    except ValueError as e:
        assert "different bucket_cap_bytes" in str(e), e
        assert str([64 + 16 * r for r in range(SIZE)]) in str(e), e
    reduced = GradientReducer(ReduceOptions(bucket_cap_bytes=64), name_prefix="CapAgreed").reduce(grads, variables)
    def rank_grads(r):
        g = np.random.default_rng(7 + r)
        return np.stack([g.standard_normal((5, 3)).astype(np.float32) for _ in variables])
    every = [rank_grads(r) for r in range(SIZE)]
    want = np.mean(np.stack(every).astype(np.float64), axis=0)
    for i, r in enumerate(reduced):
        np.testing.assert_allclose(r.numpy().astype(np.float64), want[i], rtol=1e-6, atol=1e-6)


def check_load_model_makes_optimizer_distributed():
    import tempfile
    x, y = global_data(seed=41)
    model = dense_model(13)
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    path = os.path.join(tempfile.mkdtemp(), "rank%d.keras" % RANK)
    model.save(path)
    loaded = hvd.load_model(path)
    init = loaded.get_weights()
    assert type(loaded.optimizer).__name__ == "DistributedSGD", type(loaded.optimizer)
    loaded.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_same_on_all_ranks(loaded.get_weights(), "weights after load_model + fit")
    assert_close(loaded.get_weights(), reference_fit(init, x, y, LR), "load_model + fit vs reference")


def main(names):
    failed = 0
    for name in names:
        fn = globals()["check_" + name]
        try:
            fn()
            print("[rank %d] ok %s" % (RANK, name), flush=True)
        except Exception:
            failed += 1
            print("[rank %d] FAIL %s:\n%s" % (RANK, name, traceback.format_exc()), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
