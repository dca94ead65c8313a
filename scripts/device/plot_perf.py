"""Plots allreduce_perf JSON (cc/tools/allreduce_perf --json): bus bandwidth
vs message size for every implementation, and latency for small messages.

Usage: python scripts/device/plot_perf.py RESULT.json OUT.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    with open(src) as f:
        data = json.load(f)
    series = {}
    for r in data["results"]:
        series.setdefault(r["impl"], []).append(r)
    fig, (bw, lat) = plt.subplots(1, 2, figsize=(13, 5))
    style = {"nccl": ("NCCL %d" % data["nccl_version"], "o", "oop"),
             "nvgroup": ("NV-group, user buffers", "s", "oop"),
             "nvgroup-reg": ("NV-group, in place on the registered buffer (engine path)", "^", "ip"),
             "mpi-host": ("host-staged MPI", "x", "oop")}
    for impl, (label, marker, col) in style.items():
        rows = [r for r in series.get(impl, []) if r[col + "_us"] > 0]
        if rows:
            bw.plot([r["bytes"] for r in rows], [r[col + "_busbw"] for r in rows], marker=marker,
                    label=label)
    bw.set_xscale("log", base=2)
    bw.set_xlabel("message size (bytes)")
    bw.set_ylabel("bus bandwidth (GB/s)")
    bw.set_title("allreduce float32 sum, %d x %s" % (data["nranks"], data["gpu"]))
    bw.grid(True, which="both", alpha=0.3)
    bw.legend(fontsize=8)
    for impl, label in (("nccl", "NCCL, eager"), ("nvgroup", "NV-group, eager"),
                        ("nccl-graph", "NCCL, CUDA graph"), ("nvgroup-graph", "NV-group, CUDA graph")):
        rows = [r for r in series.get(impl, []) if r["oop_us"] > 0 and r["bytes"] <= (1 << 20)]
        if rows:
            lat.plot([r["bytes"] for r in rows], [r["oop_us"] for r in rows], marker="o",
                     linestyle="--" if "graph" in impl else "-", label=label)
    lat.set_xscale("log", base=2)
    lat.set_xlabel("message size (bytes)")
    lat.set_ylabel("time per allreduce (us)")
    lat.set_title("latency up to 1 MiB (%s)" % data["date"][:10])
    lat.grid(True, which="both", alpha=0.3)
    lat.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
