"""Host cost per step of a registered group against EnqueueGroup, on the CPU.

    python benchmarks/registered_group_bench.py [--np 1 2] [--launches 5] [--rounds 8] [--steps 25] [--scale 1000]
        [--json benchmarks/results/registered_group_cpu.json] [--png ...png]

The driver launches `mpirun -np N --bind-to none` of this file (`--worker`)
--launches times per rank count, the rank counts alternated. Each launch registers ResNet-50's 214 gradients
(benchmarks/resnet50_gradients.txt, every count divided by --scale so that the
copies are small and the host's per-step work shows) as one group, then runs
alternated blocks, `--rounds` of each, the order swapped every other round:
  grouped     a C++ loop (testing.group_step_times, cc/python/registered_group_bindings.cc)
              that builds the 214 CollectiveRequests and calls EnqueueGroup
              per step, as cc/tools/engine_perf.cc does;
  registered  the same loop launching the registered group
              (EnqueueRegisteredGroup: the pointer arrays and one done).
A step is submit -> every member's completion; its time is the slowest
rank's. Each launch's summary is the median (and quartiles) over every step
of every block after the first block of each style (warm-up), and the ratio
of the two medians; across launches (whose speed differs on a shared VM) the
JSON gives the median of the launches' medians and of their ratios. Every block's outputs
(Average of float32 over the ranks) are checked, every element, against a
float64 reference; `wrong` counts the elements outside (size + 2) * 2^-24 of
it, as engine_perf's check. The machine's load average is recorded before
and after."""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_common import REPO, commit, load_counts, mpirun_env, run_worker, write_json  # noqa: E402

STYLES = ("grouped", "registered")


def rank_input(t, rank, n):
    return np.random.default_rng([t + 1, rank]).uniform(-1.0, 1.0, n).astype(np.float32)


def worker(args):
    from mpi4py import MPI

    from nvgroup_tf import _engine as E
    comm = MPI.COMM_WORLD
    E.init()
    rank, size = E.rank(), E.size()
    counts = load_counts(os.path.join(REPO, "benchmarks", "resnet50_gradients.txt"), args.scale)
    n = len(counts)
    xs = [rank_input(t, rank, c) for t, c in enumerate(counts)]
    outs = {s: [np.zeros(c, np.float32) for c in counts] for s in STYLES}
    in_ptrs = np.array([x.ctypes.data for x in xs], np.uint64)
    group = E.register_allreduce_group([("r/%d" % t, [counts[t]], "float32", "average") for t in reversed(range(n))])
    want = [sum(rank_input(t, r, c).astype(np.float64) for r in range(size)) / size for t, c in enumerate(counts)]
    bound = (size + 2.0) * 2.0 ** -24
    times = {s: [] for s in STYLES}
    wrong = {s: 0 for s in STYLES}
    for rnd in range(args.rounds):
        for style in (STYLES if rnd % 2 == 0 else STYLES[::-1]):
            ys = outs[style]
            for y in ys:
                y[...] = 0
            out_ptrs = np.array([y.ctypes.data for y in ys], np.uint64)
            comm.Barrier()
            t = E.testing.group_step_times(style, in_ptrs, out_ptrs, counts, "g/", group, args.steps)
            slowest = np.max(comm.allgather(np.array(t)), axis=0)
            if rnd >= 2:  # the first block of each style warms up
                times[style].extend(float(v) for v in slowest)
            wrong[style] += int(sum(np.count_nonzero(~(np.abs(y - w) <= bound)) for y, w in zip(ys, want)))
    stats = E.stats()
    E.unregister_group(group)
    E.shutdown()
    total_wrong = {s: int(sum(comm.allgather(wrong[s]))) for s in STYLES}
    if rank == 0:
        print(json.dumps({"np": size, "times_s": times, "wrong": total_wrong,
                          "cached_group_runs": stats["cached_group_runs"]}), flush=True)


