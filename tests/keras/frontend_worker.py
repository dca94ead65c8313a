"""Multi-rank checks of the Keras/TF front end (optimizer, tape, callbacks,
names, checkpoints). Run under mpirun by test_frontend.py:
`frontend_worker.py check1 check2 ...`; same protocol as keras_worker.py (each
check prints "[rank r] ok name" or "[rank r] FAIL name: why"; exit 1 if any
failed). Helpers (data, reference fit, bitwise cross-rank comparison) come from
keras_worker.py, which also initializes nvgroup_tf.
"""
import os
import sys
import tempfile
import traceback

import numpy as np
import tensorflow as tf
import keras

from keras_worker import (B, LR, RANK, SIZE, STEPS, assert_close, assert_same_on_all_ranks,  # noqa: F401
                          dense_model, global_data, rank_slice, reference_fit)
import nvgroup_tf as hvd_core
import nvgroup_tf.keras as hvd


def expect_error(fn, exc_types, needle):
    try:
        fn()
    except exc_types as e:
        assert needle in str(e), "error %r does not mention %r" % (str(e), needle)
        return e
    raise AssertionError("expected %s mentioning %r" % (exc_types, needle))


# ---------------------------------------------------------------- lazy builds


class SubclassedNet(keras.Model):
    def __init__(self):
        super().__init__()
        self.d1 = keras.layers.Dense(8, activation="tanh")
        self.d2 = keras.layers.Dense(3)

    def call(self, x):
        return self.d2(self.d1(x))


def check_broadcast_callback_lazily_built_models():
    x, y = global_data(seed=501)
    for kind in ("subclassed", "sequential_without_input"):
        keras.utils.set_random_seed(300 + RANK)   # different initial weights per rank
        if kind == "subclassed":
            model = SubclassedNet()
        else:
            model = keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
        assert not model.variables, "test setup: %s should not be built before fit" % kind
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
        cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
        model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
        assert getattr(cb, "broadcast_done", True)
        assert_same_on_all_ranks(model.get_weights(), "%s weights after broadcast + fit" % kind)
        assert_same_on_all_ranks([v.numpy() for v in model.optimizer.variables], "%s Adam state" % kind)
    # Nothing to broadcast: an error on every rank, not a silent success.
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.layers.Dense(3)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    model.build((None, 6))
    model.optimizer.build(model.trainable_variables)
    local = list(model.variables) + list(model.optimizer.variables)
    cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=local)
    expect_error(lambda: model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, verbose=0,
                                   callbacks=[cb]), RuntimeError, "nothing was broadcast")


# ---------------------------------------------------------------- names inside tf.function


def check_auto_names_survive_uneven_retrace():
    """An unnamed allgather in a tf.function retraced on rank 0 only (its last
    batch is smaller), then an unnamed allreduce in another function: with
    per-trace counters the names drift apart across ranks and the job hangs."""
    rng = np.random.default_rng(600)
    rows = [4, 3] if RANK == 0 else [4, 4]   # rank 0: uneven last batch -> second trace
    data = [rng.standard_normal((n, 2)) + RANK for n in rows]

    @tf.function
    def gather(x):
        return hvd_core.allgather(x)

    @tf.function
    def total(x):
        with tf.name_scope("scoped"):
            return hvd_core.allreduce(x, op=hvd_core.Sum) + hvd_core.allreduce(2.0 * x, op=hvd_core.Sum)

    for step, x in enumerate(data):
        got = gather(tf.constant(x)).numpy()
        per_rank = hvd.allgather_object(x)
        np.testing.assert_array_equal(got, np.concatenate(per_rank), err_msg="allgather step %d" % step)
    v = np.arange(5, dtype=np.float64) * (RANK + 1)
    got = total(tf.constant(v)).numpy()
    expected = 3.0 * np.arange(5, dtype=np.float64) * sum(r + 1 for r in range(SIZE))
    np.testing.assert_array_equal(got, expected)
    names = [op.get_attr("tensor_name").decode() for op in
             total.get_concrete_function(tf.constant(v)).graph.get_operations() if op.type == "NvgroupAllreduce"]
    assert sorted(names) == ["NvgroupAllreduce.graph:total/scoped/NvgroupAllreduce",
                             "NvgroupAllreduce.graph:total/scoped/NvgroupAllreduce_1"], names


# ---------------------------------------------------------------- stateful, independent ops


