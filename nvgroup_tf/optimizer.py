"""DistributedOptimizer: data-parallel training with any Keras optimizer.

How it works
------------
`DistributedOptimizer(opt, ...)` returns a copy of `opt` (rebuilt from its
config, as Horovod does) whose class is a subclass of opt's class with one
method overridden:
  * Keras 3 (tf.keras in TF >= 2.16): `apply(grads, trainable_variables)`.
    `model.fit` reaches it through `apply_gradients`, custom loops through
    either, so both reduce. Gradients are reduced (see _keras_impl/reduce.py:
    fusion buckets in backprop order, variables identified by `.path`) and the
    original `apply` runs on the result.
  * tf_keras (TF_USE_LEGACY_KERAS=1): `apply_gradients`, see _keras_impl/legacy.py.

Mixed precision. Keras' LossScaleOptimizer checks the gradients for inf/NaN
before calling its inner optimizer; if that check ran on per-rank gradients,
one rank could skip the step (and its collectives) while the others wait in
them. So the reduction always happens in the OUTERMOST optimizer:
  * DistributedOptimizer(LossScaleOptimizer(opt)) subclasses the
    LossScaleOptimizer: reduce, then check: every rank sees the same sums.
  * DistributedOptimizer(opt) under the global policy "mixed_float16" wraps opt
    in a LossScaleOptimizer first (what `compile` would do), so compile does not
    add another one around ours. A model whose policy is set per model, not
    globally, must be given DistributedOptimizer(LossScaleOptimizer(opt)).

XLA. The collectives have XLA lowerings (ops/xla_ops.cc: custom calls into
the engine), so a train step with DistributedOptimizer compiles like any other:
`compile(jit_compile=True)` and custom loops under tf.function(jit_compile=True)
run the reduction inside the XLA program, and the default jit_compile="auto"
resolves exactly as Keras decides without nvgroup_tf (on where a GPU is
visible, off on CPU-only machines).
"""
import tensorflow as tf

from nvgroup_tf._keras_impl.reduce import GradientReducer, LocalAggregator

_DISTRIBUTED_MARK = "_nvg_is_distributed"


class _SyncState:
    """Per-optimizer reduction state. A plain object, so Keras' attribute
    tracking leaves it alone (it holds no variables Keras must save)."""

    def __init__(self, reducer, aggregator):
        self.reducer = reducer
        self.aggregator = aggregator


class _DistributedKerasMixin:
    """Overrides Keras 3 `apply`; combined with the wrapped optimizer's class."""

    _nvg_is_distributed = True

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None:
            if not self.built:
                raise ValueError("DistributedOptimizer.apply: pass trainable_variables on the first "
                                 "call (or build the optimizer first)")
            trainable_variables = self._trainable_variables
        grads, variables = list(grads), list(trainable_variables)
        if not grads:
            return
        if not self.built:
            # Build outside the tf.cond of backward_passes_per_step (no variable
            # creation inside a branch).
            with tf.name_scope(self.name):
                self.build(variables)
            self.built = True
        sync = self._nvg_sync
        if sync.aggregator is None:
            return super().apply(sync.reducer.reduce(grads, variables), variables)

        def apply_fn(aggregated):
            super(_DistributedKerasMixin, self).apply(sync.reducer.reduce(aggregated, variables), variables)

        def skip_fn():
            self._nvg_iterations().assign_add(1)

        sync.aggregator.step(grads, variables, apply_fn, skip_fn)

    def _nvg_iterations(self):
        inner = getattr(self, "inner_optimizer", None)  # LossScaleOptimizer: the inner one counts
        return (inner if inner is not None else self)._iterations


def is_distributed(optimizer) -> bool:
    return bool(getattr(optimizer, _DISTRIBUTED_MARK, False)) or bool(
        getattr(getattr(optimizer, "inner_optimizer", None), _DISTRIBUTED_MARK, False))


def _is_keras3_optimizer(optimizer) -> bool:
    import keras
    return isinstance(optimizer, keras.optimizers.Optimizer)


def _is_tf_keras_optimizer(optimizer) -> bool:
    return type(optimizer).__module__.startswith("tf_keras.") or any(
        c.__module__.startswith("tf_keras.") for c in type(optimizer).__mro__)


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=None,
                         sparse_as_dense=False, backward_passes_per_step=1, op=None,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         bucket_cap_bytes=None):
    """Wraps a Keras optimizer so gradients are reduced across ranks before they
    are applied. Arguments as Horovod's (compression=Compression.none and
    op=Average when None), plus:

      bucket_cap_bytes: fusion bucket cap in bytes (default: NVGROUP_BUCKET_CAP_MB
        MiB, else 25 MiB; 0 = one collective per gradient). num_groups / groups,
        when given, replace size-based bucketing by Horovod's grouping.
    """
    if is_distributed(optimizer):
        raise ValueError("DistributedOptimizer: this optimizer is already distributed")
    reducer = GradientReducer(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                              device_dense=device_dense, device_sparse=device_sparse,
                              num_groups=num_groups, groups=groups, bucket_cap_bytes=bucket_cap_bytes,
                              name_prefix=name or "Distributed%s" % type(optimizer).__name__)
    aggregator = (LocalAggregator(backward_passes_per_step, average_aggregated_gradients)
                  if backward_passes_per_step != 1 else None)
    if _is_tf_keras_optimizer(optimizer):
        from nvgroup_tf._keras_impl import legacy
        return legacy.wrap(optimizer, _SyncState(reducer, aggregator))
    if not _is_keras3_optimizer(optimizer):
        raise TypeError("DistributedOptimizer expects a Keras optimizer (keras.optimizers.Optimizer, or "
                        "a tf_keras optimizer with TF_USE_LEGACY_KERAS=1), got %s" % type(optimizer).__name__)
    import keras
    if (keras.config.dtype_policy().name == "mixed_float16"
            and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)):
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    cls = type(optimizer)
    dist_cls = type("Distributed" + cls.__name__, (_DistributedKerasMixin, cls), {})
    try:
        wrapped = dist_cls.from_config(optimizer.get_config())
    except Exception as e:  # a custom optimizer whose config does not round-trip
        raise TypeError("DistributedOptimizer: cannot rebuild %s from its get_config() (%s); make "
                        "get_config/from_config round-trip" % (cls.__name__, e)) from e
    wrapped._nvg_sync = _SyncState(reducer, aggregator)
    return wrapped
