"""Medians (JSON) and a plot (PNG) of the three bisect runs' TSVs in this folder
(scripts/device/engine_perf_bisect.sh's output, copied from the device call's log)."""
import collections
import csv
import json
import statistics as st

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RUNS = [("run1_7trees.tsv", "3 reps, 3 configs, the 7 points of the last plan"),
        ("run2_engine_cost_branch.tsv", "6 reps, 1 rank per tensor, the engine-cost branch (87774d0..c850f9f)"),
        ("run3_after_engine_cost.tsv", "7 reps (rep 1 lost for 5 trees), 1 rank per tensor, c850f9f..head"),
        ("run4_after_engine_cost_6reps.tsv", "6 reps, 1 rank per tensor, c850f9f..head (head: 5cc5219's cc/, 2026-12-07 08:11)")]
out = {"tool": "scripts/device/engine_perf_bisect.sh (engine_perf, ResNet-50's 214 gradients, 40 steps)",
       "machine": "1x NVIDIA H100 80GB HBM3 (device tool, nvidia-h100-x1)", "date": "2026-12-07",
       "head": "runs 1-3: the working tree of 268ee99; run 4: of 5cc5219", "runs": []}
fig, axes = plt.subplots(1, len(RUNS), figsize=(18, 4))
for ax, (f, what) in zip(axes, RUNS):
    d = collections.OrderedDict()
    with open(f) as fh:
        for r in csv.DictReader(fh, delimiter="\t"):
            assert r["wrong"] == "0"
            cfg = "%s rank(s) %s" % (r["ranks"], r["style"])
            d.setdefault(cfg, collections.OrderedDict()).setdefault(r["tree"], []).append(float(r["us_per_step"]))
    med = {cfg: {t: {"median_us": st.median(v), "min_us": min(v), "max_us": max(v), "n": len(v)}
                 for t, v in trees.items()} for cfg, trees in d.items()}
    out["runs"].append({"file": f, "what": what, "medians": med})
    trees = med["1 rank(s) per_tensor"]
    xs = list(trees)
    ys = [trees[t]["median_us"] for t in xs]
    ax.errorbar(range(len(xs)), ys, yerr=[[y - trees[t]["min_us"] for t, y in zip(xs, ys)],
                                          [trees[t]["max_us"] - y for t, y in zip(xs, ys)]], fmt="o-", capsize=3)
    ax.set_xticks(range(len(xs)), xs, rotation=45, fontsize=8)
    ax.set_title(what, fontsize=7)
    ax.set_ylabel("us per step, 1 rank per tensor\n(median, min-max)", fontsize=8)
fig.tight_layout()
fig.savefig("engine_perf_bisect.png", dpi=100)
with open("engine_perf_bisect.json", "w") as fh:
    json.dump(out, fh, indent=1)
for r in out["runs"]:
    for cfg, trees in r["medians"].items():
        print(r["file"], cfg, " ".join("%s=%.0f" % (t, v["median_us"]) for t, v in trees.items()))
