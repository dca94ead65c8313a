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

Two builds in one run (alternated launches, e.g. a baseline tree built from an
older commit against this one):

    python benchmarks/tf_op_overhead_bench.py --tree old=/tmp/base --tree new=. \
        [--launches 3] [--calls 1000] [--json ...ab.json] [--png ...ab.png]

launches `mpirun -np 2 --bind-to none` of each tree's own copy of this file
(so each loads that tree's nvgroup_tf), alternating the order every launch,
and reports the median over launches and rounds per tree.
"""
import argparse
import datetime
import os
import platform
import socket
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import tensorflow as tf  # noqa: E402

import nvgroup_tf as hvd  # noqa: E402
from bench_common import commit, mpirun_env, pyplot, run_launch, save_png, write_json  # noqa: E402


def compare_trees(args):
    """Alternated launches of each tree's bench; one JSON (+ PNG) of the medians."""
    trees = [spec.partition("=")[::2] for spec in args.tree]
    env = mpirun_env()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_start = os.getloadavg()
    rounds = {label: {} for label, _ in trees}
    commits = {}
    for launch in range(args.launches):
        for label, tree in (trees if launch % 2 == 0 else list(reversed(trees))):
            tree = os.path.abspath(tree)
            cmd = ["mpirun", "-np", str(args.np), "--bind-to", "none", sys.executable,
                   os.path.join(tree, "benchmarks", "tf_op_overhead_bench.py"), "--calls", str(args.calls),
                   "--elements", str(args.elements), "--json", "{out}"]
            r = run_launch(cmd, env, tree, "%s (launch %d)" % (label, launch))
            if r is None:
                return 1
            if r["wrong_elements"]:
                print("FAILED: %s gave %d wrong elements" % (label, r["wrong_elements"]))
                return 1
            commits[label] = r["commit"]
            for k, v in r.get("round_us", {k: [v] for k, v in r["median_us_per_call"].items()}).items():
                rounds[label].setdefault(k, []).extend(v)
    med = {label: {k: float(np.median(v)) for k, v in r.items()} for label, r in rounds.items()}
    result = {"benchmark": "tf_op_overhead_ab", "date": started, "commits": commits,
              "machine": {"host": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count(),
                          "load_average_start": load_start, "load_average_end": os.getloadavg()},
              "ranks": args.np, "elements": args.elements, "calls_per_launch": args.calls,
              "launches_per_tree": args.launches, "median_us_per_call": med,
              "allreduce_vs_no_collective": {label: m["allreduce"] / m["no_collective"] for label, m in med.items()},
              "round_us": rounds}
    print("# tf_op_overhead A/B: %d ranks, %d float32, %d launches per tree, load %.1f -> %.1f" %
          (args.np, args.elements, args.launches, load_start[0], os.getloadavg()[0]))
    for label, m in med.items():
        print("%-14s %-14s no_collective %8.1f  allreduce %8.1f  mpi4py %8.1f  allreduce/no_collective %.2f" %
              (label, commits[label][:12], m["no_collective"], m["allreduce"], m["mpi4py"],
               result["allreduce_vs_no_collective"][label]))
    write_json(args.json, result)
    if args.png:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = ["no_collective", "allreduce"]
        xs = np.arange(len(names))
        width = 0.8 / len(med)
        for j, (label, m) in enumerate(med.items()):
            ax.bar(xs + j * width, [m[k] for k in names], width, label="%s (%s)" % (label, commits[label][:8]))
        ax.set_xticks(xs + width * (len(med) - 1) / 2, names)
        ax.set_ylabel("us per call (median over rounds)")
        ax.legend(fontsize=8)
        ax.set_title("%d ranks, %d float32, %s, load %.1f" % (args.np, args.elements, started[:16], load_start[0]),
                     fontsize=9)
        save_png(fig, args.png)
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--elements", type=int, default=16)
    p.add_argument("--json")
    p.add_argument("--png")
    p.add_argument("--tree", action="append", help="LABEL=path of a built checkout (repeat: compares them)")
    p.add_argument("--launches", type=int, default=3, help="with --tree: launches per tree")
    p.add_argument("--np", type=int, default=2, help="with --tree: ranks")
    args = p.parse_args()
    if args.tree:
        return compare_trees(args)
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
            "round_us": {k: [float(x) * 1e6 for x in v] for k, v in times.items()},
            "engine_share_us": med["allreduce"] - med["no_collective"],
            "wrong_elements": wrong,
        }
        print("# tf_op_overhead: %d ranks, %d float32, %d calls each, commit %s, load %.1f" %
              (size, args.elements, rounds * per_round, result["commit"][:12], os.getloadavg()[0]))
        for k in runners:
            print("%-14s %9.1f us per call" % (k, med[k]))
        print("engine share   %9.1f us per call (allreduce - no_collective); wrong elements %d" %
              (result["engine_share_us"], wrong))
        write_json(args.json, result)
        if args.png:
            plt = pyplot()
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
            save_png(fig, args.png)
    hvd.shutdown()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
