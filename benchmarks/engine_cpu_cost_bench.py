"""What a live engine costs the application's own CPU work on a CPU host.

    python benchmarks/engine_cpu_cost_bench.py [--np 2] [--rounds 6] [--steps 30]
        [--compute-ms 4] [--build new=nvgroup_tf/_engine...so --build old=/tmp/old/_engine...so]
        [--json benchmarks/results/engine_cpu_cost_2rank.json] [--png ...png]

The command above is the driver: it launches `mpirun -np N --bind-to none` of
this file once per round and build (builds alternate: old, new, old, new, ...
when two are given), then merges the rounds into one JSON (+ PNG). Each launch
(the worker, `--worker`) runs alternated blocks, in the same process, of
  none       no engine initialised: one MPI_Allreduce (mpi4py) of the
             gradient set's bytes, then the compute;
  engine     engine alive: one grouped_allreduce_async of the gradient set +
             wait_all, then the same compute;
  per_tensor engine alive: one allreduce_async per gradient (214 calls, the
             way a framework without grouping submits) + wait_all, then the
             compute;
  idle       engine alive but unused: the compute only (the idle tax);
  mpi_alive  engine alive: the raw MPI_Allreduce + compute (what a live
             engine costs the user's own MPI);
  small      engine alive: a 4-byte allreduce_async + wait, then the compute.
The engine is started (`_engine.init`) before the engine blocks and shut down
after them, so `none` runs with no engine thread at all; the block order is
reversed every other round. Every step starts after a barrier; a step's
exchange and compute times are the slowest rank's (worst rank); the summary is
the median over every step of every round.

The compute is fixed single-threaded work (numpy element-wise passes over a
cache-resident array; calibrated once to about --compute-ms on rank 0, the
same iteration count on every rank), as the next forward pass follows a step's
allreduce.

Per thread, CPU time (/proc/self/task/*/schedstat, nanoseconds on CPU) is read
around each phase, so the JSON says where each block's CPU went during the
exchange and during the compute that follows: the main (Python) thread, the
engine's threads (named nvg-loop / nvg-liveness where the build names them;
otherwise "engine" for the threads that appeared at init) and the rest
(Open MPI's, Python's).

Checks: the engine's grouped result of the last step is compared bitwise with
float32(x0 + x1) computed in float64 from every rank's inputs (2 ranks; allclose
for more) and the 4-byte result exactly; any difference fails the run.
"""
import argparse
import datetime
import importlib.machinery
import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench_common import REPO, commit, load_counts, mpirun_env, pyplot, run_worker, save_png  # noqa: E402
KINDS = ["none", "engine", "per_tensor", "idle", "mpi_alive", "small"]
# Blocks whose exchange is the gradient set through the engine: their ratio to
# the raw MPI_Allreduce of the same bytes is the engine's cost (the "none"
# block's, no engine alive, and the "mpi_alive" block's, same engine session).
ENGINE_EXCHANGES = ("engine", "per_tensor")
# Background-loop counters (_engine.stats()) reported per step of each engine block.
STAT_KEYS = ["cycles", "agreement_allreduces", "negotiation_rounds", "buckets", "idle_s", "agree_s",
             "negotiate_s", "execute_s", "admit_s", "lookup_s", "complete_s"]


def default_so():
    d = os.path.join(REPO, "nvgroup_tf")
    for f in sorted(os.listdir(d)):
        if f.startswith("_engine") and f.endswith(".so"):
            return os.path.join(d, f)
    raise SystemExit("no nvgroup_tf/_engine*.so: build first")