def check_collectives_not_pruned_folded_or_chained():
    from nvgroup_tf import basics
    # (a) The result is used on rank 0 only: the other ranks must still run it.
    @tf.function
    def average_used_on_rank0(x):
        avg = hvd_core.allreduce(x)
        return avg if RANK == 0 else x

    for step in range(2):
        v = np.full([3], float(RANK + 1 + step), np.float32)
        got = average_used_on_rank0(tf.constant(v)).numpy()
        if RANK == 0:
            np.testing.assert_array_equal(got, np.full([3], np.mean([r + 1 + step for r in range(SIZE)]),
                                                       np.float32))
    # (b) allreduce of a constant runs on every call (not folded into one
    # value at graph-optimisation time). The peers issue the same engine
    # name eagerly with a new value each time: a folded op would return the
    # first sum every time and leave the peers waiting.
    engine_name = "NvgroupAllreduce.graph:constant_sum/NvgroupAllreduce"

    @tf.function
    def constant_sum():
        return hvd_core.allreduce(tf.constant([5.0, 7.0]), op=hvd_core.Sum)

    for call in range(3):
        if RANK == 0:
            got = constant_sum().numpy()
        else:
            got = basics.op_module().nvgroup_allreduce(tf.constant([5.0, 7.0]) * (call + 2), reduce_op="sum",
                                                       tensor_name=engine_name).numpy()
        expected = np.array([5.0, 7.0]) * (1 + sum(call + 2 for _ in range(SIZE - 1)))
        np.testing.assert_array_equal(got, expected.astype(np.float32), err_msg="call %d" % call)
    # (c) Independent collectives get no automatic control edges (they would
    # serialise the gradient buckets), yet are control outputs (always run).
    var = tf.Variable(1.0)

    @tf.function
    def two_collectives(x):
        var.assign_add(1.0)
        a = hvd_core.allreduce(x, name="indep.a")
        var.assign_add(2.0)
        b = hvd_core.grouped_allreduce([x * 2.0, x * 3.0], name="indep.b")
        c = hvd_core.allgather(x)
        return a, b, c

    graph = two_collectives.get_concrete_function(tf.constant([1.0, 2.0])).graph
    collectives = [op for op in graph.get_operations() if op.type.startswith("Nvgroup")]
    assert len(collectives) == 3, [op.type for op in collectives]
    for op in collectives:
        assert op._is_stateful, "%s is not stateful" % op.type
        assert not op.control_inputs, "%s got control inputs %s" % (op.name, [c.name for c in op.control_inputs])
        assert op in graph.control_outputs, "%s is not a control output" % op.name
    a, b, c = two_collectives(tf.constant([1.0, 2.0]))
    np.testing.assert_array_equal(b[1].numpy(), np.array([3.0, 6.0], np.float32))
    assert float(var.numpy()) == 4.0


# ---------------------------------------------------------------- checkpoint / resume

CKPT_DIR = os.environ.get("NVG_CKPT_DIR", "")
CKPT_STEPS = 4


def _ckpt_data():
    x, y = global_data(seed=700, steps=2 * CKPT_STEPS)
    xr, yr = rank_slice(x, steps=2 * CKPT_STEPS), rank_slice(y, steps=2 * CKPT_STEPS)
    half = CKPT_STEPS * B
    return (xr[:half], yr[:half]), (xr[half:], yr[half:])


