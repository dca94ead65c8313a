"""SyncBatchNormalization (Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1) vs a
float64 single-process batch norm of the concatenated batch: outputs, moving
statistics, and the gradients of the sum of every rank's loss (input gradient
of this rank's rows, gamma/beta gradients summed over ranks). Ranks hold
batches of different sizes. Eager and inside tf.function; the statistics are
bitwise identical on every rank; a Keras fit with the layer keeps ranks equal;
fused= (True, False or None) is accepted and ignored (docs/MIGRATION.md)."""
import os

import numpy as np

from common import Checker, hvd, run, tf

EPS = 1e-3
MOMENTUM = 0.9


def reference(x_all, w_all, gamma, beta, axes, mask_all=None):
    """float64 batch norm of the whole batch and the gradients of sum(y * w);
    with a mask, the statistics are those of the unmasked elements."""
    x = tf.constant(x_all, tf.float64)
    g = tf.constant(gamma, tf.float64)
    b = tf.constant(beta, tf.float64)
    with tf.GradientTape() as tape:
        tape.watch([x, g, b])
        if mask_all is None:
            mean, var = tf.nn.moments(x, axes)
        else:
            m = tf.constant(mask_all[..., None], tf.float64)
            mean = tf.reduce_sum(m * x, axes) / tf.reduce_sum(m, axes)
            var = tf.reduce_sum(m * tf.square(x - mean), axes) / tf.reduce_sum(m, axes)
        y = tf.nn.batch_normalization(x, mean, var, b, g, EPS)
        loss = tf.reduce_sum(y * tf.constant(w_all, tf.float64))
    dx, dg, db = tape.gradient(loss, [x, g, b])
    return y.numpy(), mean.numpy(), var.numpy(), dx.numpy(), dg.numpy(), db.numpy()


def close(c, got, want, what, rtol=2e-5):
    got = np.asarray(got, np.float64)
    if got.shape != want.shape:
        c.check(False, "%s: shape %s, want %s" % (what, got.shape, want.shape))
        return
    scale = (np.max(np.abs(want)) if want.size else 0.0) + 1e-30
    err = np.abs(got - want)
    bad = np.flatnonzero(~(err <= rtol * (np.abs(want) + scale)))
    c.check(bad.size == 0, "%s: %d of %d off, worst %g" % (
        what, bad.size, want.size, (err.max() if err.size else 0.0) / scale))


def same_on_all_ranks(c, arrays, what):
    blobs = hvd.allgather_object([np.asarray(a).tobytes() for a in arrays], name="same." + what)
    c.check(all(b == blobs[0] for b in blobs), "%s bitwise identical on all ranks" % what)


