"""TF-op allreduce benchmark, nccl-tests style, against raw MPI_Allreduce.

    mpirun -np 2 --bind-to none python benchmarks/tf_allreduce_bench.py
        [--min-bytes 4] [--max-bytes 256M] [--target-seconds 0.3]
        [--json benchmarks/results/tf_allreduce_cpu_2rank.json]
        [--png benchmarks/results/tf_allreduce_cpu_2rank.png]
        [--markdown OUT.md]

Part 1, size sweep (float32 sum, sizes doubling from --min-bytes to
--max-bytes), in the same run:
  * "tf op": nvgroup_tf.allreduce inside a tf.function called eagerly, the
    way a training step calls it (Python -> TF executor -> AsyncOpKernel ->
    engine negotiation -> communicator -> done);
  * "mpi4py": MPI_Allreduce through mpi4py on numpy arrays of the same bytes.
Columns as nccl-tests' (src/common.h): time = mean per call after one
warmup call, averaged across ranks; algbw = bytes / time (GB = 1e9 B); busbw =
algbw * 2(n-1)/n. Out-of-place: a persistent input, a new output. In-place:
mpi4py with MPI_IN_PLACE; TF has no user-visible in-place allreduce (the
kernel forwards the input buffer when TF allows), so those columns read N/A.
#wrong counts elements differing from the exact sum (inputs are small
integers, so any order sums them exactly). Iterations per size are chosen so
each measurement lasts about --target-seconds.

Part 2, "ResNet-50 step": the trainable-variable shapes of
keras.applications.ResNet50(weights=None) (214 tensors, 25.6M float32) reduced
  * fused: all submitted at once from one tf.function (default
    NVGROUP_FUSION_THRESHOLD, the engine fuses them),
  * unfused: the same with NVGROUP_FUSION_THRESHOLD=0 (re-init),
  * one raw MPI_Allreduce of the same total bytes (the lower bound).
Not a test: nothing is asserted about speed.
"""
import argparse
import datetime
import json
import os
import platform
import socket
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tensorflow as tf  # noqa: E402

import nvgroup_tf as hvd  # noqa: E402


def parse_bytes(text):
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * scale[text[-1].upper()] if text[-1].upper() in scale else int(text)


def small_ints(count, rank):
    return ((np.arange(count, dtype=np.int64) * 7 + rank) % 13 - 6).astype(np.float32)


def expected(count, size):
    return sum(small_ints(count, r) for r in range(size))


def timed(comm, call, target_seconds):
    """Mean seconds per call after a warmup, averaged across ranks. All ranks
    run the same number of iterations (rank 0's choice, broadcast)."""
    call()
    start = time.perf_counter()
    call()
    once = time.perf_counter() - start
    iters = comm.bcast(int(min(1000, max(2, target_seconds / max(once, 1e-6)))), root=0)
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        result = call()
    mean = (time.perf_counter() - start) / iters
    return comm.allreduce(mean) / comm.size, iters, result


def sweep(comm, sizes, target_seconds):
    n = comm.size
    rows = []
    for nbytes in sizes:
        count = nbytes // 4
        x_np = small_ints(count, comm.rank)
        want = expected(count, n)
        x_tf = tf.constant(x_np)
        fn = tf.function(lambda x, c=count: hvd.allreduce(x, op=hvd.Sum, name="bench.%d" % c))
        t_tf, it_tf, out = timed(comm, lambda: fn(x_tf), target_seconds)
        wrong_tf = int(np.count_nonzero(out.numpy() != want))

        out_np = np.empty_like(x_np)
        from mpi4py import MPI
        t_mpi, it_mpi, _ = timed(comm, lambda: comm.Allreduce(x_np, out_np, op=MPI.SUM),
                                 target_seconds)
        wrong_mpi = int(np.count_nonzero(out_np != want))
        inplace = x_np.copy()

        def in_place():
            inplace[:] = x_np
            comm.Allreduce(MPI.IN_PLACE, inplace, op=MPI.SUM)
        t_ip, _, _ = timed(comm, in_place, target_seconds)
        wrong_ip = int(np.count_nonzero(inplace != want))
        rows.append(dict(bytes=nbytes, count=count, tf_us=t_tf * 1e6, tf_iters=it_tf,
                         tf_wrong=wrong_tf, mpi_us=t_mpi * 1e6, mpi_iters=it_mpi,
                         mpi_wrong=wrong_mpi, mpi_inplace_us=t_ip * 1e6, mpi_inplace_wrong=wrong_ip))
    return rows


