"""Process-level API: init/shutdown and the topology queries.

The op library and its C entry points are loaded by nvgroup_tf/op_library.py
(Note [One engine per process] there); process sets live in process_sets.py,
which init() and shutdown() call into (that module does not import this one).
"""
from __future__ import annotations

import atexit
import os
from typing import Any, Optional, Sequence, Union

import tensorflow as tf

from nvgroup_tf import process_sets as _process_sets
from nvgroup_tf.exceptions import NOT_INITIALIZED_MESSAGE
# _load, op_module and LIBRARY_PATH stay reachable as nvgroup_tf.basics.* (mpi_ops, the launcher).
from nvgroup_tf.op_library import (LIBRARY_PATH, _call, _load, _topology, agreed_setting_value,  # noqa: F401
                                   op_module, setting_value)

_init_comm = None  # what the last init() got; nvgroup_tf.elastic re-initializes over it
_atexit_registered = False


def init(comm: Any = None, process_sets: Optional[Sequence[_process_sets.ProcessSet]] = None) -> None:
    """Initializes nvgroup_tf over `comm` (an mpi4py communicator; None = COMM_WORLD).

    Collective: every rank of the communicator must call it. Initializes MPI
    (MPI_THREAD_MULTIPLE) unless mpi4py or someone else already did; in both
    cases mpi4py can be used alongside. Idempotent while initialized.
    """
    global _atexit_registered
    if comm is None:
        comm_fortran = -1
    elif isinstance(comm, (list, tuple)):
        raise ValueError(
            "nvgroup_tf.init(comm) takes an mpi4py communicator, not a list of ranks; build "
            "one with mpi4py, e.g. MPI.COMM_WORLD.Create_group(MPI.COMM_WORLD.group.Incl(ranks)).")
    elif hasattr(comm, "py2f"):
        comm_fortran = comm.py2f()
    else:
        raise TypeError("nvgroup_tf.init(comm): comm must be None or an mpi4py communicator, "
                        "got %s" % type(comm).__name__)
    handle, _ = _load()
    already_initialized = bool(handle.nvgroup_tf_is_initialized())
    _call("nvgroup_tf.init", handle.nvgroup_tf_init, comm_fortran)
    global _init_comm
    _init_comm = comm
    # init(process_sets=[ProcessSet(...), ...]): registered in order.
    _process_sets._register_static(process_sets, already_initialized)
    if not _atexit_registered:
        atexit.register(_shutdown_at_exit)
        _atexit_registered = True


# Horovod's HorovodBasics process-set queries, which Horovod's own tests call as
# hvd.mpi_ops._basics.<name> (nvgroup_tf.mpi_ops._basics is this module).
_get_process_set_ids_and_ranks = _process_sets._get_process_set_ids_and_ranks
_process_set_size = _process_sets._process_set_size_of_id


def _process_set_rank(process_set_id):
    """This process's rank within the set with this id; ValueError if it is not a member."""
    if process_set_id == 0:
        return rank()
    r = _process_sets._process_set_rank(process_set_id)
    if r < 0:
        raise ValueError("Process is not part of process set %d." % process_set_id)
    return r


def shutdown() -> None:
    """Stops the engine; collectives in flight fail with tf.errors.AbortedError."""
    handle, _ = _load()
    _call("nvgroup_tf.shutdown", handle.nvgroup_tf_shutdown)
    _process_sets._reset_after_shutdown()  # every set is gone


def _shutdown_at_exit():
    # Shut the engine's thread down before MPI is finalized, then finalize MPI
    # if the engine initialized it, so that mpirun sees every rank exit 0.
    handle, _ = _load()
    try:
        if handle.nvgroup_tf_is_initialized():
            _call("nvgroup_tf.shutdown", handle.nvgroup_tf_shutdown)
        _call("MPI finalization", handle.nvgroup_tf_finalize_mpi)
    except Exception as e:  # noqa: BLE001 -- nothing may raise out of atexit
        print("nvgroup_tf: at exit: %s" % e, flush=True)


def is_initialized() -> bool:
    handle, _ = _load()
    return bool(handle.nvgroup_tf_is_initialized())


