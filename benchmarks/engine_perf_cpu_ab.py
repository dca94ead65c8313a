"""engine_perf's CPU mode (host buffers, no CUDA call) for several builds of the
tools, alternated: per build and run, the host time of the step's Enqueue
calls and the step time, for one call per tensor (ResNet-50's 214 gradients at
1/SCALE of their size). Each build is a tools folder of
scripts/device/build_tools.sh (a tree of another commit built the same way,
with this tree's cc/tools/engine_perf.cc, measures that commit's engine).

    python benchmarks/engine_perf_cpu_ab.py --tools 9dfe90f=.device/base/build/tools \\
        --tools this=build/tools --reps 6 --steps 3000 --json out.json --png out.png

Writes JSON (+ PNG) with the machine, date, commit and load; prints medians.
Not a test: nothing is asserted about speed.
"""
import argparse
import datetime
import os
import re
import statistics
import subprocess

import bench_common

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(tools, ranks, steps, scale, style):
    env = bench_common.mpirun_env()
    cmd = ["mpirun", "-np", str(ranks), "--bind-to", "none", os.path.join(tools, "engine_perf"),
           os.path.join(ROOT, "benchmarks", "resnet50_gradients.txt"), str(steps), "cpu", "scale=%d" % scale]
    if style != "per_tensor":
        cmd.append(style)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600).stdout
    enqueue = re.search(r"Enqueue(?:Group)? calls ([0-9.]+) us", out)
    step = re.search(r": ([0-9.]+) us per step", out)
    wrong = re.findall(r"wrong (\d+)", out)
    if not (enqueue and step and wrong):
        raise SystemExit("engine_perf in %s gave no figures:\n%s" % (tools, out[-3000:]))
    return {"enqueue_calls_us": float(enqueue.group(1)), "us_per_step": float(step.group(1)),
            "wrong": sum(int(w) for w in wrong)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tools", action="append", required=True, help="LABEL=TOOLS_DIR, in run order")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--scale", type=int, default=64)
    ap.add_argument("--style", default="per_tensor", choices=["per_tensor", "grouped"])
    ap.add_argument("--json", required=True)
    ap.add_argument("--png")
    args = ap.parse_args()
    builds = [t.split("=", 1) for t in args.tools]
    for build in builds:
        if len(build) != 2 or not os.path.isfile(os.path.join(build[1], "engine_perf")):
            ap.error("--tools takes LABEL=TOOLS_DIR with TOOLS_DIR/engine_perf built, not %r" % "=".join(build))
    load_before = os.getloadavg()
    runs = {label: [] for label, _ in builds}
    for _ in range(args.reps):
        for label, tools in builds:
            runs[label].append(run(tools, args.ranks, args.steps, args.scale, args.style))
    wrong = sum(r["wrong"] for rs in runs.values() for r in rs)
    summary = {label: {"enqueue_calls_us_median": statistics.median(r["enqueue_calls_us"] for r in rs),
                       "us_per_step_median": statistics.median(r["us_per_step"] for r in rs)}
               for label, rs in runs.items()}
    head = bench_common.commit()
    commit = head[:7] + ("-dirty" if head.endswith("-dirty") else "")
    result = {"benchmark": "engine_perf_cpu_ab", "commit": commit,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"host": os.uname().nodename, "cores": os.cpu_count(),
                          "load_average_before": load_before, "load_average_after": os.getloadavg()},
              "ranks": args.ranks, "style": args.style, "steps": args.steps, "scale": args.scale,
              "reps": args.reps, "builds": dict(builds), "runs": runs, "summary": summary, "wrong": wrong}
    bench_common.write_json(args.json, result)
    for label, s in summary.items():
        print("%-10s Enqueue calls %7.1f us per step (%.3f us per call), step %7.1f us" % (
            label, s["enqueue_calls_us_median"], s["enqueue_calls_us_median"] / 214, s["us_per_step_median"]))
    print("wrong", wrong)
    if args.png:
        plt = bench_common.pyplot()
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for ax, key, title in ((axes[0], "enqueue_calls_us", "Enqueue calls per step (us)"),
                               (axes[1], "us_per_step", "step (us)")):
            ax.boxplot([[r[key] for r in runs[label]] for label, _ in builds], tick_labels=[b[0] for b in builds])
            ax.set_title(title)
        fig.suptitle("engine_perf cpu, %d rank(s), %s, 214 gradients / %d, commit %s, %s" % (
            args.ranks, args.style, args.scale, result["commit"], result["date"][:10]), fontsize=9)
        bench_common.save_png(fig, args.png)
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
