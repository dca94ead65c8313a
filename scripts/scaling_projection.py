"""Scaling PROJECTION (a model, not a measurement) of ResNet-50 data-parallel
training with the NV-group allreduce on 1..32 nodes of 6 and of 8 GPUs.

Inputs (each printed into the output, change them with the flags):
  * NV-group kernel time by message size: measured, benchmarks/results/
    allreduce_perf_h200x2.json (impl nvgroup-reg, in place on the registered
    buffer, 2x H200) -- the intra-node group step (RS + AG) of a bucket, scaled
    by --intra-scale for other GPUs/links (V100 NVLink2 ~ 1/3 of H200 NVLink4:
    --intra-scale 3 is the Summit default here; an assumption);
  * host-staged MPI per chunk: measured, the same file's mpi-host rows (D2H +
    MPI_Allreduce + H2D of a slice-sized buffer on one node): the staging cost
    of one chunk's slice;
  * ResNet-50 step compute time per GPU: --compute-ms (an input, not measured
    here; default 155 ms: V100, batch 64, mixed precision, order of magnitude
    from public MLPerf-era figures); backward = 2/3 of it;
  * the bucket schedule: nvgroup_tf.bucketing.assign_buckets on the 214
    ResNet-50 gradients (benchmarks/resnet50_gradients.txt), float32 or float16
    (--grad-bytes), first bucket 1 MiB, cap --bucket-cap-mb (25);
  * interconnect: --node-gbps per node (default Summit EDR 2 x 100 Gb/s = 25
    GB/s, shared by the node's GPUs) and --latency-us per message (1.5 us).
Model of one bucket of B bytes on N nodes of G GPUs: the group step costs the
measured kernel time of B; the cross step moves per GPU 2 (N-1)/N of its slice
B/G (reduce-scatter + allgather, CrossExchange) at node_bw / G, in chunks of
--chunk-mb, pipelined with the staging (per chunk max(staging, network) plus
one fill), plus 2 (N-1) latencies per chunk. Buckets become ready during
backward in proportion to the gradient bytes computed; they are reduced in
order, overlapping the rest of backward. Efficiency = T(1 GPU) / T(N GPUs).

    .venv/bin/python scripts/scaling_projection.py   # writes docs/SCALING_PROJECTION.{md,json,png}
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from nvgroup_tf.bucketing import assign_buckets  # noqa: E402  (pure Python, no TF)

PAPER = {16: 0.939, 192: 0.897}  # ICS 2020 NV-group paper, ResNet-50 on Summit


def load_gradients():
    sizes = []
    with open(os.path.join(REPO, "benchmarks", "resnet50_gradients.txt")) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            sizes.append(int(line.split()[1]))
    return sizes[::-1]  # backprop order: the last layer's gradient first


def measured_curve(path, impl, column):
    d = json.load(open(path))
    rows = sorted((r["bytes"], r[column]) for r in d["results"] if r["impl"] == impl and r.get(column))
    return np.array([b for b, _ in rows], float), np.array([t for _, t in rows], float), d


def interp(xs, ys, x):
    """log-log interpolation, linear extrapolation of time per byte above the largest size."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    return float(np.exp(np.interp(np.log(x), np.log(xs), np.log(ys))))


def bucket_time_us(b, nodes, gpus, a, kernel, staging):
    t = kernel(b) * a.intra_scale if gpus > 1 else 0.0
    if nodes == 1:
        return t
    chunk = a.chunk_mb * 2 ** 20
    n_chunks = max(1, int(np.ceil(b / chunk)))
    slice_b = min(b, chunk) / gpus
    net = 2 * (nodes - 1) / nodes * slice_b / (a.node_gbps * 1e9 / 8 / gpus) * 1e6
    net += 2 * (nodes - 1) * a.latency_us
    stage = staging(slice_b)
    per_chunk = max(net, stage)
    return t + n_chunks * per_chunk + min(net, stage)  # pipeline fill


