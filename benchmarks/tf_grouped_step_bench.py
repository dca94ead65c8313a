"""A TF step's grouped allreduce through the op: ResNet-50's 214 gradient
shapes (benchmarks/resnet50_gradients.txt, element counts divided by --scale,
1/64 by default: 1.6 MB float32) in one hvd.grouped_allreduce inside a
tf.function called from Python (read from variables inside it), the grouped kernel registering its group
(NVGROUP_TF_REGISTERED_GROUPS=1, the default) against submitting it by name
every step (=0), with a raw MPI_Allreduce of the same bytes (mpi4py) timed in
the same rounds for scale.

    python benchmarks/tf_grouped_step_bench.py [--np 2] [--launches 6] [--steps 300]
        [--json benchmarks/results/tf_grouped_step_cpu_2rank.json] [--png ...png]

The driver alternates launches (`mpirun -np NP --bind-to none`) of the two
settings, the order swapped every launch pair. Each launch times --steps
steps in 10 rounds, the slowest rank's mean per step per round, interleaved
with the raw allreduce; its result is checked every round (every element,
small integers so the sum is exact). The table gives, per setting, the median
over all rounds of all its launches, and per launch the median over its
rounds (launches can fall in different modes of MPI; see
docs/PERFORMANCE.md). Not a test.
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from bench_common import (commit, load_counts, mpirun_env, pyplot, run_launch, run_worker, save_png,  # noqa: E402
                          write_json)

SETTINGS = {"registered": "1", "by_name": "0"}
ROUNDS = 10


def worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, REPO)
    import tensorflow as tf
    from mpi4py import MPI

    import nvgroup_tf as hvd
    from nvgroup_tf import op_library

    hvd.init()
    comm = MPI.COMM_WORLD
    me, n = hvd.rank(), hvd.size()
    counts = load_counts(os.path.join(REPO, "benchmarks", "resnet50_gradients.txt"), args.scale)
    rng = np.random.default_rng([7, me])
    host = [rng.integers(-1000, 1000, size=c).astype(np.float32) for c in counts]
    # Inside the function, as a training step's gradients are (a call with 214
    # tensor arguments would time tf.function's argument handling instead).
    grads = [tf.Variable(h) for h in host]
    # Every rank's draws, regenerated in the same order: the exact sum.
    want = []
    gens = [np.random.default_rng([7, r]) for r in range(n)]
    for c in counts:
        want.append(np.sum([g.integers(-1000, 1000, size=c).astype(np.float64) for g in gens], axis=0))

    results = [tf.Variable(tf.zeros_like(h)) for h in host]

    @tf.function
    def step():  # the results go into variables, as an optimizer's update reads them
        outs = hvd.grouped_allreduce([g.read_value() for g in grads], op=hvd.Sum, name="bench.grouped")
        for r, o in zip(results, outs):
            r.assign(o)

    flat = np.concatenate(host)
    flat_out = np.empty_like(flat)
    wrong = 0
    for _ in range(5):  # trace, register, warm up
        step()
    per_round = max(1, args.steps // ROUNDS)
    step_us, mpi_us = [], []
    stats0 = op_library.grouped_submission_stats()
    for _ in range(ROUNDS):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(per_round):
            step()
        t1 = time.perf_counter()
        comm.Barrier()
        t2 = time.perf_counter()
        for _ in range(per_round):
            comm.Allreduce(flat, flat_out, op=MPI.SUM)
        t3 = time.perf_counter()
        step_us.append(comm.allreduce((t1 - t0) / per_round * 1e6, op=MPI.MAX))
        mpi_us.append(comm.allreduce((t3 - t2) / per_round * 1e6, op=MPI.MAX))
        for o, w in zip(results, want):
            wrong += int(np.count_nonzero(o.numpy().astype(np.float64) != w))
    stats = {k: v - stats0[k] for k, v in op_library.grouped_submission_stats().items()}
    wrong = comm.allreduce(wrong, op=MPI.SUM)
    if me == 0:
        with open(args.out, "w") as f:
            json.dump({"step_us": step_us, "mpi_us": mpi_us, "wrong": wrong, "kernel_stats": stats,
                       "bytes": int(flat.nbytes), "tensors": len(counts)}, f)
    hvd.shutdown()
    return 0


def drive(args):
    env0 = mpirun_env()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_start = os.getloadavg()
    rounds = {k: {"step_us": [], "mpi_us": []} for k in SETTINGS}
    launches = {k: [] for k in SETTINGS}
    info = {}
    for launch in range(args.launches):
        order = list(SETTINGS) if launch % 2 == 0 else list(reversed(SETTINGS))
        for label in order:
            env = dict(env0, NVGROUP_TF_REGISTERED_GROUPS=SETTINGS[label])
            cmd = ["mpirun", "-np", str(args.np), "--bind-to", "none", sys.executable, os.path.abspath(__file__),
                   "--worker", "--out", "{out}", "--steps", str(args.steps), "--scale", str(args.scale)]
            r = run_launch(cmd, env, REPO, "%s (launch %d)" % (label, launch))
            if r is None:
                return 1
            if r["wrong"]:
                print("FAILED: %s gave %d wrong elements" % (label, r["wrong"]))
                return 1
            want_launches = r["kernel_stats"]["launches"] > 0
            if want_launches != (label == "registered"):
                print("FAILED: %s: kernel counters %s" % (label, r["kernel_stats"]))
                return 1
            info = {"bytes": r["bytes"], "tensors": r["tensors"]}
            rounds[label]["step_us"] += r["step_us"]
            rounds[label]["mpi_us"] += r["mpi_us"]
            launches[label].append({"step_us": float(np.median(r["step_us"])),
                                    "mpi_us": float(np.median(r["mpi_us"]))})
    med = {k: {m: float(np.median(v[m])) for m in v} for k, v in rounds.items()}
    load_end = os.getloadavg()
    result = {"benchmark": "tf_grouped_step", "date": started, "commit": commit(),
              "machine": {"host": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count(),
                          "load_average_start": load_start, "load_average_end": load_end},
              "ranks": args.np, "scale": args.scale, **info, "steps_per_launch": args.steps,
              "launches_per_setting": args.launches, "median_us": med,
              "step_vs_raw_mpi": {k: m["step_us"] / m["mpi_us"] for k, m in med.items()},
              "registered_vs_by_name": med["registered"]["step_us"] / med["by_name"]["step_us"],
              "per_launch": launches, "round_us": rounds}
    print("# tf_grouped_step: %d ranks, %d tensors, %d bytes, %d launches per setting, load %.1f -> %.1f" %
          (args.np, info["tensors"], info["bytes"], args.launches, load_start[0], load_end[0]))
    for k, m in med.items():
        print("%-11s step %8.1f us   raw MPI_Allreduce %8.1f us   step/raw %.2f   per launch %s" %
              (k, m["step_us"], m["mpi_us"], result["step_vs_raw_mpi"][k],
               " ".join("%.0f" % x["step_us"] for x in launches[k])))
    print("registered / by name: %.3f" % result["registered_vs_by_name"])
    write_json(args.json, result)
    if args.png:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for j, k in enumerate(SETTINGS):
            ys = [x["step_us"] for x in launches[k]]
            ax.plot(range(len(ys)), ys, "o-", label="%s (median %.0f us)" % (k, med[k]["step_us"]))
        ax.plot(range(args.launches), [x["mpi_us"] for x in launches["registered"]], "k--",
                label="raw MPI_Allreduce, same bytes")
        ax.set_xlabel("launch")
        ax.set_ylabel("us per step (median over rounds)")
        ax.legend(fontsize=8)
        ax.set_title("tf.function grouped_allreduce, %d x %d ranks, %s %s, load %.1f" %
                     (info["tensors"], args.np, result["commit"][:8], started[:16], load_start[0]), fontsize=9)
        save_png(fig, args.png)
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--launches", type=int, default=6)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--scale", type=int, default=64)
    p.add_argument("--json")
    p.add_argument("--png")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return run_worker(worker, args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