def summary(values):
    us = np.array(values) * 1e6
    return {"median_us": float(np.median(us)), "p25_us": float(np.percentile(us, 25)),
            "p75_us": float(np.percentile(us, 75)), "steps": int(us.size)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--np", type=int, nargs="+", default=[1, 2])
    p.add_argument("--launches", type=int, default=5)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--scale", type=int, default=1000)
    p.add_argument("--json", default="")
    p.add_argument("--png", default="")
    args = p.parse_args()
    if args.worker:
        return run_worker(worker, args)
    load_before = os.getloadavg()
    launches = {np_: [] for np_ in args.np}
    for _ in range(args.launches):
        for np_ in args.np:
            cmd = ["mpirun", "-np", str(np_), "--bind-to", "none", sys.executable, os.path.abspath(__file__),
                   "--worker", "--rounds", str(args.rounds), "--steps", str(args.steps), "--scale", str(args.scale)]
            proc = subprocess.run(cmd, env=mpirun_env(), cwd=REPO, capture_output=True, text=True, timeout=1200)
            line = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            if proc.returncode != 0 or not line:
                sys.exit("np=%d failed:\n%s\n%s" % (np_, proc.stdout[-4000:], proc.stderr[-4000:]))
            r = json.loads(line[-1])
            one = {"wrong": r["wrong"], "cached_group_runs": r["cached_group_runs"]}
            for s in STYLES:
                one[s] = summary(r["times_s"][s])
            one["registered_over_grouped"] = one["registered"]["median_us"] / one["grouped"]["median_us"]
            launches[np_].append(one)
            print("np=%d: grouped %.1f us, registered %.1f us per step (median), ratio %.2f, wrong %s" % (
                np_, one["grouped"]["median_us"], one["registered"]["median_us"],
                one["registered_over_grouped"], r["wrong"]), flush=True)
    runs = []
    for np_, ls in launches.items():
        runs.append({"np": np_, "launches": ls,
                     "wrong": {s: sum(x["wrong"][s] for x in ls) for s in STYLES},
                     "grouped": {"median_us": float(np.median([x["grouped"]["median_us"] for x in ls]))},
                     "registered": {"median_us": float(np.median([x["registered"]["median_us"] for x in ls]))},
                     "registered_over_grouped": float(np.median([x["registered_over_grouped"] for x in ls]))})
        print("np=%d over %d launches: grouped %.1f us, registered %.1f us, ratio %.2f (medians)" % (
            np_, len(ls), runs[-1]["grouped"]["median_us"], runs[-1]["registered"]["median_us"],
            runs[-1]["registered_over_grouped"]), flush=True)
    result = {
        "what": "host cost per step, ResNet-50's 214 gradients (counts / %d, float32 Average, host memory): "
                "EnqueueGroup (requests built per step) vs a registered group's launch; submit -> last "
                "completion, slowest rank, median over alternated blocks" % args.scale,
        "machine": "%s, %d cores (%s)" % (platform.node(), os.cpu_count(), platform.processor() or platform.machine()),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(), "launches": args.launches, "rounds": args.rounds, "steps_per_block": args.steps, "scale": args.scale,
        "runs": runs,
    }
    write_json(args.json, result)
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        width = 0.38
        for i, s in enumerate(STYLES):
            med = [r[s]["median_us"] for r in runs]
            lo = [min(x[s]["median_us"] for x in r["launches"]) for r in runs]
            hi = [max(x[s]["median_us"] for x in r["launches"]) for r in runs]
            err = [[m - v for m, v in zip(med, lo)], [v - m for m, v in zip(med, hi)]]
            xs = [j + (i - 0.5) * width for j in range(len(runs))]
            ax.bar(xs, med, width, yerr=err, capsize=3, label=s)
            for x, m in zip(xs, med):
                ax.text(x, m, "%.0f" % m, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels(["%d rank%s, ratio %.2f" % (r["np"], "s" if r["np"] > 1 else "",
                                                        r["registered_over_grouped"]) for r in runs])
        ax.set_ylabel("us per step (median of launches; range)")
        ax.set_title("214 gradients /%d, CPU: EnqueueGroup vs registered group\n%s, load %.1f-%.1f, %s" % (
            args.scale, result["machine"].split(",")[0], load_before[0], result["load_average_after"][0],
            result["commit"][:7]), fontsize=8)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
