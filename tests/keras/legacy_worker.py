"""Multi-rank checks of nvgroup_tf.keras with tf_keras (TF_USE_LEGACY_KERAS=1).
Same protocol as keras_worker.py: "[rank r] ok name" or "[rank r] FAIL name".
"""
import os
import sys
import traceback

assert os.environ.get("TF_USE_LEGACY_KERAS") == "1", "run with TF_USE_LEGACY_KERAS=1"

import numpy as np  # noqa: E402 (after the TF_USE_LEGACY_KERAS check)
import tensorflow as tf  # noqa: E402 (after the TF_USE_LEGACY_KERAS check)
import tf_keras  # noqa: E402 (after the TF_USE_LEGACY_KERAS check)

import nvgroup_tf.keras as hvd  # noqa: E402 (after the TF_USE_LEGACY_KERAS check)
import shared_checks  # noqa: E402  (tests/keras: the checks the Keras 3 worker runs too)

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


# Horovod's tf_keras optimizer API: _compute_gradients / compute_gradients,
# _agg_helper, and the tape's get_local_and_global_gradients. A linear layer
# with an MSE loss, so the float64 reference gradients are closed-form.
N_IN, N_OUT = 5, 3


def linear_grads64(w, b, x, y):
    """float64 gradients of mean((x @ w + b - y)**2) for w and b."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    err = x @ w + b - y
    return [2.0 * x.T @ err / err.size, 2.0 * err.sum(axis=0) / err.size]


def rank_batches(seed, passes):
    """batches[p][r] = (x, y) of pass p on rank r: every rank knows all of them."""
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal((B, N_IN)).astype(np.float32), rng.standard_normal((B, N_OUT)).astype(np.float32))
             for _ in range(SIZE)] for _ in range(passes)]


def check_close64(actual, expected, what):
    """Every element within float32 rounding of the float64 reference, and identical on all ranks."""
    for i, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(np.float64(a), e, rtol=RTOL, atol=ATOL, err_msg="%s %d" % (what, i))


def check_compute_gradients_matches_reference():
    batches = rank_batches(21, 1)[0]
    rng = np.random.default_rng(22)
    w0, b0 = rng.standard_normal((N_IN, N_OUT)), rng.standard_normal(N_OUT)
    per_rank = [linear_grads64(w0, b0, x, y) for x, y in batches]
    mean = [np.mean([g[i] for g in per_rank], axis=0) for i in range(2)]
    total = [np.sum([g[i] for g in per_rank], axis=0) for i in range(2)]
    x, y = batches[RANK]
    makers = [lambda: tf.keras.optimizers.legacy.SGD(LR), lambda: tf.keras.optimizers.SGD(LR)]
    for make_opt in makers:
        for local in (False, True):
            for op in (hvd.Average, hvd.Sum):
                kind = "%s local=%s op=%s" % (type(make_opt()).__module__, local, op)
                w = tf.Variable(w0.astype(np.float32))
                b = tf.Variable(b0.astype(np.float32))
                opt = hvd.DistributedOptimizer(make_opt(), op=op)
                assert opt._agg_helper is None, kind
                if local:
                    opt.register_local_var(b)

                def loss():
                    return tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
                if op == hvd.Average:   # tensor loss recorded on a tape
                    with tf.GradientTape() as tape:
                        value = loss()
                    grads_and_vars = opt._compute_gradients(value, [w, b], tape=tape)
                else:                   # callable loss, the public spelling
                    grads_and_vars = opt.compute_gradients(loss, [w, b])
                assert [v for _, v in grads_and_vars] == [w, b], kind
                grads = [g.numpy() for g, _ in grads_and_vars]
                expected = list(mean if op == hvd.Average else total)
                if local:   # Horovod: this rank's own gradient, divided by size()
                    expected[1] = per_rank[RANK][1] / SIZE
                check_close64(grads, expected, "compute_gradients " + kind)
                if not local:
                    same_on_all_ranks(grads, "compute_gradients " + kind)
                # apply_gradients of exactly these gradients must not reduce them again
                # (with op=Sum a second reduction would multiply them by size()).
                opt.apply_gradients(grads_and_vars)
                check_close64([w.numpy(), b.numpy()],
                              [w0 - LR * expected[0], b0 - LR * expected[1]], "apply after compute " + kind)


def check_compute_gradients_aggregation():
    passes, n = 7, 3
    batches = rank_batches(31, passes)
    rng = np.random.default_rng(32)
    w_init, b_init = rng.standard_normal((N_IN, N_OUT)), rng.standard_normal(N_OUT)
    for average in (False, True):
        for local in (False, True):
            kind = "average=%s local=%s" % (average, local)
            w = tf.Variable(w_init.astype(np.float32))
            b = tf.Variable(b_init.astype(np.float32))
            opt = hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(LR), backward_passes_per_step=n,
                                           average_aggregated_gradients=average)
            if local:
                opt.register_local_var(b)
            xs = tf.Variable(np.zeros((B, N_IN), np.float32), trainable=False)
            ys = tf.Variable(np.zeros((B, N_OUT), np.float32), trainable=False)

            @tf.function
            def train_pass():
                grads_and_vars = opt._compute_gradients(
                    lambda: tf.reduce_mean(tf.square(tf.matmul(xs, w) + b - ys)), var_list=[w, b])
                opt.apply_gradients(grads_and_vars)
                return [g for g, _ in grads_and_vars]

            # b64[r]: rank r's bias (a local variable differs between ranks)
            w64, b64 = w_init.copy(), [b_init.copy() for _ in range(SIZE)]
            sums = [[np.zeros_like(w64), np.zeros_like(b_init)] for _ in range(SIZE)]
            for p in range(passes):
                for r in range(SIZE):
                    g = linear_grads64(w64, b64[r], *batches[p][r])
                    sums[r] = [sums[r][0] + g[0], sums[r][1] + g[1]]
                xs.assign(batches[p][RANK][0])
                ys.assign(batches[p][RANK][1])
                got = [t.numpy() for t in train_pass()]
                scale = 1.0 / n if average else 1.0
                if (p + 1) % n == 0:   # reduced: mean over ranks of the sums (locals: own sum / size)
                    expected = [np.mean([s[i] for s in sums], axis=0) * scale for i in range(2)]
                    w64 = w64 - LR * expected[0]
                    b64 = [b64[r] - LR * (sums[r][1] * scale / SIZE if local else expected[1]) for r in range(SIZE)]
                    if local:
                        expected[1] = sums[RANK][1] * scale / SIZE
                    sums = [[np.zeros_like(w64), np.zeros_like(b_init)] for _ in range(SIZE)]
                else:                  # this rank's running sum, not reduced
                    expected = [sums[RANK][0], sums[RANK][1]]
                what = "%s pass %d" % (kind, p)
                check_close64(got, expected, "gradients " + what)
                check_close64([w.numpy(), b.numpy()], [w64, b64[RANK]], "weights " + what)
                assert int(opt._agg_helper.counter.numpy()) == (p + 1) % n, (what, opt._agg_helper.counter.numpy())
                assert int(opt.iterations.numpy()) == p + 1, (what, opt.iterations.numpy())
            if not local:
                same_on_all_ranks([w.numpy(), b.numpy()], "aggregated weights " + kind)


def check_aggregation_clears_infinite_gradient():
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(LR), backward_passes_per_step=2)
    x = tf.Variable(0.0)
    calls = tf.Variable(0, trainable=False)

    def loss():
        calls.assign_add(1)
        return tf.cond(calls > 1, lambda: x * float(RANK + 1), lambda: x * float("inf"))
    got = []
    for _ in range(4):
        grads_and_vars = opt._compute_gradients(loss, var_list=[x])
        opt.apply_gradients(grads_and_vars)
        got.append(float(grads_and_vars[0][0].numpy()))
    assert got[0] == float("inf") and got[1] == float("inf"), got   # first cycle: inf, reduced inf
    # second cycle starts from zeroed sums: own sum, then the mean of the sums
    assert got[2] == RANK + 1, got
    np.testing.assert_allclose(got[3], np.mean([2.0 * (r + 1) for r in range(SIZE)]), rtol=1e-6)
    assert int(opt._agg_helper.counter.numpy()) == 0


def check_fit_agg_helper_counter():
    rng = np.random.default_rng(41 + RANK)   # each rank its own batch
    x = rng.standard_normal((B, N_IN)).astype(np.float32)
    y = rng.standard_normal((B, N_OUT)).astype(np.float32)
    rng = np.random.default_rng(40)
    w0 = rng.standard_normal((N_IN, N_OUT)).astype(np.float32)
    for make_opt in (lambda: tf.keras.optimizers.legacy.RMSprop(1e-3), lambda: tf.keras.optimizers.RMSprop(1e-3)):
        model = tf.keras.Sequential([tf.keras.layers.Dense(N_OUT, input_shape=(N_IN,))])
        model.set_weights([w0, np.zeros(N_OUT, np.float32)])
        opt = hvd.DistributedOptimizer(make_opt(), backward_passes_per_step=2, sparse_as_dense=True)
        model.compile(optimizer=opt, loss="mse")
        for step in range(3):
            model.train_on_batch(x, y)
            assert int(opt._agg_helper.counter.numpy()) == (step + 1) % 2, (step, opt._agg_helper.counter.numpy())
        assert int(opt.iterations.numpy()) == 3
        same_on_all_ranks(model.get_weights(), "train_on_batch with backward_passes_per_step")


def check_get_local_and_global_gradients():
    batches = rank_batches(51, 1)[0]
    rng = np.random.default_rng(52)
    w0, b0 = rng.standard_normal((N_IN, N_OUT)).astype(np.float32), rng.standard_normal(N_OUT).astype(np.float32)
    v0 = rng.standard_normal((N_OUT, 2)).astype(np.float32)
    model = tf.keras.Sequential([tf.keras.layers.Dense(N_OUT, input_shape=(N_IN,)),
                                 tf.keras.layers.Dense(2, use_bias=False)])
    model.set_weights([w0, b0, v0])
    xs = [tf.constant(x) for x, _ in batches]

    # loss = mean(model(x)); float64 gradients per rank
    per_rank = []
    for x in xs:
        x = x.numpy().astype(np.float64)
        k = 1.0 / (x.shape[0] * 2)
        dh = np.full((x.shape[0], 2), k) @ v0.astype(np.float64).T
        per_rank.append([x.T @ dh, dh.sum(axis=0), ((x @ w0 + b0).T @ np.full((x.shape[0], 2), k))])
    for local_layers in ([model.layers[0]], model.layers[1], []):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(xs[RANK]))
        tape = hvd.PartialDistributedGradientTape(tape, local_layers=local_layers)
        local_pairs, global_pairs = tape.get_local_and_global_gradients(loss, model.trainable_weights)
        layers = local_layers if isinstance(local_layers, list) else [local_layers]
        local_ids = [id(v) for layer in layers for v in layer.trainable_weights]
        assert [id(v) for v, _ in local_pairs] == local_ids, local_layers
        assert [id(v) for v, _ in global_pairs] == [id(v) for v in model.trainable_weights if id(v) not in local_ids]
        index = {id(v): i for i, v in enumerate(model.trainable_weights)}
        for v, g in local_pairs:
            check_close64([g.numpy()], [per_rank[RANK][index[id(v)]] / SIZE], "local " + v.name)
        for v, g in global_pairs:
            check_close64([g.numpy()], [np.mean([p[index[id(v)]] for p in per_rank], axis=0)], "global " + v.name)
            same_on_all_ranks([g.numpy()], "global " + v.name)



def check_optimizer_process_set_non_members():
    """DistributedOptimizer(process_set=ps) on ranks outside the set (shared_checks.py)."""
    shared_checks.optimizer_process_set_non_members(hvd, tf.keras, RANK, SIZE)


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
