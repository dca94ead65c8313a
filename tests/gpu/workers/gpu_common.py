"""Shared by the TF GPU workers: puts this rank on its GPU and reuses the TF
suite's checks and references (tests/tf/workers/common.py).

Every rank sees one GPU, local_rank % GPUs (Horovod's convention; 2-4 ranks
share the GPU of a one-GPU machine). TensorFlow gets a fixed memory pool of
NVGROUP_TEST_GPU_MB (default 6144) MiB instead of nearly all of the GPU, so the
ranks sharing it fit side by side.
"""
import hashlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tf", "workers"))

from common import (ALL_DTYPES, FLOAT_DTYPES, INT_DTYPES, REDUCE_DTYPES, Checker, hvd,  # noqa: E402,F401
                    check_reduced, magnitude, per_rank, random_array, reference, run, shape_for, tf,
                    to_numpy)

tf.get_logger().setLevel("ERROR")  # one tf.function per case: retracing warnings are expected
GPU = "/GPU:0"
# Runs the workers' logic on the CPU build (placement checks off) to debug the
# test code itself on a machine without a GPU; never set by the tests.
DRY_RUN = os.environ.get("NVGROUP_TEST_CPU_DRY_RUN") == "1"


def init_on_gpu(memory_mb=None):
    """hvd.init(), then TF on this rank's GPU with a fixed memory pool."""
    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus and DRY_RUN:
        return None
    if not gpus:
        raise SystemExit("rank %d: TensorFlow sees no GPU" % hvd.rank())
    gpu = gpus[hvd.local_rank() % len(gpus)]
    tf.config.set_visible_devices(gpu, "GPU")
    mb = memory_mb if memory_mb is not None else int(os.environ.get("NVGROUP_TEST_GPU_MB", "6144"))
    tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=mb)])
    return gpu


def on_gpu(t):
    return DRY_RUN or t.device.endswith("GPU:0")


class Digests:
    """Bitwise comparison of results across ranks: every result's bytes are
    hashed under a name; compare() gathers all ranks' lists and checks each
    against rank 0's."""

    def __init__(self):
        self.items = []

    def add(self, what, t):
        a = t.numpy() if hasattr(t, "numpy") else t
        self.items.append((what, hashlib.sha256(a.tobytes()).hexdigest() + str(a.shape) + str(a.dtype)))

    def compare(self, c):
        gathered = hvd.allgather_object(self.items)
        mine = gathered[hvd.rank()]
        c.check(len(mine) == len(gathered[0]), "%d results here, %d on rank 0" % (len(mine), len(gathered[0])))
        for (what, d), (what0, d0) in zip(mine, gathered[0]):
            c.check(what == what0 and d == d0, "result %s differs bitwise from rank 0's (%s)" % (what, what0))


def event_stats():
    """(cudaEvents created, readiness records) of the GPU kernels' event pool."""
    import ctypes

    from nvgroup_tf import basics
    handle = basics._load()[0]
    created, recorded = ctypes.c_int64(0), ctypes.c_int64(0)
    handle.nvgroup_tf_gpu_event_stats(ctypes.byref(created), ctypes.byref(recorded))
    return created.value, recorded.value
