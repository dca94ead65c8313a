"""nvgroup_tf: NV-group hierarchical allreduce for TensorFlow, Horovod's API.

    import nvgroup_tf as hvd
    hvd.init()
    grad = hvd.allreduce(grad, name="grad/w")   # Average over ranks by default

The public names load lazily (PEP 562): `import nvgroup_tf` itself imports
neither TensorFlow nor the op library, so nvgroup_tf.runner (the launcher) and
nvgroup_tf._engine (the engine's pybind11 module, for machines without
TensorFlow) stay light. The first access of a name below imports its module.
"""
import importlib

_EXPORTS = {
    "nvgroup_tf.basics": [
        "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
        "cross_rank", "cross_size", "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled",
        "nccl_built", "rocm_built", "cuda_built",
    ],
    "nvgroup_tf.mpi_ops": [
        "Average", "Sum", "Adasum", "Min", "Max", "Product", "allreduce", "grouped_allreduce",
        "allgather", "broadcast",
        "reducescatter", "grouped_reducescatter", "alltoall", "grouped_allgather", "broadcast_",
        "join", "process_set_included_op",
    ],
    "nvgroup_tf.functions": ["broadcast_variables", "broadcast_object", "allgather_object"],
    "nvgroup_tf.compression": ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"],
    "nvgroup_tf.exceptions": ["NvgroupInternalError", "HorovodInternalError"],
    "nvgroup_tf.gradient_tape": ["DistributedGradientTape", "PartialDistributedGradientTape"],
    "nvgroup_tf.distributed_optimizer": ["DistributedOptimizer"],
    "nvgroup_tf.keras.optimizer": ["PartialDistributedOptimizer"],
    "nvgroup_tf.process_sets": ["ProcessSet", "add_process_set", "remove_process_set",
                                "global_process_set"],
}
# Horovod's small Python-level API: topology ops, build flags, timeline, object
# helpers, Horovod's util helpers, SyncBatchNormalization.
_EXPORTS["nvgroup_tf.basics"] += [
    "is_homogeneous", "mpi_threads_supported", "ddl_built", "ccl_built", "sycl_built", "rank_op", "size_op",
    "local_rank_op", "local_size_op", "cross_rank_op", "cross_size_op", "start_timeline",
    "stop_timeline",
]
_EXPORTS["nvgroup_tf.functions"] += [
    "broadcast_global_variables", "broadcast_object_fn", "BroadcastGlobalVariablesHook",
]
_EXPORTS["nvgroup_tf.util"] = [
    "_executing_eagerly", "_make_subgraph", "_cache", "vars_to_refs", "refs_to_vars",
    "handle_average_backwards_compatibility", "check_num_rank_power_of_2",
]
_EXPORTS["nvgroup_tf.sync_batch_norm"] = ["SyncBatchNormalization"]
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


_SUBMODULES = ("basics", "mpi_ops", "functions", "compression", "exceptions", "process_sets")
_SUBMODULES += ("util", "elastic", "sync_batch_norm")


def __getattr__(name):
    if name in _SUBMODULES:  # hvd.mpi_ops.allreduce etc., as with Horovod
        return importlib.import_module("nvgroup_tf." + name)
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError("module 'nvgroup_tf' has no attribute %r" % name)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
