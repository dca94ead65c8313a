"""Horovod-parity checks of nvgroup_tf.keras (Keras 3), run under mpirun by
test_horovod_parity.py: `parity_worker.py check1 check2 ...`, printing
"[rank r] ok name" or "[rank r] FAIL name: why" (as keras_worker.py)."""
import os
import subprocess
import sys
import tempfile
import traceback

import numpy as np
import tensorflow as tf
import keras

import nvgroup_tf.keras as hvd
import shared_checks  # tests/keras: the checks the tf_keras worker runs too

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
B, STEPS = 4, 4


def dense_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])


def global_data(seed, steps=STEPS):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((steps * SIZE * B, 6)).astype(np.float32),
            rng.standard_normal((steps * SIZE * B, 3)).astype(np.float32))


def rank_slice(a, steps=STEPS):
    return np.concatenate([a[(s * SIZE + RANK) * B:(s * SIZE + RANK + 1) * B] for s in range(steps)])


def same_on_all_ranks(arrays, what):
    gathered = hvd.allgather_object([np.asarray(a).tobytes() for a in arrays])
    for r, blobs in enumerate(gathered):
        assert blobs == gathered[0], "%s differ bitwise between rank 0 and rank %d" % (what, r)


class _LrRecorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.lrs = []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(self.model.optimizer.learning_rate.numpy()))


def check_lr_schedule_number_multiplier():
    """multiplier=<number>: initial_lr * multiplier ** (epoch - start_epoch) (Horovod)."""
    rng = np.random.default_rng([7, SIZE])
    lr0, m, start, epochs, spe = 0.3, float(rng.uniform(0.3, 0.9)), 1, 4, 2
    x, y = global_data(31, steps=spe)
    for staircase in (True, False):
        model = dense_model(3)
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr0)), loss="mse")
        rec = _LrRecorder()
        cb = hvd.callbacks.LearningRateScheduleCallback(lr0, m, start_epoch=start, staircase=staircase)
        model.fit(rank_slice(x, spe), rank_slice(y, spe), batch_size=B, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[cb, rec])
        expected, lr = [], lr0
        for epoch in range(epochs):
            for batch in range(spe):
                if epoch >= start:
                    e = epoch if staircase else epoch + batch / spe
                    lr = lr0 * m ** (e - start)
                expected.append(lr)
        np.testing.assert_allclose(rec.lrs, expected, rtol=1e-6, err_msg="lr per batch (staircase=%s)" % staircase)
        same_on_all_ranks(model.get_weights(), "weights (staircase=%s)" % staircase)


def _adamw_reference(init, x, y, lr, wd):
    """One process, the global batches, plain AdamW with the same exclusion."""
    ref = dense_model(0)
    ref.set_weights(init)
    opt = keras.optimizers.AdamW(lr, weight_decay=wd)
    opt.exclude_from_weight_decay(var_names=["bias"])
    ref.compile(optimizer=opt, loss="mse")
    ref.fit(x, y, batch_size=SIZE * B, epochs=1, shuffle=False, verbose=0)
    return ref.get_weights()


def check_optimizer_settings_survive_wrapping():
    """Whatever was set on the optimizer before DistributedOptimizer holds after
    it: AdamW's exclude_from_weight_decay, an attribute of the user's."""
    x, y = global_data(41)
    lr, wd = 0.01, 0.5
    model = dense_model(5)
    init = model.get_weights()
    opt = keras.optimizers.AdamW(lr, weight_decay=wd)
    opt.exclude_from_weight_decay(var_names=["bias"])
    opt.user_note = ("set before wrapping", RANK)
    opt = hvd.DistributedOptimizer(opt)
    assert getattr(opt, "user_note", None) == ("set before wrapping", RANK), "an attribute set before wrapping is lost"
    model.compile(optimizer=opt, loss="mse")
    model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    got = model.get_weights()
    same_on_all_ranks(got, "AdamW weights")
    ref = _adamw_reference(init, x, y, lr, wd)
    for i, (a, e) in enumerate(zip(got, ref)):
        np.testing.assert_allclose(np.float64(a), np.float64(e), rtol=2e-5, atol=2e-6,
                                   err_msg="AdamW with exclude_from_weight_decay vs reference: weight %d" % i)


_PLAIN_LOAD = r"""
import sys
import numpy as np
import keras
path, out = sys.argv[1], sys.argv[2]
model = keras.models.load_model(path)
assert "nvgroup_tf" not in sys.modules, "the plain load imported nvgroup_tf"
opt = model.optimizer
np.savez(out, cls=np.array(type(opt).__module__ + "." + type(opt).__name__),
         iterations=np.array(int(opt.iterations.numpy())),
         **{"w%d" % i: w for i, w in enumerate(model.get_weights())},
         **{"o%d" % i: np.asarray(v) for i, v in enumerate(opt.variables)})
"""


