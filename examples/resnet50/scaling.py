"""Scaling report for examples/resnet50/train.py (the paper's metric).

    python examples/resnet50/scaling.py --np 2 -- --image-size 64 --batch-size 8 --steps 20

Runs train.py on 1 rank and on N ranks (through nvgrouprun) with the same
per-rank batch and reports throughput and scaling efficiency,

    efficiency = N-rank throughput / (N x 1-rank throughput),

as a table, a JSON file and a PNG plot (benchmarks/results/ by default).
With --sweep-bucket-cap 0,1,4,25,100 it instead runs N ranks once per fusion
bucket cap (MiB) and tabulates throughput per cap (how the default cap was
chosen: see README.md). --repeat R runs each configuration R times,
interleaved, and keeps the median (for shared machines).

Arguments after "--" go to train.py. Each run's output is kept in the JSON.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TRAIN = os.path.join(HERE, "train.py")


def run_train(np_, train_args, extra_env=None, launcher_args=()):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "nvgroup_tf.runner", "-np", str(np_)] + list(launcher_args) + \
          [sys.executable, TRAIN] + list(train_args)
    print("$ " + " ".join(cmd), flush=True)
    t = time.time()
    proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.time() - t
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("NVG_RESULT "):
            result = json.loads(line[len("NVG_RESULT "):])
        elif line.startswith(("epoch ", "# ")):
            print("   " + line, flush=True)
    if proc.returncode != 0 or result is None:
        sys.stderr.write(proc.stdout[-6000:])
        raise SystemExit("train.py on %d rank(s) failed (exit %s)" % (np_, proc.returncode))
    result["wall_s"] = wall
    return result


def _median_run(runs):
    """The run with the median total throughput (the machine may be shared:
    repeats are interleaved across configurations and the median kept)."""
    ordered = sorted(runs, key=lambda r: r["img_per_sec_total"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["repeats_img_per_sec_total"] = [r["img_per_sec_total"] for r in runs]
    return chosen


def _rounds(configs, args):
    """Runs every (np, train_args) config args.repeat times, interleaved."""
    results = [[] for _ in configs]
    for _ in range(args.repeat):
        for k, (np_, train_args) in enumerate(configs):
            results[k].append(run_train(np_, train_args, launcher_args=args.launcher_args))
    return [_median_run(r) for r in results]


def scaling(args, train_args):
    runs = _rounds([(1, train_args), (args.np, train_args)], args)
    base = runs[0]["img_per_sec_total"]
    rows = []
    for r in runs:
        speedup = r["img_per_sec_total"] / base
        rows.append(dict(r, speedup=speedup, efficiency=speedup / r["ranks"]))
    print()
    print("# ResNet-50 scaling: batch %d per rank, %dx%d images, %d timed steps, %s data, median of %d"
          % (runs[0]["batch_size"], runs[0]["image_size"], runs[0]["image_size"], runs[0]["steps"], runs[0]["data"],
             args.repeat))
    share = cpu_share(runs)
    print("# CPU share: " + share)
    print("%6s %12s %14s %14s %9s %11s" % ("ranks", "batch/rank", "img/s/rank", "img/s total", "speedup",
                                            "efficiency"))
    for r in rows:
        print("%6d %12d %14.2f %14.2f %9.2f %10.1f%%" % (r["ranks"], r["batch_size"], r["img_per_sec_per_rank"],
                                                         r["img_per_sec_total"], r["speedup"], 100 * r["efficiency"]))
    return {"kind": "scaling", "train_args": train_args, "repeat": args.repeat, "cpu_share": share,
            "host_cores": os.cpu_count(), "runs": rows}


def cpu_share(runs):
    """How the CPU was shared among the ranks of each run, from train.py's results."""
    cores = {r.get("cores_per_rank") for r in runs}
    threads = {r.get("intra_op_threads_used", r.get("intra_op_threads")) for r in runs}
    if len(cores) == 1 and len(threads) == 1 and cores != {0} and None not in cores:
        return ("every rank, the 1-rank baseline too, pinned to its own %d core(s) with %s TF intra-op thread(s) "
                "(same share per rank in every run, on a %d-core host)"
                % (cores.pop(), threads.pop() or "TF's default number of", os.cpu_count() or 0))
    return ("NOT equal: ranks not pinned (cores per rank %s, intra-op threads %s): the 1-rank baseline could use "
            "the whole %d-core host while the N ranks shared it, so the efficiency understates scaling"
            % (sorted(map(str, cores)), sorted(map(str, threads)), os.cpu_count() or 0))