def check_checkpoint_save():
    """Launch 1: train 1 epoch, rank 0 checkpoints (ModelCheckpoint, .keras, and
    legacy .h5 as Horovod's examples write it),
    then train on uninterrupted; rank 0 records the checkpoint's optimizer
    state and the final weights."""
    (x1, y1), (x2, y2) = _ckpt_data()
    keras.utils.set_random_seed(800 + RANK)
    model = dense_model(800 + RANK)
    # A loss object, as Horovod's examples use: Keras 3 cannot rebuild a loss
    # given as a string from an .h5 file ("Could not deserialize
    # 'keras.metrics.mse'"), with or without nvgroup_tf.
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss=keras.losses.MeanSquaredError())
    path = os.path.join(CKPT_DIR, "model.keras")
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    if RANK == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint(path))
        callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(CKPT_DIR, "model.h5")))
    model.fit(x1, y1, batch_size=B, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    if RANK == 0:
        np.savez(os.path.join(CKPT_DIR, "optimizer_at_checkpoint.npz"),
                 *[v.numpy() for v in model.optimizer.variables])
    model.fit(x2, y2, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_same_on_all_ranks(model.get_weights(), "uninterrupted weights")
    if RANK == 0:
        np.savez(os.path.join(CKPT_DIR, "uninterrupted.npz"), *model.get_weights())
    hvd_core.allgather_object(0)  # rank 0's files exist before any rank returns


def check_checkpoint_resume():
    """Launch 2 (new processes): every rank loads rank 0's checkpoint with
    hvd.load_model, continues, and must equal the uninterrupted run."""
    _, (x2, y2) = _ckpt_data()
    path = os.path.join(CKPT_DIR, "model.keras")
    model = hvd.load_model(path)
    from nvgroup_tf.keras.optimizer import is_distributed
    assert is_distributed(model.optimizer), type(model.optimizer)
    assert int(model.optimizer.iterations.numpy()) == CKPT_STEPS, int(model.optimizer.iterations.numpy())
    saved = np.load(os.path.join(CKPT_DIR, "optimizer_at_checkpoint.npz"))
    saved = [saved["arr_%d" % i] for i in range(len(saved.files))]
    loaded = [v.numpy() for v in model.optimizer.variables]
    assert len(saved) == len(loaded) and len(saved) > 2, (len(saved), len(loaded))
    for i, (a, b) in enumerate(zip(loaded, saved)):
        np.testing.assert_array_equal(a, b, err_msg="optimizer variable %d (iterations, moments)" % i)
    model.fit(x2, y2, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_same_on_all_ranks(model.get_weights(), "resumed weights")
    ref = np.load(os.path.join(CKPT_DIR, "uninterrupted.npz"))
    ref = [ref["arr_%d" % i] for i in range(len(ref.files))]
    assert_close(model.get_weights(), ref, "resumed vs uninterrupted", rtol=1e-6, atol=1e-7)
    # The legacy .h5 checkpoint: Keras 3's own .h5 loader leaves the optimizer
    # built on no variables (the first step fails, "Unknown variable");
    # hvd.load_model restores it on the model's variables with the saved state.
    h5 = hvd.load_model(os.path.join(CKPT_DIR, "model.h5"))
    assert is_distributed(h5.optimizer), type(h5.optimizer)
    loaded = [v.numpy() for v in h5.optimizer.variables]
    assert len(saved) == len(loaded), (len(saved), len(loaded))
    for i, (a, b) in enumerate(zip(loaded, saved)):
        np.testing.assert_array_equal(a, b, err_msg=".h5: optimizer variable %d (iterations, moments)" % i)
    h5.fit(x2, y2, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_same_on_all_ranks(h5.get_weights(), ".h5 resumed weights")
    assert_close(h5.get_weights(), ref, ".h5 resumed vs uninterrupted", rtol=1e-6, atol=1e-7)
    # Plain Keras loads the same file too, as Horovod's: the optimizer comes back
    # plain (the file names keras.optimizers' class), with the saved state.
    plain = keras.models.load_model(path)
    assert not is_distributed(plain.optimizer), type(plain.optimizer)
    assert type(plain.optimizer) is type(keras.optimizers.get(type(plain.optimizer).__name__.lower())), \
        type(plain.optimizer)
    assert int(plain.optimizer.iterations.numpy()) == CKPT_STEPS
    for i, (a, b) in enumerate(zip([v.numpy() for v in plain.optimizer.variables], saved)):
        np.testing.assert_array_equal(a, b, err_msg="keras.models.load_model: optimizer variable %d" % i)
    # A plainly compiled model saved and loaded with hvd.load_model: distributed, state kept.
    m = dense_model(801)
    m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    m.fit(x2[:B], y2[:B], batch_size=B, epochs=1, verbose=0)
    plain_path = os.path.join(tempfile.mkdtemp(), "plain%d.keras" % RANK)
    m.save(plain_path)
    m2 = hvd.load_model(plain_path, compression=hvd.Compression.none)
    assert is_distributed(m2.optimizer) and int(m2.optimizer.iterations.numpy()) == 1
    for a, b in zip(m2.optimizer.variables, m.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# ---------------------------------------------------------------- unique names per reduction


def _local_grads(fn, variables, x):
    with tf.GradientTape() as t:
        loss = fn(x)
    return [g.numpy().astype(np.float64) for g in t.gradient(loss, variables)]


def check_unique_names_per_tape_and_reduction():
    rng = np.random.default_rng(900 + RANK)
    w = tf.Variable(np.random.default_rng(901).standard_normal((4, 3)).astype(np.float32))
    b = tf.Variable(np.random.default_rng(902).standard_normal((3,)).astype(np.float32))
    variables = [w, b]
    x = tf.constant(rng.standard_normal((5, 4)).astype(np.float32))
    f1 = lambda x: tf.reduce_sum(tf.tanh(x @ w + b))        # noqa: E731
    f2 = lambda x: tf.reduce_sum(tf.square(x @ w - b))      # noqa: E731
    f3 = lambda x: tf.reduce_mean(tf.sin(x @ w) * b)        # noqa: E731

    @tf.function
    def step(x):
        with tf.GradientTape(persistent=True) as tape:
            l1, l2 = f1(x), f2(x)
        tape = hvd.DistributedGradientTape(tape)
        g1 = tape.gradient(l1, variables)   # the persistent tape asked twice
        g2 = tape.gradient(l2, variables)
        with tf.GradientTape() as tape3:
            l3 = f3(x)
        g3 = hvd.DistributedGradientTape(tape3, op=hvd.Sum).gradient(l3, variables)  # a second tape
        return g1, g2, g3

    g1, g2, g3 = step(x)
    for fn, got, reduce in ((f1, g1, np.mean), (f2, g2, np.mean), (f3, g3, np.sum)):
        per_rank = hvd.allgather_object(_local_grads(fn, variables, x))
        for i, g in enumerate(got):
            np.testing.assert_allclose(g.numpy(), reduce([p[i] for p in per_rank], axis=0), rtol=1e-5, atol=1e-6)
    # Two optimizers over the same variables in one function.
    opt_a = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    opt_b = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01))
    v = keras.Variable(np.zeros((6,), np.float32))
    ga = rng.standard_normal((6,)).astype(np.float32)
    gb = rng.standard_normal((6,)).astype(np.float32)

    @tf.function
    def two_optimizers(ga, gb):
        opt_a.apply([ga], [v])
        opt_b.apply([gb], [v])

    two_optimizers(tf.constant(ga), tf.constant(gb))
    all_a, all_b = zip(*hvd.allgather_object((ga.astype(np.float64), gb.astype(np.float64))))
    expected = -0.1 * np.mean(all_a, axis=0) - 0.01 * np.mean(all_b, axis=0)
    np.testing.assert_allclose(v.numpy(), expected, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- eager loops traced


def check_eager_tape_runs_buckets_traced():
    from nvgroup_tf import mpi_ops
    calls = []
    original = mpi_ops._grouped_allreduce

    def recording(*args, **kwargs):
        calls.append(tf.executing_eagerly())
        return original(*args, **kwargs)

    x, y = global_data(seed=950)
    model = dense_model(95)
    init = model.get_weights()
    opt = keras.optimizers.SGD(LR)
    xr, yr = rank_slice(x), rank_slice(y)
    mpi_ops._grouped_allreduce = recording
    try:
        for s in range(STEPS):   # eager: no tf.function anywhere in this loop
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xr[s * B:(s + 1) * B]) - yr[s * B:(s + 1) * B]))
            tape = hvd.DistributedGradientTape(tape, bucket_cap_bytes=64)   # several buckets
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
    finally:
        mpi_ops._grouped_allreduce = original
    assert calls and not any(calls), "buckets ran as eager ops (%d of %d calls eager)" % (sum(calls), len(calls))
    assert len(calls) >= 2, "test setup: expected several buckets, got %d" % len(calls)
    assert_same_on_all_ranks(model.get_weights(), "eager DistributedGradientTape weights")
    assert_close(model.get_weights(), reference_fit(init, x, y, LR), "eager DistributedGradientTape vs reference")
    # The eager DistributedOptimizer path too.
    model = dense_model(96)
    init = model.get_weights()
    dopt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), bucket_cap_bytes=64)
    for s in range(STEPS):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xr[s * B:(s + 1) * B]) - yr[s * B:(s + 1) * B]))
        dopt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    traced = list(dopt._nvg_sync.reducer._traced.values())
    assert len(traced) == 1 and traced[0].experimental_get_tracing_count() == 1, \
        "the eager reduction should be traced once and reused"
    assert_close(model.get_weights(), reference_fit(init, x, y, LR), "eager DistributedOptimizer vs reference")


