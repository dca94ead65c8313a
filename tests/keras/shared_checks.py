"""Checks that the Keras 3 worker (parity_worker.py) and the tf_keras worker
(legacy_worker.py) share: each takes the Keras module and nvgroup_tf.keras of
its worker."""
import numpy as np


def optimizer_process_set_non_members(hvd, keras, rank, size):
    """DistributedOptimizer(process_set=ps), one fit step of SGD on a bias-free
    linear layer: members step with the average gradient over the set, the
    other ranks with their own gradient (Horovod reduces only where
    process_set.included()); float64 reference on every rank."""
    ps = hvd.add_process_set([0, 2])
    try:
        rng = np.random.default_rng(67)
        xs = [rng.standard_normal((4, 3)) for _ in range(size)]
        ys = [rng.standard_normal((4, 2)) for _ in range(size)]
        w0, lr = rng.standard_normal((3, 2)), 0.1
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, use_bias=False)])
        model.layers[0].set_weights([w0.astype(np.float32)])
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr), process_set=ps), loss="mse")
        model.fit(xs[rank].astype(np.float32), ys[rank].astype(np.float32), batch_size=4, epochs=1,
                  shuffle=False, verbose=0)
        grads = [2.0 / (4 * 2) * x.T @ (x @ w0 - y) for x, y in zip(xs, ys)]  # d mse / d w, float64
        want = w0 - lr * ((grads[0] + grads[2]) / 2 if rank in (0, 2) else grads[rank])
        np.testing.assert_allclose(np.float64(model.get_weights()[0]), want, rtol=1e-5, atol=1e-6,
                                   err_msg="member's step" if rank in (0, 2) else "non-member's own step")
    finally:
        hvd.remove_process_set(ps)
