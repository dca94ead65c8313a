"""One table (JSON + PNG) from several xla_overlap_bench.py JSON files: per file
and lowering, the step time and the exposed share of the added link time at
each delay, with the precision, the batch and the NVGROUP_* settings of the
launch (e.g. NVGROUP_TF_REGISTERED_GROUPS).

    python benchmarks/xla_overlap_summary.py OUT.json [--png OUT.png] IN.json...
"""
import argparse
import json
import os


def rows_of(path):
    with open(path) as f:
        d = json.load(f)
    if d.get("benchmark") != "xla_overlap_bench":
        raise SystemExit("%s is not an xla_overlap_bench JSON" % path)
    out = []
    for lowering, s in d["summary"].items():
        run = d["runs"][lowering][0]
        out.append({
            "file": os.path.basename(path),
            "commit": d["commit"],
            "date": d["date"],
            "gpus": d["machine"]["gpus"],
            "ranks": d["ranks"],
            "lowering": lowering,
            "precision": d["precision"],
            "batch": d["batch"],
            "rounds": d["rounds"],
            "steps": d["steps"],
            "settings": {k: v for k, v in d.get("environment", {}).items() if k.startswith("NVGROUP_")},
            "delays_us": d["delays_us"],
            "step_ms": s["step_ms"],
            "step_ms_rounds": run.get("step_ms_rounds"),
            "exposed": s["exposed"],
            "delayed_buckets_per_step": s["delayed_buckets_per_step"],
        })
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--png")
    ap.add_argument("inputs", nargs="+")
    args = ap.parse_args()
    rows = [r for p in args.inputs for r in rows_of(p)]
    with open(args.out, "w") as f:
        json.dump({"benchmark": "xla_overlap_bench summary", "rows": rows}, f, indent=1)
    for r in rows:
        cells = ", ".join("D=%g: %.2f ms%s" % (d, t, "" if e is None else " exposed %.2f" % e)
                          for d, t, e in zip(r["delays_us"], r["step_ms"], r["exposed"]))
        print("%-28s %-8s %s b%d %s | %s" % (r["file"], r["lowering"], r["precision"], r["batch"],
                                             r["settings"] or "", cells))
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(9, 4))
        for r in rows:
            xs = [d for d, e in zip(r["delays_us"], r["exposed"]) if e is not None]
            ys = [e for e in r["exposed"] if e is not None]
            ax.plot(xs, ys, marker="o", label="%s %s b%d %s" % (r["file"], r["precision"], r["batch"],
                                                               r["settings"].get("NVGROUP_TF_REGISTERED_GROUPS", "")))
        ax.axhline(0.2, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("simulated link delay per bucket (us)")
        ax.set_ylabel("exposed share of the added link time")
        ax.set_ylim(0, max(0.5, max((max(y for y in r["exposed"] if y is not None) for r in rows), default=0)))
        first = rows[0]
        ax.set_title("XLA start/done pair, %s, %d rank(s), commit %s, %s" % (
            ", ".join(first["gpus"]), first["ranks"], first["commit"], first["date"][:10]))
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