# ---------------------------------------------------------------- per-model mixed precision


class MixedNet(keras.Model):
    def __init__(self):
        super().__init__(dtype="mixed_float16")
        self.d1 = keras.layers.Dense(8, activation="tanh", dtype="mixed_float16")
        self.d2 = keras.layers.Dense(3, dtype="mixed_float16")

    def call(self, x):
        return self.d2(self.d1(x))


def check_per_model_mixed_precision():
    x, y = global_data(seed=970)
    keras.utils.set_random_seed(97)
    model = MixedNet()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR))
    model.compile(optimizer=opt, loss="mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer), type(model.optimizer)
    model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert_same_on_all_ranks(model.get_weights(), "per-model mixed precision weights")
    before = model.get_weights()
    scale_before = float(model.optimizer.dynamic_scale.numpy())
    xb = rank_slice(x)[:B].copy()
    if RANK == SIZE - 1:
        xb[0, 0] = np.inf   # non-finite gradients on one rank only: all ranks must skip
    model.fit(xb, rank_slice(y)[:B], batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_same_on_all_ranks(model.get_weights(), "weights after a step with inf on one rank")
    for a, b in zip(model.get_weights(), before):
        assert np.array_equal(a, b), "the non-finite step must be skipped on every rank"
    assert float(model.optimizer.dynamic_scale.numpy()) == scale_before / 2
    assert getattr(model.optimizer, "_nvg_is_distributed", False), "the LossScaleOptimizer must reduce first"


# ---------------------------------------------------------------- Horovod arguments


def check_horovod_arguments():
    # gradient_predivide_factor: same average as without.
    x, y = global_data(seed=980)
    model = dense_model(98)
    init = model.get_weights()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR), gradient_predivide_factor=2.0,
                                                     process_set=None), loss="mse")
    model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_same_on_all_ranks(model.get_weights(), "gradient_predivide_factor weights")
    assert_close(model.get_weights(), reference_fit(init, x, y, LR), "gradient_predivide_factor=2 vs reference")
    expect_error(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Sum,
                                                  gradient_predivide_factor=2.0),
                 ValueError, "gradient_predivide_factor not supported with op != Average")
    for op in (hvd.Min, hvd.Max, hvd.Product):
        expect_error(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=op), ValueError,
                     "only supports Average and Sum")
        expect_error(lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=op), ValueError,
                     "only supports Average and Sum")
    expect_error(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd_core.Adasum),
                 NotImplementedError, "Adasum")

    class GlobalSet:
        process_set_id = 0

    class OtherSet:
        process_set_id = 1

    hvd.DistributedGradientTape(tf.GradientTape(), process_set=GlobalSet())
    hvd.DistributedGradientTape(tf.GradientTape(), process_set=hvd_core.global_process_set)
    expect_error(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=OtherSet()),
                 TypeError, "ProcessSet")
    # Horovod's keras allreduce(value, name=None, average=None, ...).
    v = np.arange(4, dtype=np.float32) * (RANK + 1)
    total = np.arange(4, dtype=np.float32) * sum(r + 1 for r in range(SIZE))
    np.testing.assert_allclose(hvd.allreduce(v, "keras_value", False).numpy(), total)
    np.testing.assert_allclose(hvd.allreduce(v, name="keras_value2", average=True).numpy(), total / SIZE)
    np.testing.assert_allclose(hvd.allreduce(v).numpy(), total / SIZE)
    np.testing.assert_allclose(hvd.allreduce(v, op=hvd.Sum).numpy(), total)
    gathered = hvd.allgather(np.full((RANK + 1, 2), RANK, np.int32)).numpy()
    np.testing.assert_array_equal(gathered, np.concatenate([np.full((r + 1, 2), r, np.int32) for r in range(SIZE)]))
    np.testing.assert_array_equal(hvd.broadcast(np.float32(RANK + 5), 1 % SIZE).numpy(), np.float32(1 % SIZE + 5))
    # ignore_name_scope is accepted by the collectives.
    with tf.name_scope("outer"):
        r = hvd_core.allreduce(tf.constant(v), name="ins", op=hvd.Sum, ignore_name_scope=True)
    np.testing.assert_allclose(r.numpy(), total)


