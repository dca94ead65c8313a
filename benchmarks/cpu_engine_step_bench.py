"""CPU engine step benchmark: a model's gradient set through the engine (pybind
module `nvgroup_tf._engine`) against one MPI_Allreduce of the same bytes.

    mpirun -np 2 --bind-to none python benchmarks/cpu_engine_step_bench.py \
        [--table benchmarks/resnet50_gradients.txt] [--scale 64] [--steps 200]
        [--json benchmarks/results/cpu_engine_step_2rank.json] [--png ...png]

Per repetition, in the same run and interleaved (so load drifts hit all three
alike), it times the call styles of one step (float32 Sum):
  per_tensor  one `allreduce_async` per gradient (in reverse order, as backprop
              produces them), then one `wait_all` of the handles (a build
              without it: `wait` on each);
  grouped     one `grouped_allreduce_async` of every gradient, then `wait_all`;
  registered  the same group registered once (`register_allreduce_group`), one
              `registered_group_allreduce_async` per step with the pointers,
              then `wait` (builds without registered groups leave it out);
  mpi         one `MPI_Allreduce` (mpi4py, buffers) of a contiguous buffer with
              the same number of bytes.
Gradient sizes are the table's element counts divided by --scale (at least one
element): ResNet-50's 214 gradients at 1/64 are 1.6 MB. A step's time is the
slowest rank's (ranks start each step after a barrier); the table reports the
median and the 10th/90th percentiles over steps, and each engine style's ratio
of medians against `mpi`.

Engine counters (`_engine.stats()`, where the build has it) are read around each
style's steps and reported per step: background-loop cycles, negotiation rounds
through rank 0, fused buckets, tensors that ran on the cached-plan path, and
where the loop's time went.

Checks (a benchmark whose result is wrong is not a benchmark): inputs are random
float32; after the last step every engine output is compared bitwise with
float32(x0 + x1 + ...) computed in float64 from every rank's inputs (exact for 2
ranks, where the one rounding is the only one) and a digest of the outputs is
compared across ranks; any difference fails the run.
"""
import argparse
import datetime
import hashlib
import json
import os
import platform
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import nvgroup_tf._engine as engine  # noqa: E402
from bench_common import commit, load_counts  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size


