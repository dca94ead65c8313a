"""DistributedGradientTape: tf.GradientTape whose gradient() returns gradients
reduced over all ranks (custom training loops; Horovod's API).

    with tf.GradientTape() as tape:
        loss = ...
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)

How it works: the returned object is a tf.GradientTape of the same class that
takes over the recorded tape (the tape's internal state, as Horovod does), so
`gradient()` first computes the local gradients, then reduces them with the
same bucketed path as DistributedOptimizer (nvgroup_tf/gradient_reducer.py: unique
names per tape and per gradient() call inside a graph; one traced function
when called eagerly). Sources are identified by their `.path` (Keras 3
variables) or `.name`; nested source structures come back in the same
structure. `register_local_source(var)` / PartialDistributedGradientTape's
`local_layers` keep some gradients local (Horovod); `get_local_and_global_gradients`
returns the local and the reduced (source, gradient) pairs apart.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import tensorflow as tf

from nvgroup_tf.gradient_reducer import GradientReducer, ReduceOptions, local_layers_variables

if TYPE_CHECKING:
    from nvgroup_tf.compression import Compressor
    from nvgroup_tf.process_sets import ProcessSet


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                            compression: Optional[type[Compressor]] = None, sparse_as_dense: bool = False,
                            op: Optional[int] = None, gradient_predivide_factor: float = 1.0,
                            num_groups: int = 0, groups: Optional[Union[int, Sequence[Sequence[tf.Variable]]]] = None,
                            process_set: Optional[ProcessSet] = None, scale_local_gradients: bool = True,
                            bucket_cap_bytes: Optional[int] = None, persistent: Optional[bool] = None,
                            watch_accessed_variables: Optional[bool] = None) -> tf.GradientTape:
    """Wraps `gradtape`. Arguments as Horovod's (compression defaults to
    Compression.none, op to Average; op must be Average or Sum; process_set:
    None, the global set or a registered ProcessSet), plus bucket_cap_bytes as DistributedOptimizer's."""
    options = ReduceOptions(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                            device_dense=device_dense, device_sparse=device_sparse, num_groups=num_groups,
                            groups=groups, bucket_cap_bytes=bucket_cap_bytes,
                            gradient_predivide_factor=gradient_predivide_factor, process_set=process_set,
                            scale_local_gradients=scale_local_gradients)
    return distribute_tape(gradtape, options, persistent=persistent,
                           watch_accessed_variables=watch_accessed_variables)


def distribute_tape(gradtape, options, persistent=None, watch_accessed_variables=None):
    """DistributedGradientTape(gradtape, **options' fields)."""
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError("DistributedGradientTape expects a tf.GradientTape, got %s" % type(gradtape).__name__)
    from nvgroup_tf.keras import compat
    compat.install()  # Keras 3 shims for Horovod programs: opt.variables(), opt.lr, ...
    reducer = GradientReducer(options, name_prefix="DistributedGradientTape")
    cls = type(gradtape)
    if issubclass(cls, _DistributedTapeMixin):
        raise ValueError("DistributedGradientTape: this tape is already distributed")
    dist_cls = type("Distributed" + cls.__name__, (_DistributedTapeMixin, cls), {})
    tape = dist_cls(persistent=gradtape._persistent if persistent is None else persistent,
                    watch_accessed_variables=(gradtape._watch_accessed_variables
                                              if watch_accessed_variables is None else watch_accessed_variables))
    # Take over what `gradtape` recorded (tf.GradientTape's state in TF 2.x).
    tape._tape = gradtape._tape
    tape._recording = gradtape._recording
    tape._watched_variables = gradtape._watched_variables
    tape._nvg_reducer = reducer
    return tape


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                                   compression: Optional[type[Compressor]] = None,
                                   sparse_as_dense: bool = False, op: Optional[int] = None,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Optional[Union[int, Sequence[Sequence[tf.Variable]]]] = None, process_set: Optional[ProcessSet] = None,
                                   local_layers: Any = None, scale_local_gradients: bool = True,
                                   bucket_cap_bytes: Optional[int] = None) -> tf.GradientTape:
    """Horovod's PartialDistributedGradientTape: the trainable weights of
    `local_layers` (a Keras layer or a list of them) keep local gradients."""
    local_vars = local_layers_variables(local_layers)
    options = ReduceOptions(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                            device_dense=device_dense, device_sparse=device_sparse, num_groups=num_groups,
                            groups=groups, bucket_cap_bytes=bucket_cap_bytes,
                            gradient_predivide_factor=gradient_predivide_factor, process_set=process_set,
                            scale_local_gradients=scale_local_gradients)
    tape = distribute_tape(gradtape, options)
    for var in local_vars:
        tape.register_local_source(var)
    return tape


class _DistributedTapeMixin:
    @property
    def _local_sources(self):
        """Horovod's: the set of `s.ref()` of the local sources."""
        return set(self._nvg_reducer.local_keys)

    def register_local_source(self, source):
        """Horovod: the gradient for `source` (a variable, a watched tensor, or
        its `.ref()`) is this rank's own (not reduced; divided by size() when
        scale_local_gradients)."""
        self._nvg_reducer.register_local_var(source)

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False, **kwargs):
        # use_generic_names: Horovod's argument (names of its ops); accepted, no effect here.
        grads = super().gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        reduced = self._nvg_reducer.reduce(flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """Horovod's: gradient() split into two lists of (source, gradient)
        pairs, in source order: the registered local sources' (not reduced;
        divided by size() when scale_local_gradients) and the others' (reduced)."""
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(self.gradient(target, sources, output_gradients=output_gradients))
        local_vars = self._nvg_reducer.local_vars
        local_pairs, global_pairs = [], []
        for s, g in zip(flat_sources, flat_grads):
            (local_pairs if any(s is v for v in local_vars) else global_pairs).append((s, g))
        return local_pairs, global_pairs