def check_horovod_example_script():
    """What Horovod's own Keras examples do, unchanged but for the import:
    hvd.sycl_built() to pick the device kind, fp16 compression, and
    model.compile(..., experimental_run_tf_function=False), which Keras 3
    rejects by itself. Trains the same weights on every rank, the single-process
    result up to the fp16 rounding of the gradients."""
    assert hvd.sycl_built() is False and hvd_core.sycl_built() is False
    x, y = global_data(seed=990)
    model = dense_model(99)
    init = model.get_weights()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), compression=hvd.Compression.fp16)
    model.compile(loss="mse", optimizer=opt, experimental_run_tf_function=False)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=callbacks)
    assert_same_on_all_ranks(model.get_weights(), "Horovod example weights")
    assert_close(model.get_weights(), reference_fit(init, x, y, LR), "Horovod example vs reference",
                 rtol=2e-3, atol=2e-4)
    # Only the obsolete argument is dropped: an unknown one still fails as Keras says.
    expect_error(lambda: dense_model(100).compile(loss="mse", optimizer="sgd", not_an_argument=1),
                 TypeError, "not_an_argument")


def check_horovod_tf2_example_script():
    """Horovod's TF2 examples (tensorflow2_mnist.py), unchanged but for the
    import: a tf.function step with DistributedGradientTape and the plain
    optimizer's apply_gradients, then, after the first step,
    broadcast_variables(model.variables) and broadcast_variables(opt.variables())
    -- a call, which Keras 3's list-valued `variables` property refuses by
    itself -- and, as the elastic examples' reset callbacks, opt.lr. Ranks start from different weights (the first step averages
    gradients taken at different points, as in Horovod); from the broadcast on
    they share rank 0's weights: bitwise equal at the end, and the
    single-process result of the remaining steps from the weights after the
    first."""
    x, y = global_data(seed=1010)
    model = dense_model(1010 + RANK)
    opt = keras.optimizers.SGD(LR)
    xr, yr = rank_slice(x), rank_slice(y)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss_value = tf.reduce_mean(tf.square(model(images, training=True) - labels))
        tape = hvd_core.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd_core.broadcast_variables(model.variables, root_rank=0)
            hvd_core.broadcast_variables(opt.variables(), root_rank=0)
        return loss_value

    after_first = None
    for step in range(STEPS):
        training_step(xr[step * B:(step + 1) * B], yr[step * B:(step + 1) * B], step == 0)
        if step == 0:
            after_first = model.get_weights()
            assert_same_on_all_ranks(after_first, "TF2 example weights after the first step's broadcast")
    assert int(opt.iterations.numpy()) == STEPS, int(opt.iterations.numpy())
    assert isinstance(opt.variables, list) and opt.variables() == list(opt.variables)
    assert_same_on_all_ranks(model.get_weights(), "TF2 example weights")
    rest = SIZE * B  # the global batch of step 0 is done
    assert_close(model.get_weights(), reference_fit(after_first, x[rest:], y[rest:], LR), "TF2 example vs reference")
    # opt.lr, as the elastic examples' reset callbacks use it (Keras 3 has only learning_rate).
    opt.lr.assign(0.5 * LR)
    assert np.float32(opt.learning_rate.numpy()) == np.float32(0.5 * LR), opt.learning_rate.numpy()
    tf.keras.backend.set_value(opt.lr, 0.25 * LR)
    assert np.float32(opt.learning_rate.numpy()) == np.float32(0.25 * LR), opt.learning_rate.numpy()
    opt.lr = 2 * LR
    assert np.float32(opt.lr.numpy()) == np.float32(2 * LR), opt.lr.numpy()