def load_engine(path):
    loader = importlib.machinery.ExtensionFileLoader("nvgroup_tf._engine", path)
    spec = importlib.util.spec_from_file_location("nvgroup_tf._engine", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def thread_cpu():
    """{tid: (name, ns on CPU, ns runnable but waiting for a CPU)} for this process's threads."""
    out = {}
    base = "/proc/self/task"
    for tid in os.listdir(base):
        try:
            with open("%s/%s/schedstat" % (base, tid)) as f:
                fields = f.read().split()
                ns, waited = int(fields[0]), int(fields[1])
            with open("%s/%s/comm" % (base, tid)) as f:
                name = f.read().strip()
        except (OSError, ValueError):
            continue
        out[int(tid)] = (name, ns, waited)
    return out


def worker(args):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    engine = load_engine(args.engine_so)
    counts = load_counts(args.table, args.scale)
    n = len(counts)
    rng = np.random.default_rng([12345, rank])
    inputs = [rng.uniform(-1.0, 1.0, c).astype(np.float32) for c in counts]
    outputs = [np.zeros(c, np.float32) for c in counts]
    flat_in = np.concatenate(inputs)
    flat_out = np.zeros_like(flat_in)
    items = [("gr/grad_%d" % t, inputs[t].ctypes.data, outputs[t].ctypes.data, [counts[t]], "float32")
             for t in range(n - 1, -1, -1)]
    small_in = np.array([rank + 1], np.float32)
    small_out = np.zeros(1, np.float32)

    work = np.linspace(0.0, 1.0, 16384)  # 128 KiB: stays in cache

    def compute(iters):
        a = work.copy()
        for _ in range(iters):
            np.multiply(a, 0.999, out=a)
            np.add(a, 0.001, out=a)
            np.sqrt(a, out=a)

    # Calibration (no engine alive yet): iterations for about --compute-ms.
    probe = 200
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        compute(probe)
        ts.append(time.perf_counter() - t0)
    iters = max(1, int(probe * args.compute_ms * 1e-3 / min(ts)))  # min: the unloaded speed
    iters = comm.bcast(iters, root=0)

    pid = os.getpid()
    engine_tids = set()

    def classify(tid, name):
        if tid == pid:
            return "main"
        if name.startswith("nvg-"):
            return name
        if tid in engine_tids:
            return "engine"
        return "other"

    def cpu_by_class(before, after, field=1):
        out = {}
        for tid, entry in after.items():
            name = entry[0]
            d = entry[field] - before.get(tid, (name, 0, 0))[field]
            c = classify(tid, name)
            out[c] = out.get(c, 0) + d
        return out

    def grouped():
        engine.wait_all(engine.grouped_allreduce_async(items))

    def per_tensor():
        engine.wait_all([engine.allreduce_async(name, i, o, shape, dtype) for name, i, o, shape, dtype in items])

    def small():
        engine.wait(engine.allreduce_async("small/x", small_in.ctypes.data, small_out.ctypes.data, [1], "float32"))

    def mpi():
        comm.Allreduce(flat_in, flat_out, op=MPI.SUM)

    exchanges = {"none": mpi, "engine": grouped, "per_tensor": per_tensor, "idle": None, "mpi_alive": mpi, "small": small}
    results = {k: {"exchange_s": [], "compute_s": [], "cpu_exchange_ns": {}, "cpu_compute_ns": {},
                   "runqueue_wait_ns": {}, "engine_stats": {}} for k in KINDS}

    block_failures = []
    all_inputs = comm.allgather(flat_in)
    ref = np.sum([x.astype(np.float64) for x in all_inputs], axis=0).astype(np.float32)

    def check(kind):
        """The gradient set's result of `kind`'s last step against float32 of the float64 sum."""
        got = np.concatenate(outputs)
        if size == 2 and not np.array_equal(got.view(np.uint32), ref.view(np.uint32)):
            block_failures.append("%s result differs from float32(x0 + x1) in %d elements" %
                                  (kind, int(np.sum(got != ref))))
        if size != 2 and not np.allclose(got, ref, rtol=1e-5, atol=1e-6):
            block_failures.append("%s result differs from the float64 reference" % kind)

    def block(kind):
        ex = exchanges[kind]
        if kind in ENGINE_EXCHANGES:
            for o in outputs:
                o.fill(np.nan)
        for _ in range(args.warmup):
            comm.Barrier()
            if ex is not None:
                ex()
            compute(iters)
        mine_ex, mine_co = [], []
        cpu_ex, cpu_co, wait_step = {}, {}, {}
        stats0 = engine.stats() if kind != "none" else None
        for _ in range(args.steps):
            comm.Barrier()
            c0 = thread_cpu()
            t0 = time.perf_counter()
            if ex is not None:
                ex()
            t1 = time.perf_counter()
            c1 = thread_cpu()
            t2 = time.perf_counter()
            compute(iters)
            t3 = time.perf_counter()
            c2 = thread_cpu()
            mine_ex.append(t1 - t0)
            mine_co.append(t3 - t2)
            for acc, d in ((cpu_ex, cpu_by_class(c0, c1)), (cpu_co, cpu_by_class(c1, c2)),
                           (wait_step, cpu_by_class(c0, c2, field=2))):
                for k, v in d.items():
                    acc[k] = acc.get(k, 0) + v
        if kind in ENGINE_EXCHANGES:
            check(kind)
        if stats0 is not None:  # the background loop's own counters, per step (worst rank)
            stats1 = engine.stats()
            mine = {k: (stats1[k] - stats0[k]) / args.steps for k in STAT_KEYS if k in stats1}
            for k, v in mine.items():
                r_stats = results[kind]["engine_stats"].setdefault(k, [])
                r_stats.append(max(a[k] for a in comm.allgather(mine)))
        # Worst rank per step.
        ex_all, co_all = np.zeros(args.steps), np.zeros(args.steps)
        comm.Allreduce(np.array(mine_ex), ex_all, op=MPI.MAX)
        comm.Allreduce(np.array(mine_co), co_all, op=MPI.MAX)
        r = results[kind]
        r["exchange_s"] += [float(x) for x in ex_all]
        r["compute_s"] += [float(x) for x in co_all]
        # Per-step CPU per thread class, worst rank's value per class.
        for key, acc in (("cpu_exchange_ns", cpu_ex), ("cpu_compute_ns", cpu_co), ("runqueue_wait_ns", wait_step)):
            allacc = comm.allgather({k: v / args.steps for k, v in acc.items()})
            for k in set().union(*allacc):
                r[key].setdefault(k, []).append(max(a.get(k, 0.0) for a in allacc))

    engine_kinds = [k for k in KINDS if k != "none" and k in args.kinds]
    for rnd in range(args.blocks):
        order = ["none", "ENGINE"] if rnd % 2 == 0 else ["ENGINE", "none"]
        for part in order:
            if part == "none":
                if "none" in args.kinds:
                    block("none")
                continue
            before = set(thread_cpu())
            engine.init(comm.py2f())
            engine_tids.clear()
            engine_tids.update(set(thread_cpu()) - before)
            ks = engine_kinds if rnd % 2 == 0 else list(reversed(engine_kinds))
            for k in ks:
                block(k)
            # Check the engine's results (each engine exchange block checked its own) before stopping it.
            failures = list(block_failures)
            block_failures.clear()
            if "small" in ks and small_out[0] != size * (size + 1) / 2:
                failures.append("4-byte allreduce gave %r" % float(small_out[0]))
            failures = sum(comm.allgather(failures), [])
            if failures:
                if rank == 0:
                    print("FAILED: " + "; ".join(failures), flush=True)
                engine.shutdown()
                return 1
            engine.shutdown()
    if rank == 0:
        with open(args.worker_json, "w") as f:
            json.dump({"iters": iters, "results": results}, f)
    return 0


def machine():
    info = {"host": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "load_average_start": os.getloadavg()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def summarize(merged):
    def med(xs):
        return float(np.median(np.array(xs) * 1e6)) if xs else None
    out = {}
    for build, res in merged.items():
        b = {}
        for k, r in res.items():
            if not r["compute_s"]:
                continue
            b[k] = {"exchange_median_us": med(r["exchange_s"]),
                    "exchange_p10_us": float(np.percentile(np.array(r["exchange_s"]) * 1e6, 10)),
                    "exchange_p90_us": float(np.percentile(np.array(r["exchange_s"]) * 1e6, 90)),
                    "compute_median_us": med(r["compute_s"]),
                    "steps": len(r["compute_s"]),
                    "cpu_exchange_us_per_step": {c: float(np.median(v)) / 1e3 for c, v in r["cpu_exchange_ns"].items()},
                    "cpu_compute_us_per_step": {c: float(np.median(v)) / 1e3 for c, v in r["cpu_compute_ns"].items()},
                    "runqueue_wait_us_per_step": {c: float(np.median(v)) / 1e3
                                                  for c, v in r["runqueue_wait_ns"].items()},
                    "engine_stats_per_step": {c: float(np.median(v)) for c, v in r["engine_stats"].items()}}
        if "none" in b:
            base_c, base_x = b["none"]["compute_median_us"], b["none"]["exchange_median_us"]
            for k in b:
                b[k]["compute_vs_none"] = b[k]["compute_median_us"] / base_c
                if k in ENGINE_EXCHANGES + ("mpi_alive",):
                    b[k]["exchange_vs_none_mpi"] = b[k]["exchange_median_us"] / base_x
        if "mpi_alive" in b:
            for k in ENGINE_EXCHANGES:
                if k in b:
                    b[k]["exchange_vs_mpi_alive"] = b[k]["exchange_median_us"] / b["mpi_alive"]["exchange_median_us"]
        out[build] = b
    return out


def driver(args):
    builds = []
    for spec in args.build or ["current=" + default_so()]:
        label, _, path = spec.partition("=")
        builds.append((label, os.path.abspath(path)))
    env = mpirun_env()
    merged = {label: {k: {"exchange_s": [], "compute_s": [], "cpu_exchange_ns": {}, "cpu_compute_ns": {},
                          "runqueue_wait_ns": {}, "engine_stats": {}} for k in KINDS} for label, _ in builds}
    iters = {}
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info = machine()
    loads = []  # /proc/loadavg after each launch: the machine is shared
    for rnd in range(args.rounds):
        seq = builds if rnd % 2 == 0 else list(reversed(builds))
        for label, so in seq:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
                out = tmp.name
            cmd = ["mpirun", "-np", str(args.np), "--bind-to", "none", sys.executable, os.path.abspath(__file__),
                   "--worker", "--worker-json", out, "--engine-so", so, "--blocks", str(args.blocks),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--compute-ms", str(args.compute_ms),
                   "--table", args.table, "--scale", str(args.scale), "--kinds", ",".join(args.kinds)]
            p = subprocess.run(cmd, env=env)
            if p.returncode != 0:
                print("round %d build %s failed (exit %d)" % (rnd, label, p.returncode))
                return 1
            with open(out) as f:
                w = json.load(f)
            os.unlink(out)
            iters[label] = w["iters"]
            for k, r in w["results"].items():
                m = merged[label][k]
                m["exchange_s"] += r["exchange_s"]
                m["compute_s"] += r["compute_s"]
                for key in ("cpu_exchange_ns", "cpu_compute_ns", "runqueue_wait_ns", "engine_stats"):
                    for c, v in r[key].items():
                        m[key].setdefault(c, []).extend(v)
            loads.append({"round": rnd, "build": label, "loadavg": os.getloadavg()})
            print("round %d %s done (load %.2f %.2f %.2f)" % ((rnd, label) + os.getloadavg()), flush=True)
    summary = summarize(merged)
    result = {"benchmark": "engine_cpu_cost", "date": started, "commit": commit(), "machine": info,
              "load_average_end": os.getloadavg(), "load_average_per_launch": loads, "ranks": args.np, "table": os.path.relpath(args.table, REPO),
              "scale": args.scale, "rounds": args.rounds, "blocks_per_round": args.blocks,
              "steps_per_block": args.steps, "compute_ms_target": args.compute_ms, "compute_iters": iters,
              "builds": {label: so for label, so in builds},
              "env": {k: v for k, v in os.environ.items() if k.startswith("NVGROUP_")},
              "summary": summary}
    print("# engine_cpu_cost: %d ranks, %d rounds x %d blocks x %d steps, compute ~%.1f ms, commit %s, "
          "load %s at start, %s at end" % (args.np, args.rounds, args.blocks, args.steps, args.compute_ms,
                                           result["commit"][:12], "/".join("%.2f" % x for x in info["load_average_start"]),
                                           "/".join("%.2f" % x for x in result["load_average_end"])))
    print("%-8s %-10s %11s %11s %9s %9s %9s  %s" % ("build", "block", "exchange_us", "compute_us", "comp/none",
                                                     "exch/mpi", "exch/mpiA", "CPU per step in compute (us, worst rank)"))
    for label, b in summary.items():
        for k in KINDS:
            if k not in b:
                continue
            r = b[k]
            cpu = ", ".join("%s=%.0f" % kv for kv in sorted(r["cpu_compute_us_per_step"].items()))
            print("%-8s %-10s %11.1f %11.1f %9.3f %9s %9s  %s" % (
                label, k, r["exchange_median_us"], r["compute_median_us"], r.get("compute_vs_none", float("nan")),
                "%.2f" % r["exchange_vs_none_mpi"] if "exchange_vs_none_mpi" in r else "-",
                "%.2f" % r["exchange_vs_mpi_alive"] if "exchange_vs_mpi_alive" in r else "-", cpu))
    print("exch/mpi: exchange / the raw MPI_Allreduce of the same bytes with no engine (block none); "
          "exch/mpiA: / the raw MPI_Allreduce with the engine alive (block mpi_alive)")
    print("time runnable but not running, per step (us, worst rank):")
    for label, b in summary.items():
        for k in KINDS:
            if k in b:
                print("%-8s %-10s %s" % (label, k, ", ".join(
                    "%s=%.0f" % kv for kv in sorted(b[k]["runqueue_wait_us_per_step"].items()))))
    print("engine counters per step (median over blocks, worst rank; *_s in us):")
    for label, b in summary.items():
        for k in KINDS:
            st = b.get(k, {}).get("engine_stats_per_step")
            if st:
                print("%-8s %-10s %s" % (label, k, ", ".join(
                    "%s=%.3g" % (c, v * 1e6 if c.endswith("_s") else v) for c, v in sorted(st.items()))))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.png:
        plt = pyplot()
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        labels = list(summary)
        width = 0.8 / max(1, len(labels))
        for j, label in enumerate(labels):
            b = summary[label]
            ks = [k for k in KINDS if k in b]
            xs = np.arange(len(ks)) + j * width
            axes[0].bar(xs, [b[k]["compute_vs_none"] for k in ks], width, label=label)
            exch = [k for k in ("none", "engine", "per_tensor", "mpi_alive") if k in b]
            axes[1].bar(np.arange(len(exch)) + j * width, [b[k]["exchange_median_us"] for k in exch], width,
                        label=label)
        axes[0].set_xticks(np.arange(len(ks)) + width * (len(labels) - 1) / 2, ks)
        axes[0].axhline(1.05, color="gray", ls="--", lw=0.8)
        axes[0].set_ylabel("compute after exchange / no engine")
        axes[0].set_ylim(bottom=0.9)
        axes[1].set_xticks(np.arange(len(exch)) + width * (len(labels) - 1) / 2,
                           [{"none": "mpi (no engine)", "engine": "engine grouped", "per_tensor": "engine per tensor",
                             "mpi_alive": "mpi (engine alive)"}[k] for k in exch])
        axes[1].set_ylabel("exchange, us (median, worst rank)")
        for ax in axes:
            ax.legend(fontsize=8)
        fig.suptitle("%d ranks, %s at 1/%d; %s, %s" % (args.np, os.path.basename(args.table), args.scale,
                                                        started[:16], result["commit"][:8]), fontsize=9)
        save_png(fig, args.png)
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6, help="launches per build (builds alternate)")
    p.add_argument("--blocks", type=int, default=2, help="alternations of engine/no engine per launch")
    p.add_argument("--steps", type=int, default=30, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compute-ms", type=float, default=4.0)
    p.add_argument("--table", default=os.path.join(REPO, "benchmarks", "resnet50_gradients.txt"))
    p.add_argument("--scale", type=int, default=64)
    p.add_argument("--kinds", type=lambda s: s.split(","), default=KINDS)
    p.add_argument("--build", action="append", help="LABEL=path of an _engine*.so (repeat to compare builds)")
    p.add_argument("--json")
    p.add_argument("--png")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-json", help=argparse.SUPPRESS)
    p.add_argument("--engine-so", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.engine_so = args.engine_so or default_so()
        return run_worker(worker, args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
