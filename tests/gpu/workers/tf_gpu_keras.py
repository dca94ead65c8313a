"""Keras fit on the GPU wrapped in DistributedOptimizer: after STEPS steps the
weights are bitwise equal on every rank and equal (float rounding) to one
process fitting the same model from the same weights on the whole batch.

The model is elementwise (scale, shift, tanh, scale), so it runs in the kit's
default mode, where MatMul/Conv have no cuBLAS/cuDNN; `dense` and `conv`
(TFGPU_FULL=1 mode, or a real TF GPU install: cuBLAS and cuDNN) use Dense
layers, and Conv2D + pooling + Dense layers. A second argument `xla` compiles the
distributed model with jit_compile=True (the collectives lowered to XLA custom
calls on the GPU); the one-process reference is always compiled without XLA.

    tf_gpu_keras.py [elementwise|dense|conv] [xla]
"""
import sys

import numpy as np

from gpu_common import GPU, Checker, hvd, init_on_gpu, on_gpu, run, tf

init_on_gpu()
# Full float32 MatMul/Conv (TF uses TF32 on Ampere and later by default): the
# comparison with one process below is within float32 rounding, not TF32's.
tf.config.experimental.enable_tensor_float_32_execution(False)
import keras  # noqa: E402  (after TF's device setup)

import nvgroup_tf.keras as hvd_keras  # noqa: E402

RANK, SIZE = hvd.rank(), hvd.size()
B, STEPS, LR, FEATURES = 8, 6, 0.1, 32
IMAGE = (8, 8, 3)  # conv: each input row is FEATURES * 6 = 192 = 8 * 8 * 3 values


@keras.saving.register_keras_serializable("nvgroup_test")
class Elementwise(keras.layers.Layer):
    """y = tanh(x * a + b) * c, every weight a vector: no matrix products."""

    def build(self, input_shape):
        n = input_shape[-1]
        self.a = self.add_weight(shape=(n,), initializer=keras.initializers.RandomNormal(1.0, 0.3), name="a")
        self.b = self.add_weight(shape=(n,), initializer=keras.initializers.RandomNormal(0.0, 0.3), name="b")
        self.c = self.add_weight(shape=(n,), initializer=keras.initializers.RandomNormal(1.0, 0.3), name="c")

    def call(self, x):
        return keras.ops.tanh(x * self.a + self.b) * self.c


def model_fn(kind, seed):
    keras.utils.set_random_seed(seed)
    with tf.device(GPU):
        if kind == "conv":
            return keras.Sequential([keras.Input((FEATURES * 6,)), keras.layers.Reshape(IMAGE),
                                     keras.layers.Conv2D(6, 3, padding="same", activation="tanh"),
                                     keras.layers.Conv2D(4, 3, strides=2, padding="same", activation="tanh"),
                                     keras.layers.GlobalAveragePooling2D(),
                                     keras.layers.Dense(FEATURES)])
        if kind == "dense":
            return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="tanh"),
                                     keras.layers.Dense(FEATURES)])
        return keras.Sequential([keras.Input((FEATURES,)), Elementwise(), Elementwise()])


def rank_slice(a):
    return np.concatenate([a[(s * SIZE + RANK) * B:(s * SIZE + RANK + 1) * B] for s in range(STEPS)])


def main():
    kind = sys.argv[1] if len(sys.argv) > 1 else "elementwise"
    xla = len(sys.argv) > 2 and sys.argv[2] == "xla"
    c = Checker("tf_gpu_keras %s%s" % (kind, " xla" if xla else ""))
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((STEPS * SIZE * B, FEATURES * (6 if kind == "conv" else 1))).astype(np.float32)
    y = rng.standard_normal((STEPS * SIZE * B, FEATURES)).astype(np.float32)

    model = model_fn(kind, 7)
    init = [w.copy() for w in model.get_weights()]
    c.check(all(on_gpu(v.value) for v in model.weights), "model variables on the GPU: %s"
            % [v.value.device for v in model.weights])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse",
                  jit_compile=xla)
    with tf.device(GPU):
        model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    c.equal(int(model.optimizer.iterations.numpy()), STEPS, "optimizer steps")
    weights = model.get_weights()
    c.check(any(np.abs(a - b).max() > 1e-3 for a, b in zip(weights, init)), "weights did not move")
    gathered = hvd.allgather_object([w.tobytes() for w in weights])
    for r, blobs in enumerate(gathered):
        c.check(blobs == gathered[0], "weights differ bitwise between rank 0 and rank %d" % r)

    ref = model_fn(kind, 7)
    ref.set_weights(init)
    ref.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", jit_compile=False)
    with tf.device(GPU):
        ref.fit(x, y, batch_size=SIZE * B, epochs=1, shuffle=False, verbose=0)
    for i, (got, want) in enumerate(zip(weights, ref.get_weights())):
        err = np.max(np.abs(got.astype(np.float64) - want) / (np.abs(want) + 1e-3))
        c.check(err < 2e-5, "weight %d vs one process on the whole batch: relative error %.3g" % (i, err))
    c.finish()
    print("[rank %d] PASSED" % RANK, flush=True)


if __name__ == "__main__":
    run(main)
