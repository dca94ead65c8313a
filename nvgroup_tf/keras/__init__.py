"""`import nvgroup_tf.keras as hvd`: Horovod's Keras API over nvgroup_tf.

Re-exports the core API (init, size, rank, allreduce, ..., Average, Sum,
Compression) and adds DistributedOptimizer, broadcast_global_variables and the
callbacks (also reachable as hvd.callbacks.X), so a Horovod Keras script ports
by changing its import line. Works with Keras 3 (tf.keras in TF >= 2.16) and,
under TF_USE_LEGACY_KERAS=1, with tf_keras.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import tensorflow as tf

import nvgroup_tf as _core
from nvgroup_tf import (Average, Compression, Max, Min, Product, Sum,  # noqa: F401
                        allgather_object, broadcast_object,
                        broadcast_variables, cross_rank, cross_size, grouped_allreduce, init,
                        is_initialized, local_rank, local_size, rank, shutdown, size)
from nvgroup_tf.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape  # noqa: F401
from nvgroup_tf.keras import callbacks  # noqa: F401
from nvgroup_tf.keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer  # noqa: F401
from nvgroup_tf.keras import compat as _compat  # noqa: E402

# What Horovod's Keras examples do that Keras 3 refuses by itself (compile's
# experimental_run_tf_function, opt.variables(), opt.lr): nvgroup_tf/keras/compat.py.
_compat.install()

if TYPE_CHECKING:
    import os

    from nvgroup_tf.compression import Compressor


# Horovod's Keras-level collectives take a value (numpy, Python or tensor) and
# `name` names the constant made from it (as in horovod.tensorflow.keras).
def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: Optional[int] = None,
              compression: type[Compressor] = Compression.none) -> tf.Tensor:
    """Horovod's keras allreduce(value, name=None, average=None, ...): the value
    reduced over ranks (Average unless op or average=False says otherwise)."""
    if op is not None and average is not None:
        raise ValueError("allreduce: pass either op or average, not both")
    if op is None:
        op = Average if average is None or average else Sum
    return _core.allreduce(tf.constant(value, name=name), op=op, prescale_factor=prescale_factor,
                           postscale_factor=postscale_factor, compression=compression)


def allgather(value: Any, name: Optional[str] = None) -> tf.Tensor:
    """Horovod's keras allgather(value, name=None)."""
    return _core.allgather(tf.constant(value, name=name))


def broadcast(value: Any, root_rank: int, name: Optional[str] = None) -> tf.Tensor:
    """Horovod's keras broadcast(value, root_rank, name=None)."""
    return _core.broadcast(tf.constant(value, name=name), root_rank)


def broadcast_global_variables(root_rank: int) -> tf.Operation:
    """Broadcasts all global variables from root_rank (TF1-style graph mode).

    TF2 eager code has no global-variable collection: use
    hvd.broadcast_variables(model.variables, root_rank) or the
    BroadcastGlobalVariablesCallback instead (Horovod raises the same way)."""
    if tf.executing_eagerly():
        raise RuntimeError("broadcast_global_variables() does not support eager execution; use "
                           "hvd.broadcast_variables(model.variables + optimizer.variables, root_rank) "
                           "or hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank)")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank,
                               name="nvg_broadcast_global_variables")


def load_model(filepath: Union[str, os.PathLike], custom_optimizers: Optional[Sequence[type]] = None,
               custom_objects: Optional[dict[str, Any]] = None, compression: Optional[type[Compressor]] = None,
               **kwargs: Any) -> Any:
    """Loads a Keras model saved with model.save() (Horovod's hvd.load_model):
    its optimizer comes back distributed, with the saved state (iterations,
    moments). A DistributedOptimizer saved by nvgroup_tf is rebuilt as one; a
    plain optimizer is made distributed in place. `compression` and `kwargs`
    (DistributedOptimizer's arguments) set its reduction; custom_optimizers are
    classes of custom optimizers the file may contain."""
    import keras
    from nvgroup_tf.keras import optimizer as dist
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects.setdefault(cls.__name__, cls)
        distributed = dist.distributed_class(cls)
        objects["nvgroup_tf>" + distributed.__name__] = distributed
    model = keras.models.load_model(filepath, custom_objects=objects)
    if _compat.is_hdf5_path(filepath):  # Keras 3's .h5 loader builds the optimizer on no variables
        model = _compat.restore_hdf5_optimizer(model, filepath)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        settings = dict(kwargs)
        if compression is not None:
            settings["compression"] = compression
        dist.make_distributed_in_place(optimizer, **settings)
        # load_model may have compiled the model before its optimizer became
        # distributed: drop the train function built for the old optimizer.
        model.train_function = None
    return model


# The rest of horovod.tensorflow.keras's small names and hvd.elastic.
from nvgroup_tf import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,  # noqa: E402,F401
                        is_homogeneous, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                        rocm_built, start_timeline, stop_timeline, sycl_built)
from nvgroup_tf.keras import elastic  # noqa: E402,F401
from nvgroup_tf.process_sets import (ProcessSet, add_process_set,  # noqa: E402,F401
                                     global_process_set, remove_process_set)


def reducescatter(value: Any, name: Optional[str] = None, op: int = Average) -> tf.Tensor:
    """Horovod's keras reducescatter(value, name=None, op=Average): `value`
    (numpy, Python or tensor; `name` names its constant) reduced over ranks,
    this rank's share of dimension 0."""
    return _core.reducescatter(tf.constant(value, name=name), op=op)
