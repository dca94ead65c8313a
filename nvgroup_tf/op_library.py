"""The op library nvgroup_tf/lib/libnvgroup_tf_ops.so: loading it (once per
process), its extern "C" entry points (ops/c_api.cc) and their status, and the
topology queries. basics (init, shutdown, rank, ...) and process_sets build on
this module; it imports neither.

Note [One engine per process]. The engine (cc/) is linked into the TF op library.
This module loads that library twice by the same path -- tf.load_op_library for
the ops, ctypes for the extern "C" entry points -- and the dynamic loader returns
the same handle, so init() and the ops talk to one engine. The pybind11 module
nvgroup_tf._engine contains a second copy of the engine for non-TF use and is
never imported here.
"""
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

_load_lock = threading.Lock()
_library = None  # (ctypes.CDLL, op module) once loaded


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
        handle.nvgroup_tf_set_bucket_delay_for_testing.argtypes = [ctypes.c_double]
        handle.nvgroup_tf_set_bucket_delay_for_testing.restype = None
        handle.nvgroup_tf_delayed_buckets_for_testing.argtypes = []
        handle.nvgroup_tf_delayed_buckets_for_testing.restype = ctypes.c_int64
        handle.nvgroup_tf_grouped_submission_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)] * 3
        handle.nvgroup_tf_grouped_submission_stats.restype = None
        for fn in ("nvgroup_tf_setting_value", "nvgroup_tf_agreed_setting_value"):
            getattr(handle, fn).argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                            ctypes.c_char_p, ctypes.c_int]
        _register_xla_kernels(handle)
        _library = (handle, ops)
        return _library


@tf.autograph.experimental.do_not_convert
def _register_xla_kernels(handle):
    """The collectives' XLA kernels (ops/xla_lowering.cc) are registered right after
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


def agreed_setting_value(name):
    """The agreed NVGROUP_* setting `name` (scope "agreed" in docs/SETTINGS.md)
    as every rank agreed it at init: its normalized value as text. The
    front end's run-time source of agreed settings (the environment may have
    changed since init, and may differ between ranks). Raises ValueError
    before init or for a setting that is not agreed."""
    handle, _ = _load()
    value = ctypes.create_string_buffer(_MESSAGE_BYTES)
    message = ctypes.create_string_buffer(_MESSAGE_BYTES)
    if handle.nvgroup_tf_agreed_setting_value(name.encode(), value, _MESSAGE_BYTES, message, _MESSAGE_BYTES) != 0:
        raise ValueError(message.value.decode(errors="replace"))
    return value.value.decode(errors="replace")


def set_bucket_delay_for_testing(microseconds):
    """Tests and benchmarks only: the simulated link (NVGROUP_TEST_BUCKET_DELAY_US),
    a delay of `microseconds` added to every allreduce bucket on the engine's
    stream from the next bucket on; 0 removes it."""
    handle, _ = _load()
    handle.nvgroup_tf_set_bucket_delay_for_testing(float(microseconds))


def grouped_submission_stats():
    """Tests and benchmarks: what this process's grouped allreduces (TF kernels
    and XLA calls, ops/grouped_submissions.h) did so far:
    {"registrations", "launches", "by_name"}, counts of successful group
    registrations, steps launched through one, and steps submitted by name."""
    handle, _ = _load()
    values = [ctypes.c_int64(0) for _ in range(3)]
    handle.nvgroup_tf_grouped_submission_stats(*[ctypes.byref(v) for v in values])
    return dict(zip(("registrations", "launches", "by_name"), (int(v.value) for v in values)))


def delayed_buckets_for_testing():
    """Tests and benchmarks only: how many buckets the simulated link delayed in
    this process so far (the link time it added is this count times the delay)."""
    handle, _ = _load()
    return int(handle.nvgroup_tf_delayed_buckets_for_testing())


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