def step_ms(nodes, gpus, a, buckets, kernel, staging):
    compute = a.compute_ms * 1e3
    forward, backward = compute / 3, compute * 2 / 3
    if nodes * gpus == 1:
        return compute / 1e3
    total = sum(sum(bk) for bk in buckets)
    end, done = forward, 0
    for bk in buckets:
        done += sum(bk)
        ready = forward + backward * done / total
        end = max(end, ready) + bucket_time_us(sum(bk), nodes, gpus, a, kernel, staging)
    return max(end, forward + backward) / 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compute-ms", type=float, default=155.0)
    p.add_argument("--node-gbps", type=float, default=200.0)
    p.add_argument("--latency-us", type=float, default=1.5)
    p.add_argument("--intra-scale", type=float, default=3.0)
    p.add_argument("--chunk-mb", type=float, default=4.0)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--grad-bytes", type=int, default=4)
    p.add_argument("--measured", default=os.path.join(REPO, "benchmarks", "results", "allreduce_perf_h200x2.json"))
    p.add_argument("--out", default=os.path.join(REPO, "docs", "SCALING_PROJECTION"))
    a = p.parse_args()

    kx, ky, meta = measured_curve(a.measured, "nvgroup-reg", "ip_us")
    sx, sy, _ = measured_curve(a.measured, "mpi-host", "oop_us")
    kernel = lambda b: interp(kx, ky, b)
    staging = lambda b: interp(sx, sy, b)
    sizes = [n * a.grad_bytes for n in load_gradients()]
    idx = assign_buckets(sizes, ["g"] * len(sizes), int(a.bucket_cap_mb * 2 ** 20), 2 ** 20)
    buckets = [[sizes[i] for i in bk] for bk in idx]
    t1 = step_ms(1, 1, a, buckets, kernel, staging)
    rows = []
    for gpus in (6, 8):
        for nodes in (1, 2, 4, 8, 16, 32):
            t = step_ms(nodes, gpus, a, buckets, kernel, staging)
            rows.append({"gpus_per_node": gpus, "nodes": nodes, "gpus": nodes * gpus, "step_ms": round(t, 2),
                         "efficiency": round(t1 / t, 4)})
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "?"
    inputs = {k: v for k, v in vars(a).items() if k not in ("out",)}
    inputs["measured"] = os.path.relpath(a.measured, REPO)
    inputs["measured_gpu"] = meta.get("gpu")
    inputs["measured_date"] = meta.get("date")
    inputs["buckets"] = len(buckets)
    inputs["gradient_mb"] = round(sum(sizes) / 2 ** 20, 1)
    out = {"kind": "PROJECTION (model, not measured)", "date": datetime.date.today().isoformat(),
           "commit": commit, "inputs": inputs, "one_gpu_step_ms": t1, "rows": rows, "paper": PAPER}
    with open(a.out + ".json", "w") as f:
        json.dump(out, f, indent=1)
    lines = ["# Scaling projection (a model, NOT a measurement)", "",
             "Generated by `scripts/scaling_projection.py` on %s at commit %s. Every number below is "
             "computed from the inputs listed, with the model in the script's docstring; nothing here "
             "ran on more than one machine." % (out["date"], commit), "",
             "Inputs: " + ", ".join("%s=%s" % kv for kv in sorted(inputs.items())), "",
             "| GPUs/node | nodes | GPUs | step ms | efficiency |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append("| %d | %d | %d | %.1f | %.1f%% |" % (r["gpus_per_node"], r["nodes"], r["gpus"],
                                                        r["step_ms"], 100 * r["efficiency"]))
    lines += ["", "Paper (measured on Summit, ICS 2020): 93.9%% at 16 GPUs, 89.7%% at 192 GPUs (32 nodes x 6). "
              "The projection for 32 x 6 = 192 GPUs is %.1f%%; 16 GPUs are not a whole number of 6-GPU "
              "nodes (the nearest rows: 12 and 24 GPUs)." % (100 * [r for r in rows if r["gpus"] == 192][0]["efficiency"]),
              "", "Why the projection is higher than the paper: the model overlaps communication with "
              "backward perfectly and has no stragglers, input pipeline, framework dispatch or "
              "negotiation cost, and its intra-node times are H200 kernels scaled by an assumed factor; "
              "it is an upper bound of what the data path allows, to be replaced by measurements.",
              "", "![projection](SCALING_PROJECTION.png)", ""]
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for gpus in (6, 8):
            rs = [r for r in rows if r["gpus_per_node"] == gpus]
            ax.plot([r["gpus"] for r in rs], [100 * r["efficiency"] for r in rs], "o-", label="%d GPUs/node (projection)" % gpus)
        ax.plot(list(PAPER), [100 * v for v in PAPER.values()], "k*", ms=12, label="paper, Summit (measured)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("scaling efficiency %")
        ax.set_title("PROJECTION: ResNet-50, %.0f Gb/s per node, compute %.0f ms" % (a.node_gbps, a.compute_ms))
        ax.legend()
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(a.out + ".png", dpi=110)
    except ImportError:
        print("matplotlib missing: no PNG")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