def check_horovod_collective_gradients():
    """Horovod's gradients of allgather and broadcast: averaged over ranks."""
    rows = RANK + 1
    x = tf.constant(np.random.default_rng(990 + RANK).standard_normal((rows, 3)))
    weight = np.random.default_rng(991 + RANK).standard_normal((sum(r + 1 for r in range(SIZE)), 3))
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(hvd_core.allgather(x, name="grad_check.gather") * weight)
    got = tape.gradient(loss, x).numpy()
    weights = hvd.allgather_object(weight)
    start = sum(r + 1 for r in range(RANK))
    np.testing.assert_allclose(got, np.mean(weights, axis=0)[start:start + rows], rtol=1e-12)
    w2 = np.random.default_rng(992 + RANK).standard_normal((3,))
    y = tf.constant(np.random.default_rng(993 + RANK).standard_normal((3,)))
    with tf.GradientTape() as tape:
        tape.watch(y)
        loss = tf.reduce_sum(hvd_core.broadcast(y, 0, name="grad_check.bcast") * w2)
    got = tape.gradient(loss, y).numpy()
    all_w2 = hvd.allgather_object(w2)
    np.testing.assert_allclose(got, np.mean(all_w2, axis=0) if RANK == 0 else np.zeros(3), rtol=1e-12)


