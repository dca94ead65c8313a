"""Turns engine_perf_ab.sh's TSV into a JSON table and a PNG: per (ranks, style)
the median microseconds per step of the baseline and of this tree, their ratio,
and every run's value.

    python3 scripts/device/engine_perf_ab_table.py engine_perf_ab.tsv \
        --machine "1x H200" --date 2026-12-02 --commit abc1234 --baseline 40433e6 \
        --json benchmarks/results/engine_perf_ab_h200.json [--png ...png]
"""
import argparse
import csv
import json
import statistics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tsv")
    ap.add_argument("--machine", required=True)
    ap.add_argument("--date", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--png")
    args = ap.parse_args()

    runs = {}
    with open(args.tsv) as f:
        for row in csv.DictReader(f, delimiter="\t"):
            if row["wrong"] != "0":
                raise SystemExit(f"a run had wrong values: {row}")
            key = (int(row["ranks"]), row["style"])
            runs.setdefault(key, {}).setdefault(row["tree"], []).append(float(row["us_per_step"]))

    rows = []
    for (ranks, style), by_tree in sorted(runs.items()):
        # A style the baseline lacks (registered groups in an older tree) is
        # compared with the baseline's matching grouped style instead.
        base_style = style if "baseline" in by_tree else style.replace("registered", "grouped")
        base_runs = runs.get((ranks, base_style), {}).get("baseline", [])
        before = statistics.median(base_runs) if base_runs else float("nan")
        after = statistics.median(by_tree["this"])
        rows.append({"ranks": ranks, "style": style, "baseline_style": base_style, "baseline_us": base_runs,
                     "this_us": by_tree["this"], "baseline_median_us": before,
                     "this_median_us": after, "ratio": after / before})
    table = {"benchmark": "engine_perf, ResNet-50's 214 gradients (102 MB), float32 Average",
             "machine": args.machine, "date": args.date, "commit": args.commit,
             "baseline_commit": args.baseline, "rows": rows}
    with open(args.json, "w") as f:
        json.dump(table, f, indent=1)
    for r in rows:
        print(f"{r['ranks']} rank(s) {r['style']:<18} baseline ({r['baseline_style']}) {r['baseline_median_us']:8.1f} us  "
              f"this {r['this_median_us']:8.1f} us  ratio {r['ratio']:.3f}")
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        labels = [f"{r['ranks']}r {r['style']}" for r in rows]
        x = range(len(rows))
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.bar([i - 0.2 for i in x], [r["baseline_median_us"] for r in rows], 0.4,
               label=f"baseline {args.baseline}")
        ax.bar([i + 0.2 for i in x], [r["this_median_us"] for r in rows], 0.4, label=f"this {args.commit}")
        ax.set_xticks(list(x), labels)
        ax.set_ylabel("us per step (median)")
        ax.set_title(f"engine_perf, {args.machine}, {args.date}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
