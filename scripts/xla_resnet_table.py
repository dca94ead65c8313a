"""Table (JSON + PNG) of the ResNet-50 XLA runs in a log of scripts/xla_gpu.sh
(its NVG_MODE / NVG_RESULT line pairs, from scripts/xla_resnet.py):

    python scripts/xla_resnet_table.py LOG OUT_STEM --machine KIND --date ISO --commit SHA [--title T]

Writes OUT_STEM.json (the rows in run order, each with its mode and
NVGROUP_XLA_CUDA_WAIT, plus per-variant means and the ratio of each nvgroup
variant to plain Keras) and OUT_STEM.png (img/s per run, grouped by variant).
"""
import argparse
import json
import statistics


def parse(path):
    rows, mode, wait = [], None, None
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("NVG_MODE "):
                parts = line.split()
                mode = parts[1]
                wait = parts[2].split("=", 1)[1] if len(parts) > 2 and "=" in parts[2] else ""
            elif line.startswith("NVG_RESULT ") and mode is not None:
                row = json.loads(line[len("NVG_RESULT "):])
                row["mode"], row["xla_cuda_wait"] = mode, wait
                rows.append(row)
                mode = None
    return rows


def variant(row):
    return row["mode"] if row["mode"].startswith("plain") else "%s (wait=%s)" % (row["mode"], row["xla_cuda_wait"] or "default")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("log")
    p.add_argument("out_stem")
    p.add_argument("--machine", required=True)
    p.add_argument("--date", required=True)
    p.add_argument("--commit", required=True)
    p.add_argument("--title", default="ResNet-50 with XLA, one GPU")
    a = p.parse_args()
    rows = parse(a.log)
    if not rows:
        raise SystemExit("no NVG_MODE/NVG_RESULT pairs in " + a.log)
    by_variant = {}
    for r in rows:
        by_variant.setdefault(variant(r), []).append(r["img_per_sec_total"])
    means = {k: statistics.fmean(v) for k, v in by_variant.items()}
    plain = [k for k in means if k.startswith("plain")]
    ratios = {k: means[k] / means[plain[0]] for k in means if plain and not k.startswith("plain")}
    table = {"machine": a.machine, "date": a.date, "commit": a.commit, "log": a.log,
             "rows": rows, "mean_img_per_sec": means,
             "ratio_to_" + (plain[0] if plain else "plain"): ratios}
    with open(a.out_stem + ".json", "w") as f:
        json.dump(table, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = list(by_variant)
    for i, k in enumerate(names):
        ax.scatter([i] * len(by_variant[k]), by_variant[k], zorder=3)
        label = "%.0f" % means[k] + ("" if k not in ratios else "\n%.1f%% of plain" % (100 * ratios[k]))
        ax.annotate(label, (i, means[k]), textcoords="offset points", xytext=(12, -4), fontsize=8)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_xlim(-0.5, len(names) - 0.2)
    ax.set_ylabel("img/s (1 rank)")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("%s\n%s, %s, commit %s" % (a.title, a.machine, a.date, a.commit), fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out_stem + ".png", dpi=120)
    for k in names:
        print("%-28s runs %-30s mean %7.1f %s" % (k, ", ".join("%.1f" % v for v in by_variant[k]), means[k],
                                                  "" if k not in ratios else "%.1f%% of plain" % (100 * ratios[k])))


if __name__ == "__main__":
    main()
