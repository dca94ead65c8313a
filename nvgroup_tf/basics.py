"""Process-level API: init/shutdown and the topology queries.

Note [One engine per process]. The engine (cc/) is linked into the TF op library
nvgroup_tf/lib/libnvgroup_tf_ops.so. This module loads that library twice by the
same path -- tf.load_op_library for the ops, ctypes for the extern "C" entry
points of ops/c_api.cc -- and the dynamic loader returns the same handle, so
init() and the ops talk to one engine. The pybind11 module nvgroup_tf._engine
contains a second copy of the engine for non-TF use and is never imported here.
"""
import atexit
import ctypes
import ctypes.util
import os
import threading
import warnings

import tensorflow as tf

from nvgroup_tf.exceptions import NOT_INITIALIZED_MESSAGE, raise_for_status

LIBRARY_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib",
                            "libnvgroup_tf_ops.so")
_MESSAGE_BYTES = 4096

_init_comm = None  # what the last init() got; nvgroup_tf.elastic re-initializes over it
_load_lock = threading.Lock()
_library = None  # (ctypes.CDLL, op module) once loaded
_atexit_registered = False


def _load():
    """Loads the op library once; returns (ctypes handle, TF op module)."""
    global _library
    with _load_lock:
        if _library is not None:
            return _library
        if not os.path.exists(LIBRARY_PATH):
            raise ImportError(
                "%s is missing: build nvgroup_tf first ('bash scripts/setup.sh', or "
                "'python setup.py build_ext --inplace' in the repository)." % LIBRARY_PATH)
        # Open MPI loads its transport plugins with dlopen at MPI_Init; they
        # resolve symbols of libmpi globally, which fails if libmpi came in
        # RTLD_LOCAL as a dependency of a TF op library.
        libmpi = ctypes.util.find_library("mpi")
        if libmpi:
            ctypes.CDLL(libmpi, mode=ctypes.RTLD_GLOBAL)
        # The op library first: TF collects the ops registered while *it*
        # loads the library; a prior ctypes load would register them unseen.
        ops = tf.load_op_library(LIBRARY_PATH)
        handle = ctypes.CDLL(LIBRARY_PATH, mode=ctypes.RTLD_GLOBAL)
        for fn in ("nvgroup_tf_init",):
            getattr(handle, fn).argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_int]
        for fn in ("nvgroup_tf_shutdown", "nvgroup_tf_finalize_mpi"):
            getattr(handle, fn).argtypes = [ctypes.c_char_p, ctypes.c_int]
        for fn in list(_TOPOLOGY_FUNCTIONS.values()) + list(_ENGINE_FLAGS.values()):
            getattr(handle, fn).argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_char_p,
                                            ctypes.c_int]
        handle.nvgroup_tf_start_timeline.argtypes = [ctypes.c_char_p, ctypes.c_int,
                                                     ctypes.c_char_p, ctypes.c_int]
        handle.nvgroup_tf_stop_timeline.argtypes = [ctypes.c_char_p, ctypes.c_int]
        handle.nvgroup_tf_setting_value.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                                    ctypes.c_char_p, ctypes.c_int]
        _register_xla_kernels(handle)
        _library = (handle, ops)
        return _library


@tf.autograph.experimental.do_not_convert
def _register_xla_kernels(handle):
    """The collectives' XLA kernels (ops/xla_ops.cc) are registered right after
    the library loads: TF takes XLA kernels in only once per process, at its
    first XLA compilation; warns if that has already happened."""
    message = ctypes.create_string_buffer(_MESSAGE_BYTES)
    if handle.nvgroup_tf_register_xla_kernels(message, _MESSAGE_BYTES) != 0:
        warnings.warn(message.value.decode(errors="replace"), RuntimeWarning)


def op_module():
    """The generated TF op wrappers (nvgroup_allreduce, ...)."""
    return _load()[1]


def _call(what, fn, *args):
    message = ctypes.create_string_buffer(_MESSAGE_BYTES)
    code = fn(*args, message, _MESSAGE_BYTES)
    raise_for_status(code, message.value.decode(errors="replace"), what)


def setting_value(name):
    """The NVGROUP_* variable `name` as the library's settings table parses it
    from the environment now (cc/common/env.h, docs/SETTINGS.md): its
    normalized value as text, the default when unset. A malformed value raises
    ValueError naming the variable, the value and what was expected."""
    handle, _ = _load()
    value = ctypes.create_string_buffer(_MESSAGE_BYTES)
    message = ctypes.create_string_buffer(_MESSAGE_BYTES)
    if handle.nvgroup_tf_setting_value(name.encode(), value, _MESSAGE_BYTES, message, _MESSAGE_BYTES) != 0:
        raise ValueError(message.value.decode(errors="replace"))
    return value.value.decode(errors="replace")


def init(comm=None, process_sets=None):
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
    _call("nvgroup_tf.init", handle.nvgroup_tf_init, comm_fortran)
    global _init_comm
    _init_comm = comm
    # init(process_sets=[ProcessSet(...), ...]): registered in order (coll).
    from nvgroup_tf import process_sets as _process_sets
    _process_sets._register_static(process_sets)
    if not _atexit_registered:
        atexit.register(_shutdown_at_exit)
        _atexit_registered = True


