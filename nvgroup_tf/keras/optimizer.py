"""DistributedOptimizer: data-parallel training with any Keras optimizer.

How it works
------------
`DistributedOptimizer(opt, ...)` makes `opt` itself distributed and returns
it: its class becomes a subclass of its class with one method overridden, and
everything set on it before (attributes outside get_config(), such as AdamW's
exclude_from_weight_decay, and any state) stays. (Horovod rebuilds a copy
from get_config(), which drops such settings.) The overridden method:
  * Keras 3 (tf.keras in TF >= 2.16): `apply(grads, trainable_variables)`.
    `model.fit` reaches it through `apply_gradients`, custom loops through
    either, so both reduce. Gradients are reduced (see nvgroup_tf/gradient_reducer.py:
    fusion buckets in backprop order, variables identified by `.path`) and the
    original `apply` runs on the result.
  * tf_keras (TF_USE_LEGACY_KERAS=1): `apply_gradients`, see legacy_optimizer.py.
Horovod's `_compute_gradients(loss, var_list, grad_loss, tape)` /
`compute_gradients` return reduced gradients too; an `apply` of exactly those
gradients does not reduce them a second time.

Saving. There is one Distributed<X> class per optimizer class X (registered
with Keras as "nvgroup_tf>Distributed<X>"), but `model.save()` writes the
optimizer as a plain X (the class is X while the compile config is
serialized), as Horovod's files name the wrapped class: a saved model loads
with plain Keras in a process that never imports nvgroup_tf, with a plain
optimizer. `nvgroup_tf.keras.load_model` (Horovod's hvd.load_model) makes the
loaded optimizer distributed, in place, keeping its state (iterations,
moments).

Mixed precision. Keras' LossScaleOptimizer checks the gradients for inf/NaN
before calling its inner optimizer; if that check ran on per-rank gradients,
one rank could skip the step (and its collectives) while the others wait in
them. So the reduction always happens in the OUTERMOST optimizer:
  * DistributedOptimizer(LossScaleOptimizer(opt)) subclasses the
    LossScaleOptimizer: reduce, then check: every rank sees the same sums.
  * DistributedOptimizer(opt) under the global policy "mixed_float16" wraps opt
    in a LossScaleOptimizer first (what `compile` would do), so compile does not
    add another one around ours.
  * A model whose policy is set per model (Model(dtype="mixed_float16")) makes
    `compile` wrap our optimizer in a plain LossScaleOptimizer. The first
    DistributedOptimizer installs a small wrapper around Keras' `compile` that
    then replaces that wrapper by a distributed LossScaleOptimizer around the
    same optimizer, which itself stops reducing: the reduction moves outward,
    before the finite check.

XLA. The collectives have XLA lowerings (ops/xla_lowering.cc: custom calls into
the engine), so a train step with DistributedOptimizer compiles like any other:
`compile(jit_compile=True)` and custom loops under tf.function(jit_compile=True)
run the reduction inside the XLA program, and the default jit_compile="auto"
resolves exactly as Keras decides without nvgroup_tf (on where a GPU is
visible, off on CPU-only machines).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import tensorflow as tf

from nvgroup_tf.gradient_reducer import GradientReducer, LocalAggregator, ReduceOptions, local_layers_variables

if TYPE_CHECKING:
    from nvgroup_tf.compression import Compressor
    from nvgroup_tf.process_sets import ProcessSet

_DISTRIBUTED_MARK = "_nvg_is_distributed"


class _SyncState:
    """Per-optimizer reduction state. A plain object, so Keras' attribute
    tracking leaves it alone (it holds no variables Keras must save)."""

    def __init__(self, reducer, aggregator):
        self.reducer = reducer
        self.aggregator = aggregator
        self.prereduced = []   # gradients compute_gradients returned already reduced
        self.reduced_outside = False  # an outer (distributed) LossScaleOptimizer reduces for us


def _make_sync(name_prefix, options=None):
    options = ReduceOptions() if options is None else options
    reducer = GradientReducer(options, name_prefix=name_prefix)
    aggregator = (LocalAggregator(options.backward_passes_per_step, options.average_aggregated_gradients)
                  if options.backward_passes_per_step != 1 else None)
    return _SyncState(reducer, aggregator)


class _DistributedKerasMixin:
    """Overrides Keras 3 `apply`; combined with the wrapped optimizer's class."""

    _nvg_is_distributed = True

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Keras deserialization (load_model): distributed, default reduction settings."""
        optimizer = super().from_config(config, custom_objects=custom_objects)
        if getattr(optimizer, "_nvg_sync", None) is None:
            optimizer._nvg_sync = _make_sync(cls.__name__)
        inner = getattr(optimizer, "inner_optimizer", None)
        if getattr(inner, _DISTRIBUTED_MARK, False):  # a saved distributed LossScaleOptimizer of
            inner._nvg_sync.reduced_outside = True      # a distributed one: the outer reduces
        _install_keras_hooks()
        return optimizer

    @property
    def _nvg_local_vars(self):
        return list(self._nvg_sync.reducer.local_vars)

    @property
    def _local_vars(self):
        """Horovod's: the set of `v.ref()` of the local variables."""
        return set(self._nvg_sync.reducer.local_keys)

    def register_local_var(self, var):
        """Horovod: the gradient of `var` (a variable or its `v.ref()`) stays this
        rank's own (not reduced; divided by size() when scale_local_gradients,
        Horovod's default)."""
        self._nvg_sync.reducer.register_local_var(var)

    def _nvg_reduce(self, grads, variables):
        sync = self._nvg_sync
        if sync.reduced_outside:
            return list(grads)
        if sync.prereduced and len(sync.prereduced) == len(grads) and all(
                a is b for a, b in zip(sync.prereduced, grads)):
            sync.prereduced = []
            return list(grads)
        sync.prereduced = []
        return sync.reducer.reduce(grads, variables)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """Horovod's (tf.keras OptimizerV2) path: gradients of `loss` (a tensor
        recorded on `tape`, or a callable) for `var_list`, reduced over ranks.
        Returns a list of (gradient, variable)."""
        tape = tf.GradientTape() if tape is None else tape
        if callable(loss):
            with tape:   # trainable variables the loss reads are watched automatically
                loss = loss()
        if callable(var_list):
            var_list = var_list()
        var_list = list(var_list)
        grads = tape.gradient(loss, var_list, grad_loss)
        reduced = self._nvg_reduce(grads, var_list)
        self._nvg_sync.prereduced = [g for g in reduced]
        return list(zip(reduced, var_list))

    def compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        return self._compute_gradients(loss, var_list, grad_loss=grad_loss, tape=tape)

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
        if sync.aggregator is None or sync.reduced_outside:
            return super().apply(self._nvg_reduce(grads, variables), variables)

        def apply_fn(aggregated):
            super(_DistributedKerasMixin, self).apply(self._nvg_reduce(aggregated, variables), variables)

        def skip_fn():
            self._nvg_iterations().assign_add(1)

        sync.aggregator.step(grads, variables, apply_fn, skip_fn)

    def _nvg_iterations(self):
        inner = getattr(self, "inner_optimizer", None)  # LossScaleOptimizer: the inner one counts
        return (inner if inner is not None else self)._iterations


