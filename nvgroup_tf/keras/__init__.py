"""`import nvgroup_tf.keras as hvd`: Horovod's Keras API over nvgroup_tf.

Re-exports the core API (init, size, rank, allreduce, ..., Average, Sum,
Compression) and adds DistributedOptimizer, broadcast_global_variables and the
callbacks (also reachable as hvd.callbacks.X), so a Horovod Keras script ports
by changing its import line. Works with Keras 3 (tf.keras in TF >= 2.16) and,
under TF_USE_LEGACY_KERAS=1, with tf_keras.
"""
import tensorflow as tf

from nvgroup_tf import (Average, Compression, Max, Min, Product, Sum, allgather,  # noqa: F401
                        allgather_object, allreduce, broadcast, broadcast_object,
                        broadcast_variables, cross_rank, cross_size, grouped_allreduce, init,
                        is_initialized, local_rank, local_size, rank, shutdown, size)
from nvgroup_tf.gradient_tape import DistributedGradientTape  # noqa: F401
from nvgroup_tf.keras import callbacks  # noqa: F401
from nvgroup_tf.optimizer import DistributedOptimizer  # noqa: F401


def broadcast_global_variables(root_rank):
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


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=None, **kwargs):
    """Loads a Keras model saved with model.save() and makes its optimizer
    distributed (Horovod's hvd.load_model). `kwargs` go to DistributedOptimizer."""
    import keras
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects[cls.__name__] = cls
    model = keras.models.load_model(filepath, custom_objects=objects)
    if getattr(model, "optimizer", None) is not None:
        model.optimizer = DistributedOptimizer(model.optimizer, compression=compression, **kwargs)
        # load_model compiled the model before its optimizer became distributed:
        # drop the train function built for the old optimizer, if any.
        model.train_function = None
    return model


# Issue 10 (api): the rest of horovod.tensorflow.keras's small names and hvd.elastic.
from nvgroup_tf import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,  # noqa: E402,F401
                        is_homogeneous, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                        rocm_built, start_timeline, stop_timeline)
from nvgroup_tf.keras import elastic  # noqa: E402,F401
