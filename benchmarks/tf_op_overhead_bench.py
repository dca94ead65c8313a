"""TF op per-call overhead: a small hvd.allreduce inside tf.function, side by
side with the same tf.function doing the same arithmetic without a collective,
so the engine's share of a call is visible.

    mpirun -np 2 --bind-to none python benchmarks/tf_op_overhead_bench.py \
        [--calls 2000] [--elements 16] [--json benchmarks/results/tf_op_overhead_cpu_2rank.json]
        [--png benchmarks/results/tf_op_overhead_cpu_2rank.png]

Three tf.functions on a float32 tensor of --elements elements, each called
eagerly from Python (the way a training step is), in the same run, interleaved
in rounds so load drifts hit all three:
  no_collective   y = x * 0.5 + 1          (TF's own dispatch of a tf.function)
  allreduce       y = hvd.allreduce(x * 0.5 + 1, op=Sum)
  mpi4py          the same arithmetic in numpy, then MPI_Allreduce via mpi4py
                  (the raw transport's small-message latency, for scale)
Each round times --calls / 10 calls of each; the table reports the median over
rounds of the mean per call (slowest rank), and engine share =
allreduce - no_collective. Results are checked (every element, every call of
the last repetition) against the exact sum (small integers). Not a test.
"""
import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import tensorflow as tf  # noqa: E402

import nvgroup_tf as hvd  # noqa: E402


def commit():
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--elements", type=int, default=16)
    p.add_argument("--json")
    p.add_argument("--png")
    args = p.parse_args()
    hvd.init()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = hvd.rank(), hvd.size()
    x_np = (np.arange(args.elements) % 7 + rank).astype(np.float32) * 2.0  # (x*0.5+1) stays integral
    x = tf.constant(x_np)
    want = sum((np.arange(args.elements) % 7 + r).astype(np.float32) + 1.0 for r in range(size))

    @tf.function
    def no_collective(v):
        return v * 0.5 + 1.0

    @tf.function
    def allreduce(v):
        return hvd.allreduce(v * 0.5 + 1.0, op=hvd.Sum, name="overhead")

    out = np.empty_like(x_np)

    def mpi(v):
        comm.Allreduce(v * 0.5 + 1.0, out, op=MPI.SUM)
        return out

    runners = {"no_collective": lambda: no_collective(x), "allreduce": lambda: allreduce(x),
               "mpi4py": lambda: mpi(x_np)}
    for f in runners.values():  # trace + warm up
        for _ in range(20):
            f()
    rounds, per_round = 10, max(1, args.calls // 10)
    times = {k: [] for k in runners}
    wrong = 0
    for rnd in range(rounds):
        for name, f in runners.items():
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(per_round):
                y = f()
            dt = (time.perf_counter() - t0) / per_round
            times[name].append(comm.allreduce(dt, op=MPI.MAX))
            if name != "no_collective" and rnd == rounds - 1:
                wrong += int(np.sum(np.asarray(y) != want))
    wrong = comm.allreduce(wrong, op=MPI.SUM)
    med = {k: float(np.median(v)) * 1e6 for k, v in times.items()}
    if rank == 0:
        result = {
            "benchmark": "tf_op_overhead",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit(),
            "machine": {"host": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count(),
                        "load_average": os.getloadavg()},
            "ranks": size, "elements": args.elements, "calls": rounds * per_round,
            "median_us_per_call": med,
            "engine_share_us": med["allreduce"] - med["no_collective"],
            "wrong_elements": wrong,
        }
        print("# tf_op_overhead: %d ranks, %d float32, %d calls each, commit %s, load %.1f" %
              (size, args.elements, rounds * per_round, result["commit"][:12], os.getloadavg()[0]))
        for k in runners:
            print("%-14s %9.1f us per call" % (k, med[k]))
        print("engine share   %9.1f us per call (allreduce - no_collective); wrong elements %d" %
              (result["engine_share_us"], wrong))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        if args.png:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots(figsize=(6, 3.5))
            names = list(runners)
            vals = [med[k] for k in names]
            ax.bar(names, vals, color=["tab:gray", "tab:blue", "tab:green"])
            for i, v in enumerate(vals):
                ax.text(i, v, "%.0f us" % v, ha="center", va="bottom")
            ax.set_ylabel("us per call (median over rounds)")
            ax.set_title("%d ranks, %d float32: engine share %.0f us (%s, %s, load %.1f)" % (
                size, args.elements, result["engine_share_us"], result["date"][:10], result["commit"][:8],
                result["machine"]["load_average"][0]), fontsize=8)
            fig.tight_layout()
            fig.savefig(args.png, dpi=110)
    hvd.shutdown()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