def check_saved_model_loads_without_nvgroup():
    """A .keras saved with a DistributedOptimizer loads in a process that never
    imports nvgroup_tf (plain optimizer, same weights and optimizer state);
    hvd.load_model still makes it distributed and training goes on."""
    x, y = global_data(51)
    model = dense_model(6)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "rank%d.keras" % RANK)
    model.save(path)
    out = os.path.join(tmp, "plain.npz")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    proc = subprocess.run([sys.executable, "-c", _PLAIN_LOAD, path, out], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, "plain keras.models.load_model failed:\n%s" % proc.stdout[-4000:]
    plain = np.load(out)
    assert str(plain["cls"]) == "keras.src.optimizers.adam.Adam", str(plain["cls"])
    assert int(plain["iterations"]) == STEPS, int(plain["iterations"])
    for i, w in enumerate(model.get_weights()):
        assert np.array_equal(plain["w%d" % i], w), "weight %d differs after the plain load" % i
    for i, v in enumerate(model.optimizer.variables):
        assert np.array_equal(plain["o%d" % i], np.asarray(v)), "optimizer variable %d differs" % i
    loaded = hvd.load_model(path)
    from nvgroup_tf.keras.optimizer import is_distributed
    assert is_distributed(loaded.optimizer), type(loaded.optimizer)
    assert int(loaded.optimizer.iterations.numpy()) == STEPS
    # Training goes on, reduced: the same on every rank, and as the model that was saved.
    x2, y2 = global_data(52)
    loaded.fit(rank_slice(x2), rank_slice(y2), batch_size=B, epochs=1, shuffle=False, verbose=0)
    model.fit(rank_slice(x2), rank_slice(y2), batch_size=B, epochs=1, shuffle=False, verbose=0)
    same_on_all_ranks(loaded.get_weights(), "weights after hvd.load_model + fit")
    for i, (a, b) in enumerate(zip(loaded.get_weights(), model.get_weights())):
        assert np.array_equal(a, b), "weight %d: loaded and original models diverge" % i


def check_tape_process_set_non_members():
    """DistributedGradientTape(process_set=ps): members get the average over
    the set, the other ranks their own gradients unchanged (Horovod)."""
    ps = hvd.add_process_set([0, 2])
    try:
        rng = np.random.default_rng(61)
        xs = [rng.standard_normal((5, 4)) for _ in range(SIZE)]
        w0 = rng.standard_normal((4, 2))
        w = tf.Variable(w0.astype(np.float32))
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(tf.square(tf.matmul(tf.constant(xs[RANK], tf.float32), w)))
        tape = hvd.DistributedGradientTape(t, process_set=ps)
        g = tape.gradient(loss, [w])[0].numpy()
        local = [2.0 * x.T @ (x @ w0) for x in xs]  # float64 d/dw sum((x w)^2)
        if RANK in (0, 2):
            np.testing.assert_allclose(np.float64(g), (local[0] + local[2]) / 2, rtol=1e-5, atol=1e-5,
                                       err_msg="member's gradient")
        else:
            np.testing.assert_allclose(np.float64(g), local[RANK], rtol=1e-5, atol=1e-5,
                                       err_msg="non-member's gradient must be its own")
    finally:
        hvd.remove_process_set(ps)


def _check_set_sums(ps, tag):
    """An allreduce on `ps` sums its members' (random integer) tensors exactly."""
    data = [np.random.default_rng([71, r, ps.process_set_id]).integers(-1000, 1000, 9).astype(np.int32)
            for r in range(SIZE)]
    if not ps.included():
        assert RANK not in ps.ranks, (tag, ps)
        return
    import nvgroup_tf
    got = nvgroup_tf.allreduce(tf.constant(data[RANK]), op=nvgroup_tf.Sum, process_set=ps, name="sum_" + tag).numpy()
    want = np.sum([data[r].astype(np.int64) for r in ps.ranks], axis=0)
    assert np.array_equal(got.astype(np.int64), want), (tag, ps, got, want)


def check_process_set_ids_reused():
    """Ids of removed sets are reused, first removed first (Horovod's
    ProcessSetTable); every set works under its new id."""
    a, b, c = hvd.add_process_set([0, 1]), hvd.add_process_set([2, 3]), hvd.add_process_set([0, 2])
    assert [a.process_set_id, b.process_set_id, c.process_set_id] == [1, 2, 3], (a, b, c)
    assert hvd.remove_process_set(b) and hvd.remove_process_set(a)
    d = hvd.add_process_set([1, 3])
    e = hvd.add_process_set([0, 3])
    f = hvd.add_process_set([1, 2])
    assert [d.process_set_id, e.process_set_id, f.process_set_id] == [2, 1, 4], (d, e, f)
    from nvgroup_tf.process_sets import _get_process_set_ids_and_ranks
    table = _get_process_set_ids_and_ranks()
    assert table == {0: list(range(SIZE)), 1: [0, 3], 2: [1, 3], 3: [0, 2], 4: [1, 2]}, table
    assert hvd.allgather_object(table) == [table] * SIZE
    for tag, ps in (("c", c), ("d", d), ("e", e), ("f", f)):
        _check_set_sums(ps, tag)
    for ps in (c, d, e, f):
        hvd.remove_process_set(ps)



def check_optimizer_process_set_non_members():
    """DistributedOptimizer(process_set=ps) on ranks outside the set (shared_checks.py)."""
    shared_checks.optimizer_process_set_non_members(hvd, keras, RANK, SIZE)


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
