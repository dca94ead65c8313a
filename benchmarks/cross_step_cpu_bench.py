"""The cross-group step on host buffers: the CPU communicator forced through the
hierarchy as groups of one rank (NVGROUP_ALLREDUCE_ALGORITHM=hierarchical,
group_size=1), so every allreduce is chunk jobs of CrossExchange
(cc/algorithms/cross_exchange.h), against MPI_Allreduce of the same numpy
buffer (mpi4py), float32 sum.

Two builds of the engine module side by side, launch after launch alternated
(base, new, base, new, ...), so load drifts hit both alike:

    python benchmarks/cross_step_cpu_bench.py --base /tmp/base_tree --new . \\
        [--np 2] [--rounds 5] [--json out.json]

--base / --new are directories holding a built nvgroup_tf/_engine*.so (a
checkout of another commit with its module); --base-env / --new-env KEY=VALUE
(repeatable) set the engine's settings of one side, so one tree can run
against itself with two settings:

    python benchmarks/cross_step_cpu_bench.py --base . --new . \
        --base-env NVGROUP_PIPELINE_MIN_CHUNK=262144 --new-env NVGROUP_PIPELINE_MIN_CHUNK=1048576
 Per launch and size every call is
timed alone (barrier, call, per-call time = max over ranks), the launch reports
the median; the table gives the median over the launches of each build. The
smallest sizes are the fixed cost per call. Results are checked every call
(small integers: every order sums them exactly).
"""
import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.bench_common import commit, mpirun_env  # noqa: E402

SIZES = [4, 4 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 16 << 20]


def iterations(nbytes):
    return int(max(20, min(300, (64 << 20) // max(nbytes, 1))))


def worker(args):
    sys.path.insert(0, os.path.abspath(args.root))
    import numpy as np
    from mpi4py import MPI
    import nvgroup_tf._engine as engine

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    os.environ["NVGROUP_ALLREDUCE_ALGORITHM"] = "hierarchical"  # read at creation
    nv = engine.Communicator(comm.py2f(), "cpu", group_size=1, registered_bytes=max(SIZES))
    rows = []
    for nbytes in SIZES:
        count = nbytes // 4
        idx = np.arange(count, dtype=np.int64)
        x = ((idx * 7 + rank) % 13 - 6).astype(np.float32)
        want = sum(((idx * 7 + r) % 13 - 6) for r in range(size)).astype(np.float32)
        out = np.empty_like(x)
        n = iterations(nbytes)
        times = {"nvgroup": np.zeros(n), "mpi": np.zeros(n)}
        wrong = 0
        for _ in range(3):  # warmup
            nv.allreduce(x.ctypes.data, out.ctypes.data, count, "float32", "sum")
            comm.Allreduce(x, out, op=MPI.SUM)
        for i in range(n):
            for name in ("nvgroup", "mpi"):
                out.fill(np.nan)
                comm.Barrier()
                t0 = time.perf_counter()
                if name == "nvgroup":
                    nv.allreduce(x.ctypes.data, out.ctypes.data, count, "float32", "sum")
                else:
                    comm.Allreduce(x, out, op=MPI.SUM)
                times[name][i] = time.perf_counter() - t0
                wrong += int(np.count_nonzero(out.view(np.uint32) != want.view(np.uint32)))
        row = {"bytes": nbytes, "iters": n, "wrong": comm.allreduce(wrong)}
        for name, t in times.items():
            worst = np.empty_like(t)
            comm.Allreduce(t, worst, op=MPI.MAX)
            row[name + "_us"] = float(np.median(worst) * 1e6)
        rows.append(row)
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def launch(root, np_, settings):
    env = mpirun_env()
    env["PYTHONPATH"] = os.path.abspath(root)
    env.update(settings)
    cmd = ["mpirun", "-np", str(np_), "--bind-to", "none", "-x", "PYTHONPATH"]
    for key in settings:
        cmd += ["-x", key]
    cmd += [sys.executable, os.path.abspath(__file__), "--worker", "--root", root]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError("launch on %s failed (rc %d):\n%s\n%s" % (root, out.returncode, out.stdout, out.stderr))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", default=REPO, help=argparse.SUPPRESS)
    p.add_argument("--base", help="tree with the baseline build")
    p.add_argument("--new", default=REPO, help="tree with the build under test (default: this one)")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default="")
    p.add_argument("--base-env", action="append", default=[], help="KEY=VALUE setting of the base side")
    p.add_argument("--new-env", action="append", default=[], help="KEY=VALUE setting of the new side")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    builds = [("base", args.base), ("new", args.new)] if args.base else [("new", args.new)]
    load_before = os.getloadavg()
    settings = {"base": dict(kv.split("=", 1) for kv in args.base_env),
                "new": dict(kv.split("=", 1) for kv in args.new_env)}
    runs = {name: [] for name, _ in builds}
    for _ in range(args.rounds):
        for name, root in builds:
            runs[name].append(launch(root, args.np, settings[name]))
    load_after = os.getloadavg()
    table = []
    for i, nbytes in enumerate(SIZES):
        row = {"bytes": nbytes}
        for name, _ in builds:
            per = [r[i] for r in runs[name]]
            row[name + "_nvgroup_us"] = statistics.median(x["nvgroup_us"] for x in per)
            row[name + "_mpi_us"] = statistics.median(x["mpi_us"] for x in per)
            row[name + "_wrong"] = sum(x["wrong"] for x in per)
        table.append(row)
    head = "%10s" % "bytes" + "".join("  %12s %12s" % (n + " nvgroup", n + " mpi") for n, _ in builds)
    print("# cross step on host buffers, %d ranks as groups of 1, median of %d launches per build, "
          "load %.2f -> %.2f" % (args.np, args.rounds, load_before[0], load_after[0]))
    print(head + "  (us per call; wrong elements: %s)" % {n: sum(r[n + "_wrong"] for r in table) for n, _ in builds})
    for row in table:
        print("%10d" % row["bytes"] + "".join("  %12.1f %12.1f" % (row[n + "_nvgroup_us"], row[n + "_mpi_us"])
                                              for n, _ in builds))
    result = {"tool": "cross_step_cpu_bench", "machine": socket.gethostname(), "cpus": os.cpu_count(),
              "platform": platform.platform(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "commit": {name: commit(os.path.abspath(root)) for name, root in builds},
              "settings": {name: settings[name] for name, _ in builds},
              "ranks": args.np, "rounds": args.rounds, "load_before": load_before, "load_after": load_after,
              "rows": table, "launches": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if any(r[n + "_wrong"] for r in table for n, _ in builds) else 0


if __name__ == "__main__":
    sys.exit(main())
