"""Table (JSON) and plot (PNG) of a results folder's cpu_engine_step_bench launches (quiet_N.json and
load_N.json: benchmarks/cpu_engine_step_bench.py, 2 ranks; every style's median step and its ratio to
the interleaved MPI_Allreduce of the same launch), written into the folder as summary.{json,png}.

    python benchmarks/cpu_engine_step_summary.py benchmarks/results/cpu_engine_step_b7344df"""
import glob
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

os.chdir(sys.argv[1])
STYLES = ["per_tensor", "grouped", "registered", "mpi"]
out = {"tool": "benchmarks/cpu_engine_step_bench.py (2 ranks, ResNet-50's 214 gradients at 1/64, 1.6 MB)",
       "launches": []}
for f in sorted(glob.glob("quiet_*.json")) + sorted(glob.glob("load_*.json")):
    d = json.load(open(f))
    mpi = d["styles"]["mpi"]["median_us"]
    out["launches"].append({"file": f, "label": d["label"], "date": d["date"], "commit": d["commit"],
                            "median_us": {s: d["styles"][s]["median_us"] for s in STYLES},
                            "x_mpi": {s: d["styles"][s]["median_us"] / mpi for s in STYLES}})
out["machine"] = d["machine"]
json.dump(out, open("summary.json", "w"), indent=1)
fig, ax = plt.subplots(figsize=(9, 4))
for i, s in enumerate(STYLES[:-1]):
    xs = [j + 0.25 * (i - 1) for j in range(len(out["launches"]))]
    ax.bar(xs, [ln["x_mpi"][s] for ln in out["launches"]], width=0.25, label=s)
ax.axhline(1.3, ls="--", c="gray", lw=0.8)
ax.axhline(2.0, ls=":", c="gray", lw=0.8)
ax.set_xticks(range(len(out["launches"])))
ax.set_xticklabels([ln["file"].replace(".json", "") for ln in out["launches"]])
ax.set_ylabel("median step / MPI_Allreduce of the same launch")
ax.set_title("CPU engine step, 2 ranks, 2-core VM, %s (%s)" % (d["commit"][:7], d["date"][:10]))
ax.legend()
fig.tight_layout()
fig.savefig("summary.png", dpi=110)
for ln in out["launches"]:
    print(ln["file"], {s: round(v, 2) for s, v in ln["x_mpi"].items() if s != "mpi"},
          round(ln["median_us"]["mpi"]))
