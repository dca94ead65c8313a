"""DistributedOptimizer for tf_keras (Keras 2, selected by TF_USE_LEGACY_KERAS=1).

How it works: like the Keras 3 path (optimizer.py) but the hook is
`apply_gradients(grads_and_vars, ...)`, which tf_keras' `minimize` (used by
`fit`) and custom loops both reach, for the new tf_keras optimizers and the
legacy OptimizerV2 ones alike. Overriding it on the outermost optimizer puts the
reduction before a tf_keras LossScaleOptimizer's finite check, so ranks agree.
tf_keras has no auto-XLA for the train step (jit_compile defaults to off), and
its optimizers' own XLA (`jit_compile=True`) only compiles the per-variable
update, after our reduction.
"""
import tensorflow as tf


class _DistributedLegacyMixin:
    _nvg_is_distributed = True

    @property
    def _nvg_local_vars(self):
        return list(self._nvg_sync.reducer.local_vars)

    def register_local_var(self, var):
        """Horovod: the gradient of `var` stays this rank's own (not reduced)."""
        self._nvg_sync.reducer.register_local_var(var)

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return super().apply_gradients(grads_and_vars, *args, **kwargs)
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        sync = self._nvg_sync
        if sync.aggregator is None:
            reduced = sync.reducer.reduce(grads, variables)
            return super().apply_gradients(list(zip(reduced, variables)), *args, **kwargs)
        _prebuild(self, variables)

        def apply_fn(aggregated):
            reduced = sync.reducer.reduce(aggregated, variables)
            super(_DistributedLegacyMixin, self).apply_gradients(list(zip(reduced, variables)), *args, **kwargs)

        def skip_fn():
            self.iterations.assign_add(1)

        sync.aggregator.step(grads, variables, apply_fn, skip_fn)
        return self.iterations


def _prebuild(optimizer, variables):
    """Creates slots before the tf.cond of backward_passes_per_step (no variable
    creation inside a branch). New tf_keras optimizers build under init_scope
    themselves; OptimizerV2 (and a LossScaleOptimizer around one) do not."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if hasattr(inner, "_create_all_weights"):
        with tf.init_scope():
            inner._create_all_weights(variables)


def wrap(optimizer, sync_state):
    cls = type(optimizer)
    dist_cls = type("Distributed" + cls.__name__, (_DistributedLegacyMixin, cls), {})
    try:
        wrapped = dist_cls.from_config(optimizer.get_config())
    except Exception as e:
        raise TypeError("DistributedOptimizer: cannot rebuild %s from its get_config() (%s)"
                        % (cls.__name__, e)) from e
    wrapped._nvg_sync = sync_state
    return wrapped
