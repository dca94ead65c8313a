"""Table and plot of a cross-step before/after folder (scripts/device/cross_ab.sh's
cross_step_{base,this}_np{2,3,4}.json): per rank count and size, the nvgroup
column of each tree and the staged-MPI baseline of the same run, their ratio, and
whether every element was right.

    python benchmarks/cross_step_ab_table.py FOLDER

Writes FOLDER/summary.json and FOLDER/summary.png (us per call against bytes,
one panel per rank count) and prints the table. Reads what the bench measured;
computes nothing else.
"""
import glob
import json
import os
import re
import sys


def load(folder):
    runs = {}
    for path in sorted(glob.glob(os.path.join(folder, "cross_step_*_np*.json"))):
        m = re.search(r"cross_step_(\w+?)_np(\d+)\.json$", path)
        with open(path) as f:
            runs[(m.group(1), int(m.group(2)))] = json.load(f)
    return runs


def summarize(runs):
    rows = []
    for (label, np_), run in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for r in run["rows"]:
            configs = {k: v for k, v in r.items() if isinstance(v, dict)}
            rows.append({"tree": label, "commit": run.get("commit"), "ranks": np_, "bytes": r["bytes"],
                         "nvgroup_us": r["nvgroup"]["us"], "staged_mpi_us": r["staged_mpi_us"],
                         "nvgroup_over_staged": r["nvgroup"]["us"] / r["staged_mpi_us"],
                         "wrong": sum(c.get("wrong", 0) + c.get("not_bitwise", 0) + c.get("ranks_differ", 0)
                                      for c in configs.values())})
    first = next(iter(runs.values()))
    return {"tool": "cross_step_bench", "gpu": first.get("gpu"), "date": first.get("date"),
            "commits": {label: run.get("commit") for (label, _), run in runs.items()}, "rows": rows}


def plot(summary, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ranks = sorted({r["ranks"] for r in summary["rows"]})
    fig, axes = plt.subplots(1, len(ranks), figsize=(5 * len(ranks), 4), squeeze=False)
    for ax, np_ in zip(axes[0], ranks):
        for tree in sorted({r["tree"] for r in summary["rows"]}):
            rows = [r for r in summary["rows"] if r["ranks"] == np_ and r["tree"] == tree]
            xs = [r["bytes"] for r in rows]
            ax.loglog(xs, [r["nvgroup_us"] for r in rows], "o-",
                      label="%s (%s)" % (tree, summary["commits"].get(tree)))
            ax.loglog(xs, [r["staged_mpi_us"] for r in rows], "x:", label="staged MPI, %s run" % tree)
        ax.set_title("%d ranks as groups of 1" % np_)
        ax.set_xlabel("bytes")
        ax.set_ylabel("us per call")
        ax.legend(fontsize=7)
    fig.suptitle("cross step, %s, %s" % (summary["gpu"], summary["date"]))
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    folder = sys.argv[1]
    summary = summarize(load(folder))
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    try:
        plot(summary, os.path.join(folder, "summary.png"))
    except ImportError:
        print("matplotlib missing: no PNG")
    print("%-6s %-9s %5s %10s %10s %10s %6s" % ("tree", "commit", "ranks", "bytes", "nvgroup", "staged", "ratio"))
    for r in summary["rows"]:
        print("%-6s %-9s %5d %10d %10.1f %10.1f %6.2f%s" % (r["tree"], r["commit"], r["ranks"], r["bytes"],
                                                          r["nvgroup_us"], r["staged_mpi_us"],
                                                          r["nvgroup_over_staged"], "  WRONG" if r["wrong"] else ""))


if __name__ == "__main__":
    main()
