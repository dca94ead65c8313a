"""Timeline worker: a fused group of allreduces, a lone allreduce, an allgather
and a broadcast with NVGROUP_TIMELINE set, then shutdown() (which closes the trace). The test reads
the file rank 0 wrote."""

import numpy as np
from mpi4py import MPI  # noqa: F401  (MPI first; the engine accepts an initialized MPI)

import nvgroup_tf._engine as engine
from rel_common import check_allreduce, run_worker, say, wait_bounded


def main():
    engine.init()
    rank, size = engine.rank(), engine.size()
    for step in range(3):
        # A group is fused whole (one bucket: fusion copies); "lone", alone in
        # its bucket, takes the same path (one bucket of one tensor).
        items, checks, keep = [], [], []
        for k in range(4):
            xs = [np.random.default_rng([step, k, r]).standard_normal(64 + k) for r in range(size)]
            y = np.empty_like(xs[rank])
            items.append(("layer%d/grad" % k, xs[rank].ctypes.data, y.ctypes.data, [xs[rank].size], "float64"))
            checks.append((y, xs))
            keep += [xs[rank], y]
        handles = engine.grouped_allreduce_async(items, keepalive=keep)
        for h in handles:
            wait_bounded(h, 60)
        xs = [np.random.default_rng([step, 9, r]).standard_normal(50) for r in range(size)]
        y = np.empty_like(xs[rank])
        wait_bounded(engine.allreduce_async("lone", xs[rank].ctypes.data, y.ctypes.data, [50], "float64", "sum",
                                            keepalive=(xs[rank], y)), 60)
        checks.append((y, xs))
        for y, xs in checks:
            why = check_allreduce(y, xs, "float64", "sum")
            if why:
                raise AssertionError(why)
    x = np.full((2, 3), rank, np.int32)
    out = wait_bounded(engine.allgather_async("gathered", x.ctypes.data, [2, 3], "int32", keepalive=x), 60)
    assert np.array_equal(out, np.repeat(np.arange(size, dtype=np.int32), 6).reshape(2 * size, 3)), out
    b = np.full(5, 10.0 + rank)
    wait_bounded(engine.broadcast_async("bcast", b.ctypes.data, b.ctypes.data, [5], "float64", 0, keepalive=b), 60)
    assert np.all(b == 10.0), b
    engine.shutdown()
    say("rank %d: TIMELINE_WORKER_OK" % rank)


if __name__ == "__main__":
    run_worker(main)