def rank() -> int:
    """This process's rank in the communicator given to init()."""
    return _topology("rank")


def size() -> int:
    return _topology("size")


def local_rank() -> int:
    """Rank among the processes of this node."""
    return _topology("local_rank")


def local_size() -> int:
    return _topology("local_size")


def cross_rank() -> int:
    """Index of this node."""
    return _topology("cross_rank")


def cross_size() -> int:
    """Number of nodes."""
    return _topology("cross_size")


def is_homogeneous() -> bool:
    """True when every node runs the same number of ranks (agreed by all ranks at init)."""
    return bool(_topology("is_homogeneous"))


def mpi_threads_supported() -> bool:
    """True when MPI provides MPI_THREAD_MULTIPLE (init() asks for it unless MPI was
    initialized before, e.g. by mpi4py)."""
    return bool(_topology("mpi_threads_supported"))


# ---- Topology as TF ops (Horovod's rank_op, size_op, ...) -------------------
# The value is read when the op runs (ops/nvgroup_topology_ops.cc), so a graph
# built before init() reports the engine it runs against. Before init() the op
# fails with tf.errors.FailedPreconditionError when it runs.

def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """An int32 scalar op: this process's rank, read at execution time."""
    return op_module().nvgroup_rank(name=name)


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """An int32 scalar op: the number of ranks of the process set (0 = all ranks),
    read at execution time; an unknown set fails with InvalidArgumentError then."""
    return op_module().nvgroup_size(process_set_id=int(process_set_id), name=name)


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """An int32 scalar op: the rank on this node, read at execution time."""
    return op_module().nvgroup_local_rank(name=name)


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """An int32 scalar op: the number of ranks on this node, read at execution time."""
    return op_module().nvgroup_local_size(name=name)


def cross_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """An int32 scalar op: the index of this node, read at execution time."""
    return op_module().nvgroup_cross_rank(name=name)


def cross_size_op(name: Optional[str] = None) -> tf.Tensor:
    """An int32 scalar op: the number of nodes, read at execution time."""
    return op_module().nvgroup_cross_size(name=name)


for _op_name in ("NvgroupRank", "NvgroupSize", "NvgroupLocalRank", "NvgroupLocalSize",
                 "NvgroupCrossRank", "NvgroupCrossSize"):
    tf.no_gradient(_op_name)


# ---- Timeline at run time ----------------------------------------------------

def start_timeline(file_path: Union[str, os.PathLike], mark_cycles: bool = False) -> None:
    """Starts writing the Chrome-trace timeline to `file_path` (rank 0 writes, as with
    NVGROUP_TIMELINE; an open timeline is closed first). mark_cycles=True adds a
    CYCLE_START instant event for every engine cycle that runs collectives.
    Returns once the engine has opened the file. Raises ValueError before init()."""
    handle, _ = _load()
    if not handle.nvgroup_tf_is_initialized():
        raise ValueError(NOT_INITIALIZED_MESSAGE)
    if not file_path:
        raise ValueError("start_timeline: file_path must be a non-empty path")
    _call("nvgroup_tf.start_timeline", handle.nvgroup_tf_start_timeline,
          os.fsencode(file_path), 1 if mark_cycles else 0)


def stop_timeline() -> None:
    """Stops the timeline and closes its file (valid JSON once this returns).
    Raises ValueError before init()."""
    handle, _ = _load()
    if not handle.nvgroup_tf_is_initialized():
        raise ValueError(NOT_INITIALIZED_MESSAGE)
    _call("nvgroup_tf.stop_timeline", handle.nvgroup_tf_stop_timeline)


# Build information, under the names Horovod users query.
def mpi_built() -> bool:
    return True


def mpi_enabled() -> bool:
    return True


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def sycl_built() -> bool:
    # Horovod added it after 0.28.1; its current examples call it to choose
    # between "XPU" and "GPU" devices.
    return False


def cuda_built() -> bool:
    """True when the op library carries the DEVICE_GPU kernels."""
    handle, _ = _load()
    return bool(handle.nvgroup_tf_cuda_built())
