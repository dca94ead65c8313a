"""Before/after comparison of two built trees in one run: a CPU benchmark
(cpu_communicator_bench.py or cpu_engine_step_bench.py) launched alternately
from each tree, each with its own script and build, per rank count.

    python benchmarks/alternate_builds.py --before /work/main --after . \
        --bench cpu_communicator_bench.py --np 2 3 --rounds 3 \
        --json benchmarks/results/x.json [--png x.png] -- --max-bytes 4M --iters 10

Rounds alternate the order (before, after; then after, before; ...) so a load
drift hits both trees alike. Each launch is `mpirun -np N --bind-to none` with
PYTHONPATH set to its tree, under `timeout`. Per tree, rank count and
measurement (cpu_communicator_bench: path, size and in/out of place, its mean
time per call, every element checked: a wrong one ends the run;
cpu_engine_step_bench: the call style, its median step) the
JSON holds every round's value and their median, and after/before of the
medians. It records the machine, the date, both trees' commits and the load
average before every launch.
"""
import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import commit, mpirun_env, pyplot, save_png, write_json  # noqa: E402


def measurements(bench, result):
    """{name: value in us} of one launch's JSON; a result the benchmark
    counted wrong elements in ends the run, naming it."""
    out = {}
    if bench.startswith("cpu_communicator"):
        for path, rows in result["results"].items():
            for row in rows:
                for mode in ("out_of_place", "in_place"):
                    name = "%s/%d/%s" % (path, row["bytes"], mode)
                    if row[mode].get("wrong"):
                        raise SystemExit("%s: %d wrong elements" % (name, row[mode]["wrong"]))
                    out[name] = row[mode]["time_us"]
    else:
        for style, r in result["styles"].items():
            out[style] = r["median_us"]
    return out


def launch(tree, bench, np_, extra, timeout_s):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = mpirun_env()
        env["PYTHONPATH"] = tree
        cmd = ["timeout", str(timeout_s), "mpirun", "-np", str(np_), "--bind-to", "none", "-x", "PYTHONPATH",
               os.path.join(tree, ".venv", "bin", "python"), os.path.join(tree, "benchmarks", bench),
               "--json", out] + extra
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit("%s failed (%d):\n%s\n%s" % (" ".join(cmd), proc.returncode, proc.stdout[-4000:],
                                                           proc.stderr[-4000:]))
        with open(out) as f:
            return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--bench", required=True)
    p.add_argument("--np", type=int, nargs="+", default=[2, 3])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--json", required=True)
    p.add_argument("--png")
    p.add_argument("extra", nargs="*", help="arguments of the benchmark (after --)")
    args = p.parse_args()
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    record = {
        "benchmark": args.bench, "arguments": args.extra, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "machine": {"host": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "trees": {k: {"path": v, "commit": commit(v)} for k, v in trees.items()},
        "launches": [], "by_ranks": {},
    }
    values = {}  # (np, tree) -> name -> [values]
    for rnd in range(args.rounds):
        order = ["before", "after"] if rnd % 2 == 0 else ["after", "before"]
        for np_ in args.np:
            for which in order:
                load = os.getloadavg()
                result = launch(trees[which], args.bench, np_, args.extra, args.timeout)
                record["launches"].append({"round": rnd, "ranks": np_, "tree": which, "load_average": load})
                for name, v in measurements(args.bench, result).items():
                    values.setdefault((np_, which), {}).setdefault(name, []).append(v)
                print("round %d np %d %s done (load %.2f)" % (rnd, np_, which, load[0]), flush=True)
    for np_ in args.np:
        table = {}
        for name in values[(np_, "before")]:
            b, a = values[(np_, "before")][name], values[(np_, "after")][name]
            table[name] = {"before_us": b, "after_us": a, "before_median_us": float(np.median(b)),
                           "after_median_us": float(np.median(a)),
                           "after_over_before": float(np.median(a) / np.median(b))}
        record["by_ranks"][str(np_)] = table
        print("# %d ranks: median us (before -> after, ratio)" % np_)
        for name, t in table.items():
            print("%-40s %10.1f %10.1f %6.3f" % (name, t["before_median_us"], t["after_median_us"],
                                                t["after_over_before"]))
    record["load_average_range"] = [min(x["load_average"][0] for x in record["launches"]),
                                    max(x["load_average"][0] for x in record["launches"])]
    write_json(args.json, record)
    if args.png:
        plt = pyplot()
        fig, axes = plt.subplots(1, len(args.np), figsize=(6 * len(args.np), 4), squeeze=False)
        for ax, np_ in zip(axes[0], args.np):
            table = record["by_ranks"][str(np_)]
            names = list(table)
            ax.barh(range(len(names)), [table[n]["after_over_before"] for n in names])
            ax.axvline(1.0, color="k", lw=0.8)
            ax.set_yticks(range(len(names)))
            ax.set_yticklabels(names, fontsize=6)
            ax.set(xlabel="after / before (medians)", title="%s, %d ranks" % (args.bench, np_))
        save_png(fig, args.png)


if __name__ == "__main__":
    main()