def resnet50_shapes():
    import keras
    model = keras.applications.ResNet50(weights=None)
    return [tuple(int(d) for d in v.shape) for v in model.trainable_variables]


def resnet_step(comm, shapes, target_seconds, label):
    grads = [tf.constant(small_ints(int(np.prod(s)), comm.rank).reshape(s)) for s in shapes]

    @tf.function
    def step(gs):
        return [hvd.allreduce(g, op=hvd.Average, name="resnet.%d" % i) for i, g in enumerate(gs)]
    seconds, iters, outs = timed(comm, lambda: step(grads), target_seconds)
    n = comm.size
    wrong = sum(int(np.count_nonzero(o.numpy().ravel() !=
                                     (expected(o.numpy().size, n) / np.float32(n))))
                for o in outs)
    return dict(variant=label, ms=seconds * 1e3, iters=iters, wrong=wrong)


def raw_step(comm, total, target_seconds):
    from mpi4py import MPI
    x = small_ints(total, comm.rank)
    out = np.empty_like(x)
    seconds, iters, _ = timed(comm, lambda: comm.Allreduce(x, out, op=MPI.SUM), target_seconds)
    return dict(variant="one MPI_Allreduce of the same bytes (mpi4py)", ms=seconds * 1e3,
                iters=iters, wrong=int(np.count_nonzero(out != expected(total, comm.size))))


def fmt_rows(r, n):
    """(tf op row, mpi4py row) for one size."""
    factor = 2.0 * (n - 1) / n

    def cols(us, wrong):
        algbw = r["bytes"] / (us * 1e-6) / 1e9
        return "%10.1f %7.3f %7.3f %6d" % (us, algbw, algbw * factor, wrong)
    prefix = "%12d %12d %6s %6s %5s   " % (r["bytes"], r["count"], "float", "sum", "-1")
    not_applicable = "%10s %7s %7s %6s" % ("N/A", "N/A", "N/A", "N/A")
    return (prefix + cols(r["tf_us"], r["tf_wrong"]) + "   " + not_applicable,
            prefix + cols(r["mpi_us"], r["mpi_wrong"]) + "   " +
            cols(r["mpi_inplace_us"], r["mpi_inplace_wrong"]))


_COLUMNS = "%12s %12s %6s %6s %5s   %10s %7s %7s %6s   %10s %7s %7s %6s"
HEADER = ["#" + " " * 47 + "out-of-place".center(33) + "   " + "in-place".center(33),
          "#" + (_COLUMNS % ("size", "count", "type", "redop", "root", "time", "algbw", "busbw",
                             "#wrong", "time", "algbw", "busbw", "#wrong"))[1:],
          "#" + (_COLUMNS % ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "",
                             "(us)", "(GB/s)", "(GB/s)", ""))[1:]]


def report(comm, rows, resnet, hosts):
    n = comm.size
    lines = ["# nvgroup_tf TF-op allreduce vs MPI_Allreduce (mpi4py), %d ranks" % n,
             "# date %s, TensorFlow %s, %s, %d cores" % (
                 datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 tf.__version__, platform.processor() or platform.machine(), os.cpu_count())]
    lines.append("# load average at the end of the run (shared build machine): %s" %
                 " ".join("%.1f" % v for v in os.getloadavg()))
    lines += ["#  rank %d host %s device cpu" % (r, h) for r, h in enumerate(hosts)]
    tables = {"tf op (nvgroup_tf.allreduce in tf.function)": 0, "mpi4py MPI_Allreduce": 1}
    for title, index in tables.items():
        lines += ["#", "# %s" % title] + HEADER
        lines += [fmt_rows(r, n)[index] for r in rows]
        wrong = sum(r["tf_wrong"] if index == 0 else r["mpi_wrong"] + r["mpi_inplace_wrong"]
                    for r in rows)
        key = "tf_us" if index == 0 else "mpi_us"
        avg_bus = np.mean([r["bytes"] / (r[key] * 1e-6) / 1e9 * 2 * (n - 1) / n for r in rows])
        lines += ["# Out of bounds values : %d %s" % (wrong, "OK" if wrong == 0 else "FAILED"),
                  "# Avg bus bandwidth    : %.4f" % avg_bus]
    if not resnet["variants"]:
        return lines
    lines += ["#", "# ResNet-50 step: %d gradient tensors, %.1fM float32 (%.1f MB), Average" % (
        resnet["tensors"], resnet["elements"] / 1e6, resnet["elements"] * 4 / 1e6)]
    lines += ["# %-52s %10s %8s %7s %6s" % ("variant", "time(ms)", "algbw", "iters", "#wrong")]
    for v in resnet["variants"]:
        algbw = resnet["elements"] * 4 / (v["ms"] * 1e-3) / 1e9
        lines.append("  %-52s %10.2f %8.3f %7d %6d" % (v["variant"], v["ms"], algbw, v["iters"],
                                                       v["wrong"]))
    return lines


