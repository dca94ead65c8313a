"""Helpers the CPU benchmarks share: the commit they ran, the environment of
their mpirun launches, the gradient table and the guard of a worker rank."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit(repo=REPO):
    """HEAD of `repo`, with "-dirty" when tracked files differ from it."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def mpirun_env():
    """This process's environment, plus what Open MPI needs to run as root and oversubscribed."""
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    return env


def load_counts(path, scale=1):
    """Element counts of a gradient table (benchmarks/resnet50_gradients.txt), divided by
    `scale` (at least one element each)."""
    counts = []
    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            counts.append(max(1, int(line.split()[1]) // scale))
    return counts


def run_worker(worker, args):
    """worker(args) on one rank; an exception aborts the job, so no other rank is left
    inside a collective."""
    try:
        return worker(args)
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(1)


def run_launch(cmd, env, cwd, label):
    """Runs one benchmark launch `cmd` (an mpirun line whose rank 0 writes its
    result as JSON to the file `{out}` stands for in cmd) in `cwd` and returns
    that result; None, with a line naming `label`, when the launch failed."""
    import json
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    try:
        p = subprocess.run([a.replace("{out}", out) for a in cmd], env=env, cwd=cwd)
        if p.returncode != 0:
            print("launch of %s failed (exit %d)" % (label, p.returncode))
            return None
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def write_json(path, result):
    """`result` as indented JSON at `path` (nothing when path is empty)."""
    if path:
        import json
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_png(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
