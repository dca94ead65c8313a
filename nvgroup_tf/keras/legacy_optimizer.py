"""DistributedOptimizer for tf_keras (Keras 2, selected by TF_USE_LEGACY_KERAS=1).

How it works: like the Keras 3 path (optimizer.py) but the hook is
`apply_gradients(grads_and_vars, ...)`, which tf_keras' `minimize` (used by
`fit`) and custom loops both reach, for the new tf_keras optimizers and the
legacy OptimizerV2 ones alike. Overriding it on the outermost optimizer puts the
reduction before a tf_keras LossScaleOptimizer's finite check, so ranks agree.
tf_keras has no auto-XLA for the train step (jit_compile defaults to off), and
its optimizers' own XLA (`jit_compile=True`) only compiles the per-variable
update, after our reduction.

Horovod's tf_keras path reduces in `_compute_gradients(loss, var_list,
grad_loss, tape)` (also `compute_gradients`), which `minimize` calls before
`apply_gradients`: ours returns the reduced gradients too (with
backward_passes_per_step: the reduced sum on every N-th pass, this rank's
running sum otherwise), and an `apply_gradients` of exactly those gradients
does not reduce again; with backward_passes_per_step it applies them only on
the N-th pass and otherwise advances `iterations`. `_agg_helper` is Horovod's
name for the aggregator (None when backward_passes_per_step is 1).
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

    @property
    def _agg_helper(self):
        """Horovod: the backward_passes_per_step aggregator (`.counter`: passes
        since the last reduction), None when backward_passes_per_step is 1."""
        return self._nvg_sync.aggregator

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """Horovod's: (gradient, variable) pairs of `loss` (a callable, or a
        tensor recorded on `tape`), the gradients reduced over ranks (see the
        module docstring for backward_passes_per_step)."""
        base = super()
        if hasattr(base, "_compute_gradients"):   # OptimizerV2 (and its LossScaleOptimizer)
            grads_and_vars = base._compute_gradients(loss, var_list, grad_loss=grad_loss, tape=tape)
        else:                                      # the new tf_keras optimizers
            if grad_loss is not None:
                raise ValueError("compute_gradients: grad_loss needs a tf_keras legacy (OptimizerV2) optimizer")
            grads_and_vars = base.compute_gradients(loss, var_list, tape=tape)
        grads_and_vars = list(grads_and_vars)
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        sync = self._nvg_sync
        if sync.aggregator is None:
            reduced = sync.reducer.reduce(grads, variables)
        else:
            reduced = sync.aggregator.compute(grads, variables,
                                              lambda aggregated: sync.reducer.reduce(aggregated, variables))
        sync.prereduced = list(reduced)
        return list(zip(reduced, variables))

    def compute_gradients(self, loss, var_list, tape=None):
        return self._compute_gradients(loss, var_list, tape=tape)

    def _nvg_take_prereduced(self, grads):
        """Whether `grads` are exactly what the last _compute_gradients returned."""
        sync = self._nvg_sync
        hit = len(sync.prereduced) == len(grads) and all(a is b for a, b in zip(sync.prereduced, grads))
        sync.prereduced = []
        return hit

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return super().apply_gradients(grads_and_vars, *args, **kwargs)
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        sync = self._nvg_sync
        prereduced = self._nvg_take_prereduced(grads)
        if sync.aggregator is None:
            reduced = grads if prereduced else sync.reducer.reduce(grads, variables)
            return super().apply_gradients(list(zip(reduced, variables)), *args, **kwargs)
        _prebuild(self, variables)
        if prereduced:
            def apply_reduced():
                super(_DistributedLegacyMixin, self).apply_gradients(grads_and_vars, *args, **kwargs)
                return tf.constant(True)

            def skip():
                self.iterations.assign_add(1)
                return tf.constant(False)

            tf.cond(sync.aggregator.applies_now(), apply_reduced, skip)
            return self.iterations

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
    """Makes `optimizer` itself distributed (everything set on it stays, as
    with Keras 3: optimizer.py). The class keeps the wrapped class's name, as
    Horovod's, so a saved model names the plain optimizer class."""
    cls = type(optimizer)
    dist_cls = type(cls.__name__, (_DistributedLegacyMixin, cls), {"__module__": cls.__module__})
    object.__setattr__(optimizer, "__class__", dist_cls)
    optimizer._nvg_sync = sync_state
    return optimizer