def check_local_variables_and_compute_gradients():
    rng = np.random.default_rng(1000 + RANK)
    w = tf.Variable(np.random.default_rng(1001).standard_normal((4, 2)))
    local = tf.Variable(np.random.default_rng(1002 + RANK).standard_normal((2,)))
    x = tf.constant(rng.standard_normal((3, 4)))
    fn = lambda: tf.reduce_sum(tf.tanh(x @ w) * local)   # noqa: E731
    per_rank = hvd.allgather_object(_local_grads(lambda _: fn(), [w, local], None))
    for scale in (True, False):
        with tf.GradientTape() as tape:
            loss = fn()
        tape = hvd.DistributedGradientTape(tape, scale_local_gradients=scale)
        tape.register_local_source(local)
        gw, gl = tape.gradient(loss, [w, local])
        np.testing.assert_allclose(gw.numpy(), np.mean([p[0] for p in per_rank], axis=0), rtol=1e-12)
        np.testing.assert_allclose(gl.numpy(), per_rank[RANK][1] / (SIZE if scale else 1), rtol=1e-12)
    # Horovod's optimizer._compute_gradients / compute_gradients: reduced once,
    # and apply_gradients of what they returned does not reduce again (op=Sum shows it).
    v = keras.Variable(np.random.default_rng(1003).standard_normal((4,)))
    xv = tf.constant(rng.standard_normal((4,)))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), op=hvd.Sum)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * xv)
    grads_and_vars = opt._compute_gradients(loss, [v], tape=tape)
    all_x = hvd.allgather_object(xv.numpy())
    np.testing.assert_allclose(grads_and_vars[0][0].numpy(), np.sum(all_x, axis=0), rtol=1e-12)
    v0 = v.numpy().copy()
    opt.apply_gradients(grads_and_vars)
    np.testing.assert_allclose(v.numpy(), v0 - 0.5 * np.sum(all_x, axis=0), rtol=1e-12)
    gv = opt.compute_gradients(lambda: tf.reduce_sum(v * xv * 2.0), [v])
    np.testing.assert_allclose(gv[0][0].numpy(), 2.0 * np.sum(all_x, axis=0), rtol=1e-12)
    # PartialDistributedOptimizer(local_layers) + BroadcastGlobalVariablesCallback(local_variables).
    xd, yd = global_data(seed=1004)
    keras.utils.set_random_seed(1005 + RANK)   # different init per rank
    inp = keras.Input((6,))
    shared_layer, local_layer = keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)
    model = keras.Model(inp, local_layer(shared_layer(inp)))
    popt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(LR), local_layers=[local_layer])
    model.compile(optimizer=popt, loss="mse")
    model.fit(rank_slice(xd), rank_slice(yd), batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=local_layer.weights)])
    assert_same_on_all_ranks([v.numpy() for v in shared_layer.weights], "shared layer")
    if SIZE > 1:
        kernels = hvd.allgather_object(local_layer.kernel.numpy().tobytes())
        assert len(set(kernels)) == SIZE, "local layer weights must stay per rank"
    expect_error(lambda: hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[object()]),
                 ValueError, "local layers")


# ---------------------------------------------------------------- Horovod behaviours users rely on


def check_repeated_init_process_sets():
    """Horovod: init(process_sets=[...]) again maps its sets onto the registered
    ones (no error; a new object of the same ranks takes the id); a set of new
    ranks is an error; hvd.mpi_ops._basics answers as Horovod's (its
    process-set tests call it); a hand-set unregistered id is a ValueError."""
    first = hvd_core.add_process_set([0])
    again = hvd_core.ProcessSet([0])
    hvd_core.init(process_sets=[again, first])
    assert again.process_set_id == first.process_set_id is not None, (again, first)
    basics = hvd_core.mpi_ops._basics
    assert basics._get_process_set_ids_and_ranks() == {0: list(range(SIZE)), first.process_set_id: [0]}
    assert basics._process_set_size(again.process_set_id) == 1
    if RANK == 0:
        assert basics._process_set_rank(again.process_set_id) == 0
        got = hvd_core.allreduce(tf.constant([3.0]), op=hvd_core.Sum, name="reinit.member", process_set=again)
        assert got.numpy().tolist() == [3.0], got
    else:
        expect_error(lambda: basics._process_set_rank(again.process_set_id), ValueError, "not part of")
    expect_error(lambda: hvd_core.init(process_sets=[hvd_core.ProcessSet([1])]), ValueError, "is not registered")
    expect_error(lambda: hvd_core.add_process_set([0]), ValueError, "already registered")
    expect_error(lambda: hvd_core.add_process_set(range(SIZE)), ValueError, "global process set")
    old_id = again.process_set_id
    assert hvd_core.remove_process_set(again)
    assert first.process_set_id is None and again.process_set_id is None, (first, again)
    assert basics._get_process_set_ids_and_ranks() == {0: list(range(SIZE))}
    fake = hvd_core.ProcessSet([0])
    fake.process_set_id = old_id  # Horovod's test does this: an id nothing registers
    expect_error(lambda: hvd_core.allreduce(tf.ones(2), process_set=fake), ValueError, "is not registered")
    assert str(hvd_core.global_process_set) == "ProcessSet(process_set_id=0, ranks=%s, mpi_comm=None)" % (
        list(range(SIZE)),)