def machine():
    info = {"host": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info["load_average"] = os.getloadavg()
    return info


def stats():
    return engine.stats() if hasattr(engine, "stats") else None


def stats_delta(before, after, steps):
    if before is None or after is None:
        return None
    return {k: (after[k] - before[k]) / steps for k in after if isinstance(after[k], (int, float))}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--table", default=os.path.join(REPO, "benchmarks", "resnet50_gradients.txt"))
    p.add_argument("--scale", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--styles", default="per_tensor,grouped,registered,mpi")
    p.add_argument("--json")
    p.add_argument("--png")
    p.add_argument("--label", default="", help="free text stored with the results (e.g. 'before')")
    args = p.parse_args()

    engine.init(COMM.py2f())
    counts = load_counts(args.table, args.scale)
    n = len(counts)
    total = sum(counts)
    rng = np.random.default_rng([12345, RANK])
    inputs = [rng.uniform(-1.0, 1.0, c).astype(np.float32) for c in counts]
    outputs = [np.zeros(c, np.float32) for c in counts]
    flat_in = np.concatenate(inputs)
    flat_out = np.zeros_like(flat_in)
    # Distinct names per style: the same name alternating between a grouped
    # and an ungrouped request would be renegotiated every step.
    names = ["pt/grad_%d" % t for t in range(n)]
    order = list(range(n - 1, -1, -1))  # backprop order
    items = [("gr/grad_%d" % t, inputs[t].ctypes.data, outputs[t].ctypes.data, [counts[t]], "float32")
             for t in order]

    in_ptrs = [x.ctypes.data for x in inputs]  # fixed buffers: addresses taken once
    out_ptrs = [y.ctypes.data for y in outputs]
    shapes = [[c] for c in counts]
    wait_all = getattr(engine, "wait_all", None)

    def finish(hs):
        if wait_all is not None:
            wait_all(hs)
        else:  # builds without wait_all (older engine builds)
            for h in hs:
                engine.wait(h)

    def per_tensor():
        finish([engine.allreduce_async(names[t], in_ptrs[t], out_ptrs[t], shapes[t], "float32") for t in order])

    def grouped():
        finish(engine.grouped_allreduce_async(items))

    def mpi():
        COMM.Allreduce(flat_in, flat_out, op=MPI.SUM)

    runners = {"per_tensor": per_tensor, "grouped": grouped, "mpi": mpi}
    styles = args.styles.split(",")
    if hasattr(engine, "register_allreduce_group"):
        group = engine.register_allreduce_group([("rg/grad_%d" % t, [counts[t]], "float32") for t in order])
        group_in = np.array([in_ptrs[t] for t in order], dtype=np.uint64)
        group_out = np.array([out_ptrs[t] for t in order], dtype=np.uint64)

        def registered():
            engine.wait(engine.registered_group_allreduce_async(group, group_in, group_out))
        runners["registered"] = registered
    else:
        styles = [s for s in styles if s != "registered"]
    times = {s: [] for s in styles}
    counters = {s: None for s in styles}
    for s in styles:  # warmup: negotiation, cache fill, page faults
        for _ in range(args.warmup):
            runners[s]()
    totals = {s: None for s in styles}
    for step in range(args.steps):
        for s in styles:
            COMM.Barrier()
            before = stats()
            t0 = time.perf_counter()
            runners[s]()
            dt = time.perf_counter() - t0
            after = stats()
            d = stats_delta(before, after, 1)
            if d is not None:
                totals[s] = d if totals[s] is None else {k: totals[s][k] + d[k] for k in d}
            times[s].append(COMM.allreduce(dt, op=MPI.MAX))
    for s in styles:
        if totals[s] is not None:
            counters[s] = {k: v / args.steps for k, v in totals[s].items()}

    # Correctness of the last engine step (outputs hold the grouped or per-tensor result).
    failures = []
    all_inputs = COMM.allgather(flat_in)
    ref = np.sum([x.astype(np.float64) for x in all_inputs], axis=0).astype(np.float32)
    if set(styles) & {"per_tensor", "grouped", "registered"}:
        got = np.concatenate(outputs)
        if SIZE == 2 and not np.array_equal(got.view(np.uint32), ref.view(np.uint32)):
            failures.append("engine output differs from float32(x0 + x1) in %d elements" % int(np.sum(got != ref)))
        if SIZE != 2 and not np.allclose(got, ref, rtol=1e-5, atol=1e-6):
            failures.append("engine output differs from the float64 reference")
        digests = COMM.allgather(hashlib.sha256(got.tobytes()).hexdigest())
        if len(set(digests)) != 1:
            failures.append("engine outputs differ across ranks")
    if "mpi" in styles and not np.allclose(flat_out, ref, rtol=1e-5, atol=1e-6):
        failures.append("MPI_Allreduce output differs from the reference")
    failures = sum(COMM.allgather(failures), [])

    if RANK == 0:
        def summary(ts):
            a = np.array(ts) * 1e6
            return {"median_us": float(np.median(a)), "p10_us": float(np.percentile(a, 10)),
                    "p90_us": float(np.percentile(a, 90)), "mean_us": float(np.mean(a))}
        result = {
            "benchmark": "cpu_engine_step",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit(),
            "machine": machine(),
            "label": args.label,
            "ranks": SIZE,
            "table": os.path.relpath(args.table, REPO),
            "scale": args.scale,
            "tensors": n,
            "bytes": total * 4,
            "steps": args.steps,
            "env": {k: v for k, v in os.environ.items() if k.startswith("NVGROUP_")},
            "styles": {s: dict(summary(times[s]), counters=counters[s]) for s in styles},
            "failures": failures,
        }
        if "mpi" in styles:
            base = result["styles"]["mpi"]["median_us"]
            for s in styles:
                result["styles"][s]["ratio_vs_mpi"] = result["styles"][s]["median_us"] / base
        print("# cpu_engine_step: %d ranks, %d tensors, %.2f MB, %d steps, commit %s %s" %
              (SIZE, n, total * 4 / 1e6, args.steps, result["commit"][:12], args.label))
        print("%-11s %10s %10s %10s %8s" % ("style", "median_us", "p10_us", "p90_us", "x_mpi"))
        for s in styles:
            r = result["styles"][s]
            print("%-11s %10.1f %10.1f %10.1f %8s" % (s, r["median_us"], r["p10_us"], r["p90_us"],
                                                     "%.2f" % r["ratio_vs_mpi"] if "ratio_vs_mpi" in r else "-"))
            if r["counters"]:
                print("            per step: " + ", ".join("%s=%.3g" % kv for kv in sorted(r["counters"].items())))
        if failures:
            print("FAILED: " + "; ".join(failures))
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        if args.png:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots(figsize=(6, 3.5))
            meds = [result["styles"][s]["median_us"] for s in styles]
            lo = [m - result["styles"][s]["p10_us"] for s, m in zip(styles, meds)]
            hi = [result["styles"][s]["p90_us"] - m for s, m in zip(styles, meds)]
            ax.bar(styles, meds, yerr=[lo, hi], capsize=4, color=["tab:blue", "tab:green", "tab:olive", "tab:gray"][:len(styles)])
            for i, m in enumerate(meds):
                ax.text(i, m, "%.0f us" % m, ha="center", va="bottom")
            ax.set_ylabel("step time, us (median, p10-p90)")
            ax.set_title("%d ranks, %d tensors, %.1f MB (%s, %s)" %
                         (SIZE, n, total * 4 / 1e6, result["date"][:10], result["commit"][:8]), fontsize=9)
            fig.tight_layout()
            fig.savefig(args.png, dpi=110)
    engine.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
