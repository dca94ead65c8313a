"""nvgroup_tf and Horovod through TensorFlow on the CPU, side by side in one run.

    python benchmarks/horovod_side_by_side.py [--np 2] [--launches 2]
        [--horovod-python /opt/hvd-venv/bin/python] [--python .venv/bin/python]
        [--json benchmarks/results/horovod_side_by_side_cpu_2rank.json] [--png ...png]

The driver launches `mpirun -np N --bind-to none` of this file once per side
and launch, alternating the sides (nvgroup_tf, horovod, horovod, nvgroup_tf,
...), so load drifts hit both. Each side runs under its own interpreter:
nvgroup_tf under this repository's environment (TF 2.21), Horovod 0.28.1 under
a separate one (it does not build against TF 2.21; --horovod-python names that
environment's python, e.g. TF 2.15 there). A launch (`--worker`) times, in
rounds that interleave every case, with each step starting after a barrier
and the slowest rank's time kept:
  floor          tf.function: v * 0.5 + 1 on the 4-byte tensor, no collective
                 (TF's own per-call floor in this process);
  small          tf.function: hvd.allreduce(v * 0.5 + 1, op=Sum), 4 bytes;
  allreduce_<B>  tf.function: hvd.allreduce(v, op=Sum) of B bytes of float32;
  resnet50       tf.function: hvd.grouped_allreduce of ResNet-50's 214 gradient
                 shapes (benchmarks/resnet50_gradients.txt, full size, 102 MB);
  mpi_<B>        MPI_Allreduce (mpi4py, preallocated numpy buffers) of the same
                 bytes in the same process, for scale.
A case's figure is the median over rounds and launches of a round's mean per
call. Inputs are small integers, so every sum is exact: each side's outputs
of the last round are compared with the exact sums, element by element; a
wrong element fails the run. Not a test.
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
import time

from bench_common import REPO, commit, load_counts, mpirun_env, pyplot, run_worker, save_png, write_json
SIZES = [1 << 20, 16 << 20, 64 << 20]  # bytes of the plain allreduce cases
ITERS = {4: 200, 1 << 20: 40, 16 << 20: 8, 64 << 20: 3}  # calls per round


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


def driver(args):
    import numpy as np
    env = mpirun_env()
    sides = [("nvgroup_tf", args.python), ("horovod", args.horovod_python)]
    merged = {s: {} for s, _ in sides}
    versions = {}
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_start = os.getloadavg()
    for launch in range(args.launches):
        for side, python in (sides if launch % 2 == 0 else list(reversed(sides))):
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
                out = tmp.name
            cmd = ["mpirun", "-np", str(args.np), "--bind-to", "none", python, os.path.abspath(__file__),
                   "--worker", "--side", side, "--worker-json", out, "--rounds", str(args.rounds),
                   "--table", args.table]
            p = subprocess.run(cmd, env=env)
            if p.returncode != 0:
                print("launch %d of %s failed (exit %d)" % (launch, side, p.returncode))
                return 1
            with open(out) as f:
                w = json.load(f)
            os.unlink(out)
            bad = {k: v for k, v in w["wrong"].items() if v}
            if bad:
                print("FAILED: %s gave wrong elements %s" % (side, bad))
                return 1
            versions[side] = w["versions"]
            for k, v in w["times_s"].items():
                merged[side].setdefault(k, []).extend(v)
            print("launch %d %s done" % (launch, side), flush=True)
    summary = {s: {k: float(np.median(v)) * 1e6 for k, v in r.items()} for s, r in merged.items()}
    nv, hv = summary["nvgroup_tf"], summary["horovod"]
    ratios = {
        "small_vs_floor": nv["small"] / nv["floor"],
        "vs_horovod": {k: nv[k] / hv[k] for k in nv if not k.startswith("mpi_") and k != "floor"},
        "vs_mpi": {"allreduce_%d" % b: nv["allreduce_%d" % b] / nv["mpi_%d" % b] for b in SIZES},
        "horovod_vs_mpi": {"allreduce_%d" % b: hv["allreduce_%d" % b] / hv["mpi_%d" % b] for b in SIZES},
    }
    result = {"benchmark": "horovod_side_by_side", "date": started, "commit": commit(),
              "machine": {"host": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count(),
                          "load_average_start": load_start, "load_average_end": os.getloadavg()},
              "ranks": args.np, "launches_per_side": args.launches, "rounds_per_launch": args.rounds,
              "versions": versions, "us_per_call_median": summary, "ratios": ratios,
              "samples": {s: {k: [x * 1e6 for x in v] for k, v in r.items()} for s, r in merged.items()}}
    print("# horovod_side_by_side: %d ranks, %d launches x %d rounds per side, commit %s, load %.1f -> %.1f" %
          (args.np, args.launches, args.rounds, result["commit"][:12], load_start[0], os.getloadavg()[0]))
    print("%-18s %14s %14s %10s" % ("case", "nvgroup_tf us", "horovod us", "nv/hvd"))
    for k in nv:
        print("%-18s %14.1f %14.1f %10s" % (label(k), nv[k], hv.get(k, float("nan")),
                                             "%.2f" % ratios["vs_horovod"][k] if k in ratios["vs_horovod"] else "-"))
    print("small / floor (nvgroup_tf): %.2f; allreduce / MPI_Allreduce (nvgroup_tf): %s" % (
        ratios["small_vs_floor"], ", ".join("%s %.2f" % (label(k).split()[1] + " " + label(k).split()[2], v)
                                            for k, v in ratios["vs_mpi"].items())))
    write_json(args.json, result)
    if args.png:
        plt = pyplot()
        keys = [k for k in nv if not k.startswith("mpi_")]
        fig, ax = plt.subplots(figsize=(9, 4))
        xs = np.arange(len(keys))
        ax.bar(xs - 0.2, [nv[k] for k in keys], 0.4, label="nvgroup_tf (TF %s)" % versions["nvgroup_tf"]["tensorflow"])
        ax.bar(xs + 0.2, [hv[k] for k in keys], 0.4,
               label="Horovod %s (TF %s)" % (versions["horovod"].get("horovod", "?"), versions["horovod"]["tensorflow"]))
        for i, k in enumerate(keys):
            m = "mpi_%s" % k.split("_")[1] if k.startswith("allreduce_") else ("mpi_4" if k == "small" else None)
            if m and m in nv:
                ax.plot([i - 0.4, i + 0.4], [nv[m]] * 2, color="k", lw=1)
        ax.set_yscale("log")
        ax.set_xticks(xs, [label(k) for k in keys], fontsize=8)
        ax.set_ylabel("us per call (median); black: MPI_Allreduce")
        ax.legend(fontsize=8)
        ax.set_title("%d ranks, CPU, %s, %s, load %.1f" % (args.np, started[:16], result["commit"][:8], load_start[0]),
                     fontsize=9)
        save_png(fig, args.png)
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--launches", type=int, default=2, help="launches per side (sides alternate)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per launch (every case once per round)")
    p.add_argument("--python", default=os.path.join(REPO, ".venv", "bin", "python"))
    p.add_argument("--horovod-python", default="/opt/hvd-venv/bin/python")
    p.add_argument("--table", default=os.path.join(REPO, "benchmarks", "resnet50_gradients.txt"))
    p.add_argument("--json")
    p.add_argument("--png")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.add_argument("--worker-json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return run_worker(worker, args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