def is_distributed(optimizer) -> bool:
    return bool(getattr(optimizer, _DISTRIBUTED_MARK, False)) or bool(
        getattr(getattr(optimizer, "inner_optimizer", None), _DISTRIBUTED_MARK, False))


_DIST_CLASSES = {}   # optimizer class -> its Distributed<X> class
_PLAIN_CLASSES = {}  # Distributed<X> class -> X


def distributed_class(cls):
    """The one Distributed<X> class of Keras 3 optimizer class X, registered
    for serialization as "nvgroup_tf>Distributed<X>"."""
    if getattr(cls, _DISTRIBUTED_MARK, False):
        return cls
    dist = _DIST_CLASSES.get(cls)
    if dist is not None:
        return dist
    import keras
    from keras.src.saving import object_registration
    name = "Distributed" + cls.__name__
    taken = object_registration.get_registered_object("nvgroup_tf>" + name)
    if taken is not None and taken.__mro__[2] is not cls:  # another class of the same name
        name = "Distributed%s_%s" % (cls.__module__.replace(".", "_"), cls.__name__)
    dist = type(name, (_DistributedKerasMixin, cls), {"__module__": __name__})
    keras.saving.register_keras_serializable(package="nvgroup_tf", name=name)(dist)
    _DIST_CLASSES[cls] = dist
    _PLAIN_CLASSES[dist] = cls
    return dist