def _v1_reference(x, w0, l0):
    """float64 gradients of sum(tanh(x @ w) * l) at (w0, l0)."""
    t = np.tanh(x @ w0)
    return x.T @ ((1.0 - t ** 2) * l0), t.sum(axis=0)


def check_tf1_optimizer_reduces():
    """hvd.DistributedOptimizer around a tf.compat.v1.train optimizer, TF1 graph
    code (minimize in a Session): the shared variable moves by the average of
    the ranks' gradients, a local one (registered by its ref()) by its own
    gradient / size (scale_local_gradients), against a float64 reference."""
    rng = np.random.default_rng(1100 + RANK)
    x = rng.standard_normal((5, 3))
    w0 = np.random.default_rng(1101).standard_normal((3, 2))
    l0 = np.random.default_rng(1102 + RANK).standard_normal((2,))
    with tf.Graph().as_default():
        w = tf.compat.v1.Variable(w0)
        local = tf.compat.v1.Variable(l0)
        loss = tf.reduce_sum(tf.tanh(tf.constant(x) @ w) * local)
        opt = hvd_core.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5))
        opt.register_local_var(local.ref())
        assert local.ref() in opt._local_vars and w.ref() not in opt._local_vars
        train = opt.minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train)
            w1, l1 = sess.run([w, local])
    per_rank = hvd.allgather_object(_v1_reference(x, w0, l0))
    np.testing.assert_allclose(w1, w0 - 0.5 * np.mean([g[0] for g in per_rank], axis=0), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(l1, l0 - 0.5 * per_rank[RANK][1] / SIZE, rtol=1e-12, atol=1e-14)
    assert_same_on_all_ranks([w1], "TF1 shared variable")


def check_local_variable_refs():
    """Keras 3 variables' v.ref() (the held tf.Variable's reference) names a
    local variable to DistributedGradientTape and DistributedOptimizer, as
    Horovod's sets of refs do; hvd.vars_to_refs' references do as well."""
    rng = np.random.default_rng(1200 + RANK)
    w = keras.Variable(np.random.default_rng(1201).standard_normal((4, 2)))
    local = keras.Variable(np.random.default_rng(1202 + RANK).standard_normal((2,)))
    x = tf.constant(rng.standard_normal((3, 4)))
    fn = lambda: tf.reduce_sum(tf.tanh(x @ w) * local)   # noqa: E731
    own = _local_grads(lambda _: fn(), [w, local], None)
    per_rank = hvd.allgather_object(own)
    mean_w = np.mean([p[0] for p in per_rank], axis=0)
    with tf.GradientTape() as tape:
        loss = fn()
    tape = hvd.DistributedGradientTape(tape)
    tape.register_local_source(local.ref())
    assert local.ref() in tape._local_sources and w.ref() not in tape._local_sources
    gw, gl = tape.gradient(loss, [w, local])
    np.testing.assert_allclose(gw.numpy(), mean_w, rtol=1e-12)
    np.testing.assert_allclose(gl.numpy(), own[1] / SIZE, rtol=1e-12)
    for register in (lambda o: o.register_local_var(local.ref()),
                     lambda o: o.register_local_var(hvd_core.vars_to_refs(local))):
        w0, l0 = w.numpy().copy(), local.numpy().copy()
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5))
        register(opt)
        assert local.ref() in opt._local_vars and w.ref() not in opt._local_vars
        opt.apply([tf.constant(own[0]), tf.constant(own[1])], [w, local])
        np.testing.assert_allclose(w.numpy(), w0 - 0.5 * mean_w, rtol=1e-12)
        np.testing.assert_allclose(local.numpy(), l0 - 0.5 * own[1] / SIZE, rtol=1e-12)


# ---------------------------------------------------------------------------- main


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
