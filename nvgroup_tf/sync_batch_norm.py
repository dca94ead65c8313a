"""SyncBatchNormalization: batch normalization whose batch statistics are those
of the global batch (every rank's batch together), Horovod's layer of the same name.

It subclasses tf.keras.layers.BatchNormalization -- Keras 3, or tf_keras under
TF_USE_LEGACY_KERAS=1 -- and replaces only the computation of the training-time
moments; inference, moving statistics, renorm and serialization are the base
layer's.

How the moments are combined. Each rank computes, per channel, its count n_r
(the number of reduced elements, or the sum of the mask weights), its mean m_r
and its sum of squared deviations M2_r, and one allgather brings every rank's
(n, m, M2). Every rank then combines them in rank order (Chan et al.'s parallel
formula, no E[x^2] - E[x]^2 cancellation):
    N = sum n_r,  mean = sum n_r m_r / N,  M2 = sum M2_r + sum n_r (m_r - mean)^2,
    variance = M2 / N,
the same arithmetic on the same gathered values, so the statistics and the
moving averages are bitwise identical on all ranks. Ranks may hold batches of
different sizes (weighted by n_r; Horovod weights every rank equally, which
agrees for equal batches). Gradients flow through the allgather. Its gradient
is Horovod's (the average over ranks of every rank's contribution); the
statistics are scaled by the set's size on the way back (_sum_gradient), so
d(sum over ranks of the losses)/d(input) is what a single process would get on
the concatenated batch.

The collective is named "SyncBatchNormalization/<layer name>/<k>", k counting
the layer's calls within one graph (a layer shared inside one model is called
more than once per step), so every trace of a tf.function names it the same
and ranks agree whatever their retracing history.
"""
import inspect
import weakref

import tensorflow as tf

from nvgroup_tf import basics
from nvgroup_tf.mpi_ops import allgather

_BaseBatchNormalization = tf.keras.layers.BatchNormalization
# tf_keras: _moments(inputs, reduction_axes, keep_dims, mask=None);
# Keras 3: _moments(inputs, mask) with self._reduction_axes.
_LEGACY = "reduction_axes" in inspect.signature(_BaseBatchNormalization._moments).parameters


@tf.custom_gradient
def _sum_gradient(x):
    """Identity whose gradient is multiplied by the number of ranks: turns the
    allgather gradient's average over ranks back into their sum."""
    def grad(dy):
        return dy * tf.cast(basics.size(), dy.dtype)
    return tf.identity(x), grad


def global_moments(x, reduction_axes, weights=None, name=None):
    """Mean and variance of `x` over `reduction_axes` and over all ranks'
    `x`, keeping the reduced axes (size 1). `weights`: None or a tensor
    broadcastable to `x` (mask weights). See the module docstring."""
    reduction_axes = sorted(a % x.shape.rank for a in reduction_axes)
    if weights is None:
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), reduction_axes)), x.dtype)
        local_n = tf.fill(tf.shape(tf.reduce_sum(x, reduction_axes, keepdims=True)), count)
        # divide_no_nan: a rank with an empty batch contributes n = 0, not NaN.
        local_mean = tf.math.divide_no_nan(tf.reduce_sum(x, reduction_axes, keepdims=True), local_n)
        local_m2 = tf.reduce_sum(tf.math.squared_difference(x, local_mean), reduction_axes,
                                 keepdims=True)
    else:
        weights = tf.broadcast_to(tf.cast(weights, x.dtype), tf.shape(x))
        local_n = tf.reduce_sum(weights, reduction_axes, keepdims=True)
        local_mean = tf.math.divide_no_nan(tf.reduce_sum(weights * x, reduction_axes, keepdims=True),
                                           local_n)
        local_m2 = tf.reduce_sum(weights * tf.math.squared_difference(x, local_mean), reduction_axes,
                                 keepdims=True)
    stats = tf.stack([local_n, local_mean, local_m2])           # [3, ...kept shape]
    gathered = allgather(_sum_gradient(stats), name=name)        # [3 * size, ...]
    gathered = tf.reshape(gathered, tf.concat([[-1, 3], tf.shape(stats)[1:]], axis=0))
    n, m, m2 = gathered[:, 0], gathered[:, 1], gathered[:, 2]    # [size, ...kept shape]
    total = tf.reduce_sum(n, axis=0)
    mean = tf.math.divide_no_nan(tf.reduce_sum(n * m, axis=0), total)
    m2_total = tf.reduce_sum(m2, axis=0) + tf.reduce_sum(n * tf.square(m - mean), axis=0)
    return mean, tf.math.divide_no_nan(m2_total, total)


class SyncBatchNormalization(_BaseBatchNormalization):
    """Batch normalization with statistics synchronized across all ranks during
    training (Horovod's hvd.SyncBatchNormalization). Takes the arguments of
    tf.keras.layers.BatchNormalization. `fused` is accepted and ignored: the
    synchronized moments need the non-fused computation, which is always used
    (Keras 3's BatchNormalization has no fused kernel; Horovod raises
    ValueError for fused=True or None instead)."""

    def __init__(self, fused=False, **kwargs):
        del fused  # see the docstring
        if _LEGACY:
            kwargs["fused"] = False
        super().__init__(**kwargs)
        self._nvg_calls = weakref.WeakKeyDictionary()  # graph -> calls so far in it

    def _collective_name(self):
        graph = tf.compat.v1.get_default_graph()
        if tf.executing_eagerly():
            k = 0  # eager calls complete one after the other
        else:
            k = self._nvg_calls.get(graph, 0)
            self._nvg_calls[graph] = k + 1
        return "SyncBatchNormalization/%s/%d" % (self.name, k)

    def _sync_moments(self, inputs, reduction_axes, keep_dims, mask_weights):
        x = tf.cast(inputs, tf.float32) if inputs.dtype in (tf.float16, tf.bfloat16) else inputs
        mean, variance = global_moments(x, reduction_axes, mask_weights, name=self._collective_name())
        if not keep_dims:
            mean = tf.squeeze(mean, axis=reduction_axes)
            variance = tf.squeeze(variance, axis=reduction_axes)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)

    if _LEGACY:
        def _moments(self, inputs, reduction_axes, keep_dims, mask=None):
            if basics.size() == 1:
                return super()._moments(inputs, reduction_axes, keep_dims, mask=mask)
            weights = None if mask is None else tf.expand_dims(mask, axis=-1)
            return self._sync_moments(inputs, list(reduction_axes), keep_dims, weights)
    else:
        def _moments(self, inputs, mask):
            if basics.size() == 1:
                return super()._moments(inputs, mask)
            weights = None if mask is None else tf.expand_dims(mask, axis=-1)
            return self._sync_moments(inputs, list(self._reduction_axes), False, weights)


if not _LEGACY:
    SyncBatchNormalization = tf.keras.utils.register_keras_serializable(package="nvgroup_tf")(
        SyncBatchNormalization)
