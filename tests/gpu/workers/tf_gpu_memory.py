"""The registered GPU memory is taken at hvd.init(), and its absence is a
clear error, not a crash or a hang.

    tf_gpu_memory.py after_init    init, TF takes its pool, then the rest of the
                                   GPU's memory is taken (as TF does without a
                                   memory limit): GPU collectives must still run
    tf_gpu_memory.py before_init   rank 0 takes nearly all of the GPU's memory
                                   before init: init must fail on every rank
                                   with an error naming GPU memory
Prints "[rank r] PASSED" when its checks hold.
"""
import ctypes
import sys

import numpy as np
from mpi4py import MPI

from gpu_common import GPU, Checker, hvd, init_on_gpu, run, tf

SPARE = 40 << 20  # left free: less than the registered buffer needs (>= 64 MiB)


def cudart():
    for name in ("libcudart.so.12", "libcudart.so.13", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("no CUDA runtime library to take GPU memory with")


def take_gpu_memory(rt, device):
    """cudaMalloc's all but SPARE bytes of the device's free memory; returns
    the bytes taken (kept until the process exits)."""
    if rt.cudaSetDevice(device) != 0:
        raise SystemExit("cudaSetDevice(%d) failed" % device)
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    if rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) != 0:
        raise SystemExit("cudaMemGetInfo failed")
    taken = 0
    chunk = 1 << 30
    while free.value - taken > SPARE:
        want = min(chunk, free.value - taken - SPARE)
        p = ctypes.c_void_p()
        if rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(want)) != 0:
            if chunk <= (8 << 20):
                break
            chunk //= 2
            continue
        taken += want
    rt.cudaGetLastError()
    return taken


def after_init(c):
    init_on_gpu(2048)
    rank, size = hvd.rank(), hvd.size()
    with tf.device(GPU):
        x = tf.constant(np.random.default_rng([1, rank]).standard_normal((1000, 33)).astype(np.float32))
        rows = tf.constant(np.random.default_rng([2, rank]).standard_normal((rank + 2, 7)).astype(np.float32))
        (x * 1.0 + rows[0, 0]).numpy()  # TF's device, pool and kernels exist before the memory goes
    MPI.COMM_WORLD.Barrier()
    if hvd.local_rank() == 0:
        taken = take_gpu_memory(cudart(), 0)
        print("[rank %d] took %d MiB of GPU memory, %d MiB left free" % (rank, taken >> 20, SPARE >> 20),
              flush=True)
    MPI.COMM_WORLD.Barrier()
    with tf.device(GPU):
        got = hvd.allreduce(x, op=hvd.Sum, name="mem.ar")
        gathered = hvd.allgather(rows, name="mem.ag")
        grouped = hvd.grouped_allreduce([x, x * 2.0], op=hvd.Average, name="mem.gar")
    want = sum(np.random.default_rng([1, r]).standard_normal((1000, 33)).astype(np.float32).astype(np.float64)
               for r in range(size))
    c.check(np.max(np.abs(got.numpy() - want)) < 1e-4 * size * 10, "allreduce with the GPU's memory taken")
    want_rows = np.concatenate([np.random.default_rng([2, r]).standard_normal((r + 2, 7)).astype(np.float32)
                                for r in range(size)])
    c.equal(gathered.numpy(), want_rows, "allgather with the GPU's memory taken")
    c.check(np.max(np.abs(grouped[1].numpy() - 2 * want / size)) < 1e-3, "grouped allreduce with the memory taken")


def before_init(c):
    rank = MPI.COMM_WORLD.rank
    local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    rt = cudart()
    # Every rank's CUDA context exists first (TF or another library made it),
    # so what is missing at init is the memory for the registered buffers.
    if rt.cudaSetDevice(0) != 0 or rt.cudaFree(None) != 0:
        raise SystemExit("rank %d: no CUDA context" % rank)
    local.Barrier()
    if local.rank == 0:
        taken = take_gpu_memory(rt, 0)
        print("[rank %d] took %d MiB of GPU memory before init" % (rank, taken >> 20), flush=True)
    local.Barrier()
    try:
        hvd.init()
    except Exception as e:  # noqa: BLE001
        text = str(e)
        print("[rank %d] init raised %s: %s" % (rank, type(e).__name__, text), flush=True)
        c.check("GPU memory" in text and "out of memory" in text,
                "init's error names GPU memory and CUDA's reason: %r" % text)
        c.check(not hvd.is_initialized(), "not initialized after the failed init")
        return
    c.check(False, "init succeeded with the GPU's memory taken")


def main():
    mode = sys.argv[1]
    c = Checker("tf_gpu_memory " + mode)
    {"after_init": after_init, "before_init": before_init}[mode](c)
    c.finish()
    print("[rank %d] PASSED" % MPI.COMM_WORLD.rank, flush=True)


if __name__ == "__main__":
    run(main)
