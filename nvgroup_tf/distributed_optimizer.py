"""hvd.DistributedOptimizer, horovod.tensorflow's entry point (its signature,
use_locking included): a TF1 `tf.compat.v1.train.Optimizer` is wrapped here, a
Keras optimizer (Keras 3 or tf_keras) by nvgroup_tf.keras.optimizer.

TF1 optimizers (graph code with `minimize`, or `compute_gradients` /
`apply_gradients`): the wrapper is a tf.compat.v1.train.Optimizer whose
`compute_gradients` returns the wrapped optimizer's gradients reduced over the
ranks (GradientReducer: fusion buckets, Average by default, local variables
kept local) and whose `apply_gradients`, slots and variables are the wrapped
optimizer's, as Horovod's. `minimize` goes through both. Gradient
accumulation (backward_passes_per_step > 1) is not implemented for TF1
optimizers and raises NotImplementedError at construction.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import tensorflow as tf

from nvgroup_tf.gradient_reducer import GradientReducer, ReduceOptions

if TYPE_CHECKING:
    from nvgroup_tf.compression import Compressor
    from nvgroup_tf.process_sets import ProcessSet


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "",
                         compression: Optional[type[Compressor]] = None, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: Optional[int] = None,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Optional[Union[int, Sequence[Sequence[tf.Variable]]]] = None,
                         process_set: Optional[ProcessSet] = None, scale_local_gradients: bool = True,
                         bucket_cap_bytes: Optional[int] = None) -> Any:
    """Wraps `optimizer` (a tf.compat.v1.train.Optimizer or a Keras optimizer) so
    gradients are reduced across ranks before they are applied. Arguments as
    horovod.tensorflow.DistributedOptimizer's (compression=Compression.none and
    op=Average when None; use_locking applies to TF1 optimizers), plus
    bucket_cap_bytes as nvgroup_tf.keras.DistributedOptimizer's."""
    options = ReduceOptions(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                            device_dense=device_dense, device_sparse=device_sparse,
                            backward_passes_per_step=backward_passes_per_step,
                            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
                            groups=groups, bucket_cap_bytes=bucket_cap_bytes,
                            gradient_predivide_factor=gradient_predivide_factor, process_set=process_set,
                            scale_local_gradients=scale_local_gradients)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return DistributedV1Optimizer(optimizer, name, use_locking, options)
    from nvgroup_tf.keras import optimizer as keras_optimizer
    return keras_optimizer.distribute(optimizer, name, options)


class DistributedV1Optimizer(tf.compat.v1.train.Optimizer):
    """A TF1 optimizer whose compute_gradients reduces over ranks; see the module docstring."""

    def __init__(self, optimizer, name, use_locking, options):
        if isinstance(optimizer, DistributedV1Optimizer):
            raise ValueError("DistributedOptimizer: this optimizer is already distributed")
        if options.backward_passes_per_step != 1:
            raise NotImplementedError(
                "DistributedOptimizer: backward_passes_per_step=%r is not implemented for TF1 "
                "tf.compat.v1.train optimizers (use 1, or a Keras optimizer)" % (options.backward_passes_per_step,))
        name = name or "Distributed%s" % type(optimizer).__name__
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._nvg_reducer = GradientReducer(options, name_prefix=name)

    @property
    def _local_vars(self):
        """Horovod's: the set of `v.ref()` of the local variables."""
        return set(self._nvg_reducer.local_keys)

    def register_local_var(self, var):
        """Horovod: the gradient of `var` (a variable or its `v.ref()`) stays this rank's own."""
        self._nvg_reducer.register_local_var(var)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's (gradient, variable) pairs, gradients reduced over ranks."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads, variables = zip(*pairs)
        return list(zip(self._nvg_reducer.reduce(list(grads), list(variables)), variables))

    def apply_gradients(self, *args, **kwargs):
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)
