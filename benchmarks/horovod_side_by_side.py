"""nvgroup_tf and Horovod through TensorFlow on the CPU, side by side in one run.

    python benchmarks/horovod_side_by_side.py [--np 2] [--launches 6] [--rounds 3]
        [--horovod-cycle-ms default 0.1] [--max-other-cores 0.25]
        [--horovod-python /opt/hvd-venv/bin/python] [--python .venv/bin/python]
        [--json benchmarks/results/horovod_side_by_side_cpu_2rank.json] [--png ...png]

The driver launches `mpirun -np N --bind-to none` of this file once per side
and launch, alternating the order of the sides from launch to launch
(nvgroup_tf, horovod, ... then ..., horovod, nvgroup_tf), so load drifts hit
every side. Each side runs under its own interpreter: nvgroup_tf under this
repository's environment, Horovod 0.28.1 under a separate one
(--horovod-python; built against the same TensorFlow where it builds, see
docs/PERFORMANCE.md). A Horovod side per --horovod-cycle-ms entry: "default"
leaves HOROVOD_CYCLE_TIME alone (Horovod's background thread then runs a
negotiation cycle every 1 ms), a number sets it (ms).

A launch (`--worker`) times, in rounds that interleave every case, with each
step starting after a barrier and the slowest rank's time kept:
  floor          tf.function: v * 0.5 + 1 on the 4-byte tensor, no collective
                 (TF's own per-call floor in this process);
  small          tf.function: hvd.allreduce(v * 0.5 + 1, op=Sum), 4 bytes;
  allreduce_<B>  tf.function: hvd.allreduce(v, op=Sum) of B bytes of float32;
  resnet50       tf.function: hvd.grouped_allreduce of ResNet-50's 214 gradient
                 shapes (benchmarks/resnet50_gradients.txt, full size, 102 MB);
  mpi_<B>        MPI_Allreduce (mpi4py, preallocated numpy buffers) of the same
                 bytes in the same process, for scale (in a Horovod process
                 this runs beside Horovod's polling thread, so it is slower
                 there than in a plain MPI program).
A launch's figure of a case is the median over its rounds of a round's mean
per call. A side's figure is the range of its launches' figures, with their
median: one pooled median would hide launches that fall in different modes
(marked where a case's launches differ by more than BIMODAL_RATIO). The CPU
the rest of the machine used during each launch (busy time from /proc/stat
minus the launch's own processes') is recorded; a launch above
--max-other-cores is marked disturbed and left out of the figures. Inputs are
small integers, so every sum is exact: each side's outputs of the last round
are compared with the exact sums, element by element; a wrong element fails
the run. Not a test.
"""
import argparse
import datetime
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import REPO, commit, load_counts, mpirun_env, pyplot, run_worker, save_png, write_json
SIZES = [1 << 20, 16 << 20, 64 << 20]  # bytes of the plain allreduce cases
ITERS = {4: 200, 1 << 20: 40, 16 << 20: 8, 64 << 20: 3}  # calls per round
BIMODAL_RATIO = 1.5  # launches of a side whose medians of a case differ more than this are in different modes


def worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    if args.side == "horovod":
        import horovod.tensorflow as hvd
    else:
        sys.path.insert(0, REPO)
        import nvgroup_tf as hvd
    hvd.init()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size

    def ints(n, salt):  # small integers: (v * 0.5 + 1) and every sum are exact
        return ((np.arange(n, dtype=np.int64) * 7 + 3 * rank + salt) % 11).astype(np.float32) * 2.0

    def exact(n, salt, arith):
        vals = [((np.arange(n, dtype=np.int64) * 7 + 3 * r + salt) % 11).astype(np.float32) * 2.0
                for r in range(size)]
        return sum((v * 0.5 + 1.0) if arith else v for v in vals)

    @tf.function
    def floor(v):
        return v * 0.5 + 1.0

    @tf.function
    def small(v):
        return hvd.allreduce(v * 0.5 + 1.0, op=hvd.Sum, name="side_by_side.small")

    @tf.function
    def plain(v):
        return hvd.allreduce(v, op=hvd.Sum, name="side_by_side.plain_%d" % v.shape[0])

    counts = load_counts(args.table)

    @tf.function
    def grouped(vs):
        return hvd.grouped_allreduce(vs, op=hvd.Sum, name="side_by_side.resnet50")

    cases = {}  # name -> (callable, calls per round, check)
    x4 = tf.constant(ints(1, 0))
    cases["floor"] = (lambda: floor(x4), ITERS[4], None)
    cases["small"] = (lambda: small(x4), ITERS[4], lambda y: (np.asarray(y), exact(1, 0, True)))
    mpi_buffers = {}
    for b in SIZES:
        n = b // 4
        xb = tf.constant(ints(n, 1))
        cases["allreduce_%d" % b] = (lambda xb=xb: plain(xb), ITERS[b],
                                     lambda y, n=n: (np.asarray(y), exact(n, 1, False)))
    for b in [4] + SIZES:
        src, dst = ints(b // 4, 2), np.empty(b // 4, np.float32)
        mpi_buffers[b] = (src, dst)

        def mpi(src=src, dst=dst):
            comm.Allreduce(src, dst, op=MPI.SUM)
            return dst
        cases["mpi_%d" % b] = (mpi, ITERS[b], lambda y, n=b // 4: (np.asarray(y), exact(n, 2, False)))
    xs = [tf.constant(ints(c, 5 + t)) for t, c in enumerate(counts)]
    cases["resnet50"] = (lambda: grouped(xs), 2,
                         lambda ys: (np.concatenate([np.asarray(y) for y in ys]),
                                     np.concatenate([exact(c, 5 + t, False) for t, c in enumerate(counts)])))
    for f, _, _ in cases.values():  # trace and warm up
        for _ in range(2):
            f()
    times = {k: [] for k in cases}
    wrong = {}
    for rnd in range(args.rounds):
        order = list(cases) if rnd % 2 == 0 else list(reversed(cases))
        for name in order:
            f, calls, check = cases[name]
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                y = f()
            dt = (time.perf_counter() - t0) / calls
            times[name].append(comm.allreduce(dt, op=MPI.MAX))
            if check is not None and rnd == args.rounds - 1:
                got, want = check(y)
                wrong[name] = int(np.sum(got != want))
    wrong = {k: comm.allreduce(v, op=MPI.SUM) for k, v in wrong.items()}
    if rank == 0:
        versions = {"tensorflow": tf.__version__}
        if args.side == "horovod":
            import horovod
            versions["horovod"] = horovod.__version__
        with open(args.worker_json, "w") as f:
            json.dump({"times_s": times, "wrong": wrong, "versions": versions}, f)
    hvd.shutdown()
    return 0


def label(case):
    if case.startswith(("allreduce_", "mpi_")):
        kind, b = case.split("_")
        b = int(b)
        return "%s %s" % (kind, "%d MiB" % (b >> 20) if b >= 1 << 20 else "%d B" % b)
    return case


def _busy_cpu_s():
    """CPU seconds the whole machine spent busy so far (/proc/stat: every state
    but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _launch(args, env, side, python, cycle_ms):
    """One mpirun of a side's worker; its times, checks, versions, and how
    much CPU the rest of the machine used meanwhile (cores: busy CPU time of
    the machine minus the launch's own processes', over the wall time)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    cmd = ["mpirun", "-np", str(args.np), "--bind-to", "none"]
    if cycle_ms is not None:
        cmd += ["-x", "HOROVOD_CYCLE_TIME=%s" % cycle_ms]
    cmd += [python, os.path.abspath(__file__), "--worker", "--side", side, "--worker-json", out,
            "--rounds", str(args.rounds), "--table", args.table]
    load_before = os.getloadavg()[0]
    busy0, own0, t0 = _busy_cpu_s(), resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    p = subprocess.run(cmd, env=env)
    busy1, own1, t1 = _busy_cpu_s(), resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    if p.returncode != 0:
        raise RuntimeError("a launch of %s failed (exit %d)" % (side, p.returncode))
    with open(out) as f:
        w = json.load(f)
    os.unlink(out)
    own = (own1.ru_utime - own0.ru_utime) + (own1.ru_stime - own0.ru_stime)
    w["load_before"] = load_before
    w["wall_s"] = t1 - t0
    w["other_cpu_cores"] = max(0.0, (busy1 - busy0) - own) / (t1 - t0)
    return w


def _spread(values):
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def driver(args):
    env = mpirun_env()
    sides = [("nvgroup_tf", args.python, None)]
    for c in args.horovod_cycle_ms:
        sides.append(("horovod" if c == "default" else "horovod_cycle_%sms" % c, args.horovod_python,
                      None if c == "default" else c))
    versions = {}
    launches = []
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_start = os.getloadavg()
    for launch in range(args.launches):
        for name, python, cycle_ms in (sides if launch % 2 == 0 else list(reversed(sides))):
            w = _launch(args, env, "horovod" if name.startswith("horovod") else name, python, cycle_ms)
            bad = {k: v for k, v in w["wrong"].items() if v}
            if bad:
                print("FAILED: %s gave wrong elements %s" % (name, bad))
                return 1
            versions[name] = w["versions"]
            disturbed = w["other_cpu_cores"] > args.max_other_cores
            launches.append({"side": name, "launch": launch, "horovod_cycle_time_ms": cycle_ms,
                             "load_before": round(w["load_before"], 2), "wall_s": round(w["wall_s"], 1),
                             "other_cpu_cores": round(w["other_cpu_cores"], 3), "disturbed": disturbed,
                             "us_per_call_median": {k: statistics.median(v) * 1e6 for k, v in w["times_s"].items()},
                             "samples_us": {k: [x * 1e6 for x in v] for k, v in w["times_s"].items()}})
            print("launch %d %-24s other work %.2f cores%s" % (launch, name, w["other_cpu_cores"],
                                                               "  DISTURBED" if disturbed else ""), flush=True)
    result = {"benchmark": "horovod_side_by_side", "date": started, "commit": commit(),
              "machine": {"host": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count(),
                          "load_average_start": load_start, "load_average_end": os.getloadavg()},
              "ranks": args.np, "launches_per_side": args.launches, "rounds_per_launch": args.rounds,
              "max_other_cpu_cores": args.max_other_cores, "versions": versions, "sides": [s[0] for s in sides],
              "launches": launches}
    summarize(result)
    report(result, args.json, args.png)
    return 0


def summarize(result):
    """The figures of a run from its launches (result["launches"]), into
    result["us_per_call"] and result["ratios"].

    Each launch's median per case; a side's figure is the range over its
    undisturbed launches, with their median. A case whose launches differ by
    more than BIMODAL_RATIO is marked: its launches fall in different modes.
    A ratio to nvgroup_tf is taken per launch, between the launches of one
    launch number (run one after the other, so they saw the same state of the
    machine), and given as the range over launch numbers with its median."""
    names, launches = result["sides"], result["launches"]
    kept = {n: {x["launch"]: x for x in launches if x["side"] == n and not x["disturbed"]} for n in names}
    cases = list(launches[0]["us_per_call_median"])
    per_side = {n: {k: _spread([x["us_per_call_median"][k] for x in kept[n].values()]) for k in cases}
                for n in names if kept[n]}
    for r in per_side.values():
        for v in r.values():
            v["launch_modes_differ"] = v["max"] > BIMODAL_RATIO * v["min"]
    ratios = {}
    for n in names[1:]:
        both = sorted(set(kept["nvgroup_tf"]) & set(kept[n]))
        if both:
            ratios["nvgroup_tf_vs_" + n + "_per_launch"] = {
                k: _spread([kept["nvgroup_tf"][i]["us_per_call_median"][k] / kept[n][i]["us_per_call_median"][k]
                            for i in both]) for k in cases if not k.startswith("mpi_")}
    for n in names:
        if kept[n]:
            runs = list(kept[n].values())
            ratios[n + "_vs_mpi_per_launch"] = {"allreduce_%d" % b: _spread(
                [x["us_per_call_median"]["allreduce_%d" % b] / x["us_per_call_median"]["mpi_%d" % b] for x in runs])
                for b in SIZES}
            ratios[n + "_small_vs_floor_per_launch"] = _spread(
                [x["us_per_call_median"]["small"] / x["us_per_call_median"]["floor"] for x in runs])
    result["us_per_call"] = per_side
    result["ratios"] = ratios
    if any(not kept[n] for n in names):
        result["no_figures"] = [n for n in names if not kept[n]]


def report(result, json_path, png_path):
    per_side, ratios = result["us_per_call"], result["ratios"]
    cases = list(result["launches"][0]["us_per_call_median"])
    load = result["machine"]["load_average_start"][0]
    for n in result.get("no_figures", []):
        print("every launch of %s was disturbed by other work (> %.2f cores): no figures" % (
            n, result["max_other_cpu_cores"]))
    print("# horovod_side_by_side: %d ranks, %d launches x %d rounds per side, commit %s, %s, load %.1f at start; "
          "us per call, min-max over undisturbed launches (median)" %
          (result["ranks"], result["launches_per_side"], result["rounds_per_launch"], result["commit"][:12],
           result["date"][:16], load))
    print("%-16s" % "case" + "".join("%30s" % n for n in per_side))
    for k in cases:
        print("%-16s" % label(k) + "".join(
            "%30s" % ("%.0f-%.0f (%.0f)%s" % (r[k]["min"], r[k]["max"], r[k]["median"],
                                              " *" if r[k]["launch_modes_differ"] else ""))
            for r in per_side.values()))
    if any(v["launch_modes_differ"] for r in per_side.values() for v in r.values()):
        print("* the launches differ by more than %.1fx" % BIMODAL_RATIO)
    for key, r in ratios.items():
        if key.startswith("nvgroup_tf_vs_"):
            print("%s: %s" % (key, ", ".join("%s %.2f-%.2f (%.2f)" % (label(k), v["min"], v["max"], v["median"])
                                             for k, v in r.items())))
    write_json(json_path, result)
    if png_path and per_side:
        _plot(result, per_side, cases, png_path)


def _plot(result, per_side, cases, png_path):
    import numpy as np
    plt = pyplot()
    keys = [k for k in cases if not k.startswith("mpi_")]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = np.arange(len(keys))
    width = 0.8 / len(per_side)
    for i, (n, r) in enumerate(per_side.items()):
        off = (i - (len(per_side) - 1) / 2) * width
        med = [r[k]["median"] for k in keys]
        err = [[r[k]["median"] - r[k]["min"] for k in keys], [r[k]["max"] - r[k]["median"] for k in keys]]
        v = result["versions"][n]
        ax.bar(xs + off, med, width, yerr=err, capsize=2,
               label="%s (TF %s%s)" % (n, v["tensorflow"], ", Horovod " + v["horovod"] if "horovod" in v else ""))
    nv = per_side.get("nvgroup_tf")
    for i, k in enumerate(keys):
        m = "mpi_%s" % k.split("_")[1] if k.startswith("allreduce_") else ("mpi_4" if k == "small" else None)
        if nv and m and m in nv:
            ax.plot([i - 0.4, i + 0.4], [nv[m]["median"]] * 2, color="k", lw=1)
    ax.set_yscale("log")
    ax.set_xticks(xs, [label(k) for k in keys], fontsize=8)
    ax.set_ylabel("us per call: median of launches, bars min-max\nblack: MPI_Allreduce (nvgroup_tf's process)")
    ax.legend(fontsize=7)
    ax.set_title("%d ranks, CPU, %s, %s, load %.1f at start" % (
        result["ranks"], result["date"][:16], result["commit"][:8], result["machine"]["load_average_start"][0]),
        fontsize=9)
    save_png(fig, png_path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--launches", type=int, default=6, help="launches per side (sides alternate)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per launch (every case once per round)")
    p.add_argument("--python", default=os.path.join(REPO, ".venv", "bin", "python"))
    p.add_argument("--horovod-python", default="/opt/hvd-venv/bin/python")
    p.add_argument("--horovod-cycle-ms", nargs="+", default=["default"],
                   help="Horovod sides to run: 'default' (its own HOROVOD_CYCLE_TIME) and/or cycle times in ms")
    p.add_argument("--max-other-cores", type=float, default=0.25,
                   help="a launch during which the rest of the machine used more CPU than this is disturbed: "
                        "recorded, left out of the figures")
    p.add_argument("--table", default=os.path.join(REPO, "benchmarks", "resnet50_gradients.txt"))
    p.add_argument("--json")
    p.add_argument("--png")
    p.add_argument("--summarize", metavar="JSON",
                   help="recompute the figures of an earlier run from the launches its JSON recorded "
                        "(written to --json, or back to JSON)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.add_argument("--worker-json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return run_worker(worker, args)
    if args.summarize:
        with open(args.summarize) as f:
            result = json.load(f)
        if "sides" not in result:  # the run's sides, nvgroup_tf first, in the order they were named
            seen = [x["side"] for x in result["launches"]]
            result["sides"] = ["nvgroup_tf"] + [n for i, n in enumerate(seen) if n != "nvgroup_tf" and n not in seen[:i]]
        summarize(result)
        report(result, args.json or args.summarize, args.png)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