def check_layer(c, shape_tail, axes, mode, rows=None, masked=False):
    n, me = hvd.size(), hvd.rank()
    rows = rows or [3 + 2 * r for r in range(n)]       # uneven batches
    start = sum(rows[:me])
    rng = np.random.default_rng([51, len(shape_tail)])
    x_all = (rng.normal(size=[sum(rows)] + shape_tail) * 3 + 1.5).astype(np.float32)
    w_all = rng.normal(size=x_all.shape).astype(np.float32)
    channels = shape_tail[-1]
    gamma = rng.uniform(0.5, 2.0, size=channels).astype(np.float32)
    beta = rng.normal(size=channels).astype(np.float32)
    x_mine = tf.constant(x_all[start:start + rows[me]])
    w_mine = tf.constant(w_all[start:start + rows[me]])
    mask_all = rng.integers(0, 2, size=x_all.shape[:-1]).astype(bool) if masked else None
    mask_mine = None if mask_all is None else tf.constant(mask_all[start:start + rows[me]])

    layer = hvd.SyncBatchNormalization(momentum=MOMENTUM, epsilon=EPS)
    layer.build(x_mine.shape)
    layer.gamma.assign(gamma)
    layer.beta.assign(beta)

    def step(x, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True) if mask_mine is None else layer(x, training=True,
                                                                        mask=mask_mine)
            loss = tf.reduce_sum(y * w)
        dx, dg, db = tape.gradient(loss, [x, layer.gamma, layer.beta])
        return y, dx, dg, db

    fn = tf.function(step) if mode == "tf.function" else step
    y, dx, dg, db = fn(x_mine, w_mine)
    ref_y, ref_mean, ref_var, ref_dx, ref_dg, ref_db = reference(x_all, w_all, gamma, beta, axes,
                                                                 mask_all)
    label = "%s %s rows %s%s" % (shape_tail, mode, rows, " masked" if masked else "")
    close(c, y.numpy(), ref_y[start:start + rows[me]], "output " + label)
    close(c, dx.numpy(), ref_dx[start:start + rows[me]], "input gradient " + label, rtol=1e-4)
    dg_sum = hvd.allreduce(tf.cast(dg, tf.float64), op=hvd.Sum, name="dg." + label)
    db_sum = hvd.allreduce(tf.cast(db, tf.float64), op=hvd.Sum, name="db." + label)
    close(c, dg_sum.numpy(), ref_dg, "gamma gradient summed " + label, rtol=1e-4)
    close(c, db_sum.numpy(), ref_db, "beta gradient summed " + label, rtol=1e-4)
    close(c, layer.moving_mean.numpy(), ref_mean * (1 - MOMENTUM), "moving mean " + label)
    close(c, layer.moving_variance.numpy(), MOMENTUM + ref_var * (1 - MOMENTUM),
          "moving variance " + label)
    same_on_all_ranks(c, [layer.moving_mean.numpy(), layer.moving_variance.numpy()],
                      "moving statistics " + label)
    # Inference uses the moving statistics, no collective.
    inferred = layer(x_mine, training=False)
    want = (x_all[start:start + rows[me]] - layer.moving_mean.numpy()) / np.sqrt(
        layer.moving_variance.numpy() + EPS) * gamma + beta
    close(c, inferred.numpy(), want.astype(np.float64), "inference " + label)


def check_fit(c):
    me = hvd.rank()
    keras = tf.keras
    rng = np.random.default_rng([61, me])
    x = rng.normal(size=(24, 6)).astype(np.float32) * (me + 1)
    y = rng.normal(size=(24, 1)).astype(np.float32)
    tf.keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5),
                              hvd.SyncBatchNormalization(), keras.layers.Dense(1)])
    import nvgroup_tf.keras as hvdk
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0,
              callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
    same_on_all_ranks(c, model.get_weights(), "weights after fit")
    bn = model.layers[1]
    c.check(float(np.abs(bn.moving_mean.numpy()).sum()) > 0, "fit updated the moving mean")


def main():
    c = Checker("syncbn")
    hvd.init()
    legacy = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    base = hvd.SyncBatchNormalization.__mro__[1].__module__
    c.check(base.startswith("tf_keras") == legacy and base.startswith("keras") != legacy,
            "SyncBatchNormalization subclasses %s (TF_USE_LEGACY_KERAS=%s)" % (base, legacy))
    for fused in (True, False, None):
        layer = hvd.SyncBatchNormalization(fused=fused)
        c.check(isinstance(layer, hvd.SyncBatchNormalization), "fused=%s accepted" % fused)
    for mode in ("eager", "tf.function"):
        check_layer(c, [4], [0], mode)
        check_layer(c, [3, 2, 5], [0, 1, 2], mode)
    # A rank with an empty batch contributes nothing (and no NaN).
    check_layer(c, [4], [0], "eager", rows=[0] + [4 + r for r in range(1, hvd.size())])
    if not os.environ.get("TF_USE_LEGACY_KERAS"):  # Keras 3's mask argument of the layer
        check_layer(c, [3, 4], [0, 1], "tf.function", masked=True)
    check_fit(c)
    c.finish()


if __name__ == "__main__":
    run(main)