def _register_builtin_optimizers():
    import keras
    for attr in dir(keras.optimizers):
        cls = getattr(keras.optimizers, attr)
        if (isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)
                and cls is not keras.optimizers.Optimizer and attr != "MultiOptimizer"):
            distributed_class(cls)


def make_distributed_in_place(optimizer, **kwargs):
    """Turns a built Keras 3 optimizer into a distributed one without
    rebuilding it: its variables (iterations, moments) are kept. Used by
    load_model; kwargs as DistributedOptimizer's (name and ReduceOptions' fields)."""
    if not is_distributed(optimizer):
        optimizer.__class__ = distributed_class(type(optimizer))
        optimizer._nvg_sync = None
    if kwargs or getattr(optimizer, "_nvg_sync", None) is None:
        name = kwargs.pop("name", None) or type(optimizer).__name__
        optimizer._nvg_sync = _make_sync(name, ReduceOptions(**kwargs))
    _install_keras_hooks()
    return optimizer


_hooks_installed = False


def _install_keras_hooks():
    """See "Mixed precision" in the module docstring (XLA needs no hook: the
    collectives have XLA lowerings)."""
    global _hooks_installed
    if _hooks_installed:
        return
    from keras.src.trainers import trainer as keras_trainer
    from keras.src.utils import tracking
    original_compile = keras_trainer.Trainer.compile

    original_get_compile_config = keras_trainer.Trainer.get_compile_config

    @tracking.no_automatic_dependency_tracking
    def compile(self, *args, **kwargs):
        original_compile(self, *args, **kwargs)
        _move_reduction_outside_loss_scale(self)

    def get_compile_config(self):
        compile_config = getattr(self, "_compile_config", None)
        optimizer = compile_config.config.get("optimizer") if compile_config is not None else None
        with _as_plain_classes(optimizer):
            return original_get_compile_config(self)

    compile.__doc__ = original_compile.__doc__
    get_compile_config.__doc__ = original_get_compile_config.__doc__
    keras_trainer.Trainer.compile = compile
    keras_trainer.Trainer.get_compile_config = get_compile_config
    _hooks_installed = True


class _as_plain_classes:
    """While serializing: `optimizer` and the optimizers it wraps
    (inner_optimizer) that are distributed have their plain class (see
    "Saving" in the module docstring)."""

    def __init__(self, optimizer):
        self.swapped = []
        while optimizer is not None and not isinstance(optimizer, str):
            cls = type(optimizer)
            if getattr(cls, _DISTRIBUTED_MARK, False) and cls in _PLAIN_CLASSES:
                self.swapped.append((optimizer, cls))
            optimizer = getattr(optimizer, "inner_optimizer", None)

    def __enter__(self):
        for optimizer, cls in self.swapped:
            optimizer.__class__ = _PLAIN_CLASSES[cls]

    def __exit__(self, *exc):
        for optimizer, cls in self.swapped:
            optimizer.__class__ = cls
        return False


def _move_reduction_outside_loss_scale(model):
    """compile() of a per-model mixed_float16 model put a plain
    LossScaleOptimizer around our distributed one: its finite check would see
    per-rank gradients (ranks could skip different steps and deadlock).
    Replace it by a distributed LossScaleOptimizer of the same settings."""
    import keras
    outer = getattr(model, "optimizer", None)
    if not isinstance(outer, keras.optimizers.LossScaleOptimizer) or getattr(outer, _DISTRIBUTED_MARK, False):
        return
    inner = outer.inner_optimizer
    if not getattr(inner, _DISTRIBUTED_MARK, False):
        return
    config = outer.get_config()
    config.pop("inner_optimizer", None)
    dist_outer = distributed_class(type(outer))(inner, **config)
    dist_outer._nvg_sync = inner._nvg_sync
    # The inner optimizer keeps its settings but no longer reduces: the outer does.
    inner._nvg_sync = _SyncState(inner._nvg_sync.reducer, None)
    inner._nvg_sync.reduced_outside = True
    model.optimizer = dist_outer


def _is_keras3_optimizer(optimizer) -> bool:
    import keras
    return isinstance(optimizer, keras.optimizers.Optimizer)