def shutdown():
    """Stops the engine; collectives in flight fail with tf.errors.AbortedError."""
    handle, _ = _load()
    _call("nvgroup_tf.shutdown", handle.nvgroup_tf_shutdown)
    from nvgroup_tf import process_sets as _process_sets  # every set is gone (coll)
    _process_sets._reset_after_shutdown()


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


def is_initialized():
    handle, _ = _load()
    return bool(handle.nvgroup_tf_is_initialized())


_TOPOLOGY_FUNCTIONS = {
    "rank": "nvgroup_tf_rank",
    "size": "nvgroup_tf_size",
    "local_rank": "nvgroup_tf_local_rank",
    "local_size": "nvgroup_tf_local_size",
    "cross_rank": "nvgroup_tf_cross_rank",
    "cross_size": "nvgroup_tf_cross_size",
}


# Flags the engine settles at init (ops/c_api.cc), queried like the topology.
_ENGINE_FLAGS = {
    "mpi_threads_supported": "nvgroup_tf_mpi_threads_supported",
    "is_homogeneous": "nvgroup_tf_is_homogeneous",
}


def _topology(query):
    handle, _ = _load()
    if not handle.nvgroup_tf_is_initialized():
        raise ValueError(NOT_INITIALIZED_MESSAGE)
    value = ctypes.c_int(-1)
    function = _TOPOLOGY_FUNCTIONS.get(query) or _ENGINE_FLAGS[query]
    _call("nvgroup_tf.%s()" % query, getattr(handle, function), ctypes.byref(value))
    return value.value


def rank():
    """This process's rank in the communicator given to init()."""
    return _topology("rank")


def size():
    return _topology("size")


def local_rank():
    """Rank among the processes of this node."""
    return _topology("local_rank")


def local_size():
    return _topology("local_size")


def cross_rank():
    """Index of this node."""
    return _topology("cross_rank")


def cross_size():
    """Number of nodes."""
    return _topology("cross_size")


def is_homogeneous():
    """True when every node runs the same number of ranks (agreed by all ranks at init)."""
    return bool(_topology("is_homogeneous"))


def mpi_threads_supported():
    """True when MPI provides MPI_THREAD_MULTIPLE (init() asks for it unless MPI was
    initialized before, e.g. by mpi4py)."""
    return bool(_topology("mpi_threads_supported"))


# ---- Topology as TF ops (Horovod's rank_op, size_op, ...) -------------------
# The value is read when the op runs (ops/nvgroup_topology_ops.cc), so a graph
# built before init() reports the engine it runs against. Before init() the op
# fails with tf.errors.FailedPreconditionError when it runs.

def rank_op(name=None):
    """An int32 scalar op: this process's rank, read at execution time."""
    return op_module().nvgroup_rank(name=name)


def size_op(process_set_id=0, name=None):
    """An int32 scalar op: the number of ranks of the process set (0 = all ranks),
    read at execution time; an unknown set fails with InvalidArgumentError then."""
    return op_module().nvgroup_size(process_set_id=int(process_set_id), name=name)


def local_rank_op(name=None):
    """An int32 scalar op: the rank on this node, read at execution time."""
    return op_module().nvgroup_local_rank(name=name)


def local_size_op(name=None):
    """An int32 scalar op: the number of ranks on this node, read at execution time."""
    return op_module().nvgroup_local_size(name=name)


def cross_rank_op(name=None):
    """An int32 scalar op: the index of this node, read at execution time."""
    return op_module().nvgroup_cross_rank(name=name)


def cross_size_op(name=None):
    """An int32 scalar op: the number of nodes, read at execution time."""
    return op_module().nvgroup_cross_size(name=name)


for _op_name in ("NvgroupRank", "NvgroupSize", "NvgroupLocalRank", "NvgroupLocalSize",
                 "NvgroupCrossRank", "NvgroupCrossSize"):
    tf.no_gradient(_op_name)


# ---- Timeline at run time ----------------------------------------------------

def start_timeline(file_path, mark_cycles=False):
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


def stop_timeline():
    """Stops the timeline and closes its file (valid JSON once this returns).
    Raises ValueError before init()."""
    handle, _ = _load()
    if not handle.nvgroup_tf_is_initialized():
        raise ValueError(NOT_INITIALIZED_MESSAGE)
    _call("nvgroup_tf.stop_timeline", handle.nvgroup_tf_stop_timeline)


# Build information, under the names Horovod users query.
def mpi_built():
    return True


def mpi_enabled():
    return True


def gloo_built():
    return False


def gloo_enabled():
    return False


def nccl_built():
    return False


def rocm_built():
    return False


def ddl_built():
    return False


def ccl_built():
    return False


def sycl_built():
    # Horovod added it after 0.28.1; its current examples call it to choose
    # between "XPU" and "GPU" devices.
    return False


def cuda_built():
    """True when the op library carries the DEVICE_GPU kernels."""
    handle, _ = _load()
    return bool(handle.nvgroup_tf_cuda_built())
