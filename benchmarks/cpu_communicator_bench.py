"""CPU communicator allreduce benchmark, nccl-tests style.

Times the CPU Communicator's flat path (NVGROUP_ALLREDUCE_ALGORITHM=mpi), its
NV-group path (auto: shared-memory group + MPI across groups) and a raw
MPI_Allreduce through mpi4py, float32 sum, 4 B .. 64 MiB.

    mpirun -np 4 python benchmarks/cpu_communicator_bench.py [--group-size 2]
        [--min-bytes 4] [--max-bytes 64M] [--iters 20] [--warmup 5]
        [--json out.json] [--png out.png]

Columns as nccl-tests' (src/common.h): time is the mean over iterations
after warmup, averaged across ranks; algbw = bytes / time (GB = 1e9 B);
busbw = algbw * 2 (n-1) / n. Out-of-place: separate numpy input and output.
In-place: input == output; for the communicator paths that buffer is the
registered buffer (the engine's fused path), for mpi4py MPI_IN_PLACE.
#wrong counts elements differing from the exact expected sum (inputs are small
integers, so every order sums them exactly).
"""
import argparse
import ctypes
import json
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nvgroup_tf._engine as engine  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size


def parse_bytes(text):
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * scale[text[-1].upper()] if text[-1].upper() in scale else int(text)


def make_input(count):
    # Small integers: exact float32 sums in any order.
    return ((np.arange(count, dtype=np.int64) * 7 + RANK) % 13 - 6).astype(np.float32)


def expected_sum(count):
    i = np.arange(count, dtype=np.int64) * 7
    return sum(((i + r) % 13 - 6) for r in range(SIZE)).astype(np.float32)


class CommunicatorPath:
    def __init__(self, algorithm, group_size, capacity):
        os.environ["NVGROUP_ALLREDUCE_ALGORITHM"] = algorithm  # read at creation
        self.comm = engine.Communicator(COMM.py2f(), "cpu", group_size=group_size,
                                        registered_bytes=capacity)
        reg = (ctypes.c_char * capacity).from_address(self.comm.registered_buffer())
        self.registered = np.frombuffer(reg, np.float32)

    def run(self, src, dst, count):
        self.comm.allreduce(src.ctypes.data, dst.ctypes.data, count, "float32", "sum")

    def in_place_buffer(self, count):
        return self.registered[:count]


class Mpi4pyPath:
    def run(self, src, dst, count):
        if src is dst:
            COMM.Allreduce(MPI.IN_PLACE, dst, op=MPI.SUM)
        else:
            COMM.Allreduce(src, dst, op=MPI.SUM)

    def in_place_buffer(self, count):
        return np.empty(count, np.float32)


def time_one(path, count, in_place, warmup, iters):
    data = make_input(count)
    if in_place:
        buf = path.in_place_buffer(count)
        src = dst = buf
    else:
        src, dst = data.copy(), np.empty(count, np.float32)
    for _ in range(warmup):
        if in_place:
            buf[:] = data
        path.run(src, dst, count)
    wrong = int(np.count_nonzero(dst != expected_sum(count)))
    elapsed = 0.0
    for _ in range(iters):
        if in_place:
            buf[:] = data  # refill outside the timed region
        COMM.Barrier()
        t0 = time.perf_counter()
        path.run(src, dst, count)
        elapsed += time.perf_counter() - t0
    mean_us = COMM.allreduce(elapsed / iters * 1e6) / SIZE
    return mean_us, COMM.allreduce(wrong)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group-size", type=int, default=0)
    p.add_argument("--min-bytes", default="4")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--png")
    args = p.parse_args()
    lo, hi = parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)
    sizes = []
    s = max(4, lo)
    while s <= hi:
        sizes.append(s)
        s *= 2
    capacity = max(hi, 4)
    paths = {
        "flat": CommunicatorPath("mpi", args.group_size, capacity),
        "nvgroup": CommunicatorPath("auto", args.group_size, capacity),
        "mpi4py": Mpi4pyPath(),
    }
    topo = paths["nvgroup"].comm.topology()
    hosts = COMM.gather((RANK, socket.gethostname(), os.getpid()), root=0)
    factor = 2.0 * (SIZE - 1) / SIZE
    results = {}
    total_wrong = 0
    for name, path in paths.items():
        if RANK == 0:
            print("# nvgroup_tf CPU allreduce: path %s, %d ranks, %d groups x %d, float32 sum, "
                  "warmup %d, iters %d" % (name, SIZE, topo["group_count"], topo["group_size"],
                                           args.warmup, args.iters))
            for r, host, pid in hosts:
                print("#  Rank %2d Pid %6d on %10s device CPU" % (r, pid, host))
            print("#\n#%80s%33s" % ("out-of-place", "in-place"))
            print("#%11s %12s %8s %6s %6s %9s %7s %7s %6s %9s %7s %7s %6s" % (
                "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
                "time", "algbw", "busbw", "#wrong"))
            print("#%11s %12s %8s %6s %6s %9s %7s %7s %6s %9s %7s %7s %6s" % (
                "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)",
                "(GB/s)", ""))
        rows = []
        for nbytes in sizes:
            count = nbytes // 4
            iters = args.iters if nbytes <= (8 << 20) else max(3, args.iters // 4)
            row = {"bytes": nbytes, "count": count}
            for mode in ("out_of_place", "in_place"):
                t, wrong = time_one(path, count, mode == "in_place", args.warmup, iters)
                algbw = nbytes / t / 1e3
                row[mode] = {"time_us": t, "algbw": algbw, "busbw": algbw * factor, "wrong": wrong}
                total_wrong += wrong
            rows.append(row)
            if RANK == 0:
                o, i = row["out_of_place"], row["in_place"]
                print("%12d %12d %8s %6s %6d %9.1f %7.3f %7.3f %6d %9.1f %7.3f %7.3f %6d" % (
                    nbytes, count, "float", "sum", -1, o["time_us"], o["algbw"], o["busbw"],
                    o["wrong"], i["time_us"], i["algbw"], i["busbw"], i["wrong"]), flush=True)
        results[name] = rows
        if RANK == 0:
            avg = np.mean([r[m]["busbw"] for r in rows for m in ("out_of_place", "in_place")])
            print("# Out of bounds values : %d %s" % (total_wrong, "OK" if total_wrong == 0 else "FAILED"))
            print("# Avg bus bandwidth    : %.4f\n#" % avg, flush=True)
    if RANK == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": SIZE, "topology": topo, "results": results}, f, indent=1)
    if RANK == 0 and args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        for name, rows in results.items():
            x = [r["bytes"] for r in rows]
            ax[0].loglog(x, [r["out_of_place"]["time_us"] for r in rows], marker=".", label=name)
            ax[1].semilogx(x, [r["out_of_place"]["busbw"] for r in rows], marker=".", label=name)
        ax[0].set(xlabel="bytes", ylabel="time (us)", title="allreduce latency (out-of-place)")
        ax[1].set(xlabel="bytes", ylabel="busbw (GB/s)", title="allreduce bus bandwidth")
        for a in ax:
            a.legend()
            a.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
    if total_wrong:
        sys.exit(1)


if __name__ == "__main__":
    main()