def _is_tf_keras_optimizer(optimizer) -> bool:
    return type(optimizer).__module__.startswith("tf_keras.") or any(
        c.__module__.startswith("tf_keras.") for c in type(optimizer).__mro__)


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, device_dense: str = "",
                         device_sparse: str = "", compression: Optional[type[Compressor]] = None,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: Optional[int] = None, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Optional[Union[int, Sequence[Sequence[tf.Variable]]]] = None, process_set: Optional[ProcessSet] = None,
                         scale_local_gradients: bool = True, bucket_cap_bytes: Optional[int] = None) -> Any:
    """Wraps a Keras optimizer so gradients are reduced across ranks before they
    are applied. Arguments as Horovod's (compression=Compression.none and
    op=Average when None; op must be Average or Sum; process_set: None, the
    global set or a registered ProcessSet), plus:

      bucket_cap_bytes: fusion bucket cap in bytes (default: NVGROUP_BUCKET_CAP_MB
        MiB, else 25 MiB; 0 = one collective per gradient). num_groups / groups,
        when given, replace size-based bucketing by Horovod's grouping.
    """
    options = ReduceOptions(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                            device_dense=device_dense, device_sparse=device_sparse,
                            backward_passes_per_step=backward_passes_per_step,
                            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
                            groups=groups, bucket_cap_bytes=bucket_cap_bytes,
                            gradient_predivide_factor=gradient_predivide_factor, process_set=process_set,
                            scale_local_gradients=scale_local_gradients)
    return distribute(optimizer, name, options)


def distribute(optimizer, name, options):
    """DistributedOptimizer(optimizer, name=name, **options' fields)."""
    if is_distributed(optimizer):
        raise ValueError("DistributedOptimizer: this optimizer is already distributed")
    sync = _make_sync(name or "Distributed%s" % type(optimizer).__name__, options)
    if _is_tf_keras_optimizer(optimizer):
        from nvgroup_tf.keras import legacy_optimizer
        return legacy_optimizer.wrap(optimizer, sync)
    if not _is_keras3_optimizer(optimizer):
        raise TypeError("DistributedOptimizer expects a Keras optimizer (keras.optimizers.Optimizer, or "
                        "a tf_keras optimizer with TF_USE_LEGACY_KERAS=1) or, through "
                        "nvgroup_tf.DistributedOptimizer, a tf.compat.v1.train.Optimizer; got %s"
                        % type(optimizer).__name__)
    import keras
    from nvgroup_tf.keras import compat
    compat.install()  # Keras 3 shims for Horovod programs: experimental_run_tf_function, opt.lr, ...
    if (keras.config.dtype_policy().name == "mixed_float16"
            and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)):
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    optimizer.__class__ = distributed_class(type(optimizer))
    optimizer._nvg_sync = sync
    _install_keras_hooks()
    return optimizer


def PartialDistributedOptimizer(optimizer: Any, name: Optional[str] = None, device_dense: str = "",
                                device_sparse: str = "", compression: Optional[type[Compressor]] = None,
                                sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                                op: Optional[int] = None, backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False, groups: Optional[Union[int, Sequence[Sequence[tf.Variable]]]] = None,
                                process_set: Optional[ProcessSet] = None, local_layers: Any = None,
                                scale_local_gradients: bool = True,
                                bucket_cap_bytes: Optional[int] = None) -> Any:
    """Horovod's PartialDistributedOptimizer: DistributedOptimizer whose
    `local_layers` (a Keras layer or a list of them) keep their gradients local
    (their trainable weights are register_local_var'ed)."""
    local_vars = local_layers_variables(local_layers)
    options = ReduceOptions(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                            device_dense=device_dense, device_sparse=device_sparse,
                            backward_passes_per_step=backward_passes_per_step,
                            average_aggregated_gradients=average_aggregated_gradients, groups=groups,
                            bucket_cap_bytes=bucket_cap_bytes,
                            gradient_predivide_factor=gradient_predivide_factor, process_set=process_set,
                            scale_local_gradients=scale_local_gradients)
    opt = distribute(optimizer, name, options)
    for var in local_vars:
        opt.register_local_var(var)
    return opt


try:
    _register_builtin_optimizers()
except ImportError:  # no Keras 3 (tf_keras only)
    pass