def sweep(args, train_args):
    caps = [float(c) for c in args.sweep_bucket_cap.split(",")]
    rows = _rounds([(args.np, train_args + ["--bucket-cap-mb", str(cap)]) for cap in caps], args)
    print()
    print("# ResNet-50 fusion bucket cap sweep: %d ranks, batch %d per rank, %dx%d images, %d timed steps, "
          "median of %d" % (args.np, rows[0]["batch_size"], rows[0]["image_size"], rows[0]["image_size"],
                            rows[0]["steps"], args.repeat))
    print("%14s %14s %14s %16s %18s  %s" % ("bucket cap MiB", "img/s/rank", "img/s total", "step mean (ms)",
                                            "step median (ms)", "all repeats (img/s total)"))
    for cap, r in zip(caps, rows):
        print("%14g %14.2f %14.2f %16.1f %18.1f  %s" % (
            cap, r["img_per_sec_per_rank"], r["img_per_sec_total"], r["step_time_ms_mean"],
            r["step_time_ms_median"], " ".join("%.2f" % v for v in r["repeats_img_per_sec_total"])))
    return {"kind": "bucket_cap_sweep", "np": args.np, "caps_mb": caps, "train_args": train_args,
            "repeat": args.repeat, "runs": rows}


def run_context(load_before):
    """Machine, date, commit and load of a report (benchmarks need them)."""
    import datetime
    import platform
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout.strip())
    except OSError:
        commit, dirty = None, None
    return {"machine": {"host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform()},
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit, "uncommitted_changes": dirty,
            "load_average_before": load_before, "load_average_after": os.getloadavg()}


def plot(report, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    runs = report["runs"]
    if report["kind"] == "scaling":
        ranks = [r["ranks"] for r in runs]
        ax.plot(ranks, [r["img_per_sec_total"] for r in runs], "o-", label="measured")
        ax.plot(ranks, [runs[0]["img_per_sec_total"] * n for n in ranks], "k--", label="ideal (linear)")
        for r in runs:
            ax.annotate("%.0f%%" % (100 * r["efficiency"]), (r["ranks"], r["img_per_sec_total"]),
                        textcoords="offset points", xytext=(4, -12))
        ax.set_xlabel("ranks")
        ax.set_ylabel("images / s (total)")
        ax.set_xticks(ranks)
        ax.set_title("ResNet-50 data-parallel scaling (batch %d/rank, %dpx)"
                     % (runs[0]["batch_size"], runs[0]["image_size"]))
        ax.legend()
    else:
        caps = report["caps_mb"]
        xs = range(len(caps))
        reduce_only = runs[0].get("mode") == "reduce_only"
        # Every repeat as a dot, their median as the line (shared machines are noisy).
        med = []
        for x, r in zip(xs, runs):
            reps = r["repeats_img_per_sec_total"]
            ys = sorted(1e3 / v for v in reps) if reduce_only else sorted(reps)
            ax.plot([x] * len(ys), ys, ".", color="0.6")
            med.append(ys[len(ys) // 2])
        ax.plot(xs, med, "o-", label="median of %d runs" % len(runs[0]["repeats_img_per_sec_total"]))
        ax.set_xticks(list(xs))
        ax.set_xticklabels(["%g" % c for c in caps])
        ax.set_xlabel("fusion bucket cap (MiB; 0 = one allreduce per gradient)")
        if reduce_only:
            ax.set_ylabel("mean time per gradient reduction (ms)")
            ax.set_title("ResNet-50 gradients (%.0f MB), %d ranks"
                         % (runs[0]["gradient_bytes"] / 1e6, report["np"]))
        else:
            ax.set_ylabel("images / s (total)")
            ax.set_title("ResNet-50, %d ranks: throughput vs bucket cap" % report["np"])
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote %s" % path)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        k = argv.index("--")
        argv, train_args = argv[:k], argv[k + 1:]
    else:
        train_args = []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2, help="ranks of the scaled run")
    p.add_argument("--sweep-bucket-cap", default=None, help="comma-separated caps in MiB: sweep instead of scaling")
    p.add_argument("--out-dir", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--repeat", type=int, default=1, help="runs per configuration, interleaved; the median is kept")
    p.add_argument("--tag", default="cpu", help="file name tag: resnet50_<kind>_<tag>.{json,png}")
    p.add_argument("--replot", default=None, help="redraw the PNG of an existing JSON report and exit")
    p.add_argument("--launcher-args", nargs="*", default=[], help="extra nvgrouprun flags, e.g. -H a:4,b:4")
    args = p.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), os.path.splitext(args.replot)[0] + ".png")
        return 0
    if args.np < 2:
        p.error("--np must be >= 2")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    load_before = os.getloadavg()
    report = sweep(args, train_args) if args.sweep_bucket_cap else scaling(args, train_args)
    report.update(run_context(load_before))
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, "resnet50_%s_%s" % ("bucket_sweep" if args.sweep_bucket_cap else "scaling",
                                                          args.tag))
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    print("wrote %s.json" % stem)
    plot(report, stem + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