CAVEAT = ("Caveat: measured on a 2-core VM shared with other builds and test runs (see the "
          "load average in the header): with more runnable processes than cores a rank can be "
          "descheduled for milliseconds, which shows as isolated multi-millisecond times even for "
          "MPI_Allreduce of a few bytes, and repeated runs differ by 2x or more. Read the tables "
          "as orders of magnitude, not as a ranking of close numbers.")


def write_outputs(args, lines, rows, resnet, n):
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(ranks=n, sweep=rows, resnet50=resnet, table=lines), f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = [r["bytes"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("tf_us", "nvgroup_tf TF op"), ("mpi_us", "MPI_Allreduce (mpi4py)")):
        us = [r[key] for r in rows]
        a.loglog(sizes, us, marker="o", label=label)
        b.semilogx(sizes, [s / (t * 1e-6) / 1e9 * 2 * (n - 1) / n for s, t in zip(sizes, us)],
                   marker="o", label=label)
    a.set(xlabel="bytes", ylabel="time per allreduce (us)", title="latency, %d CPU ranks" % n)
    b.set(xlabel="bytes", ylabel="busbw (GB/s)", title="bus bandwidth, %d CPU ranks" % n)
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write("# CPU benchmark: TF-op allreduce vs MPI_Allreduce\n\n")
            f.write("Produced by `mpirun -np %d --bind-to none .venv/bin/python "
                    "benchmarks/tf_allreduce_bench.py` (see its docstring for the method). "
                    "JSON: `%s`, plot: `%s`.\n\n" % (n, os.path.relpath(args.json),
                                                     os.path.relpath(args.png)))
            f.write(CAVEAT + "\n\n")
            f.write("```\n" + "\n".join(lines) + "\n```\n\n![latency and busbw](%s)\n" %
                    os.path.relpath(args.png, os.path.dirname(os.path.abspath(args.markdown))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--min-bytes", default="4")
    parser.add_argument("--max-bytes", default="256M")
    parser.add_argument("--target-seconds", type=float, default=0.3)
    parser.add_argument("--json", default="benchmarks/results/tf_allreduce_cpu_2rank.json")
    parser.add_argument("--png", default="benchmarks/results/tf_allreduce_cpu_2rank.png")
    parser.add_argument("--markdown", default="", help="also write the tables as a markdown page")
    parser.add_argument("--skip-resnet", action="store_true")
    args = parser.parse_args()

    hvd.init()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    sizes, s = [], parse_bytes(args.min_bytes)
    while s <= parse_bytes(args.max_bytes):
        sizes.append(s)
        s *= 2
    rows = sweep(comm, sizes, args.target_seconds)

    resnet = dict(tensors=0, elements=0, variants=[])
    if not args.skip_resnet:
        shapes = resnet50_shapes()
        resnet["tensors"] = len(shapes)
        resnet["elements"] = int(sum(np.prod(s) for s in shapes))
        resnet["variants"].append(resnet_step(comm, shapes, 3 * args.target_seconds,
                                              "fused (default NVGROUP_FUSION_THRESHOLD)"))
        hvd.shutdown()
        os.environ["NVGROUP_FUSION_THRESHOLD"] = "0"  # read by init()
        hvd.init()
        resnet["variants"].append(resnet_step(comm, shapes, 3 * args.target_seconds,
                                              "unfused (NVGROUP_FUSION_THRESHOLD=0)"))
        resnet["variants"].append(raw_step(comm, resnet["elements"], 3 * args.target_seconds))

    hosts = comm.gather(socket.gethostname(), root=0)
    if comm.rank == 0:
        lines = report(comm, rows, resnet, hosts)
        print("\n".join(lines), flush=True)
        write_outputs(args, lines, rows, resnet, comm.size)


if __name__ == "__main__":
    main()
