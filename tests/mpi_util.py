"""Run a Python worker script under mpirun from a pytest test.

Every multi-rank test is a pytest function that launches a worker script with
`run_mpi(...)`; the worker does its checks on each rank and exits non-zero (after
printing what failed, prefixed with its rank) if any check fails. A hang is caught
by the timeout and reported with the output so far.
"""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    # Plain TCP/shared memory; keeps Open MPI from probing absent fabrics.
    "OMPI_MCA_btl": "self,vader,tcp",
    "OMPI_MCA_pml": "ob1",
    "OMPI_MCA_btl_tcp_if_include": "lo",
    "OMPI_MCA_oob_tcp_if_include": "lo",
    "PYTHONUNBUFFERED": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONPATH": REPO,
}


class MpiResult:
    def __init__(self, returncode, output, timed_out):
        self.returncode = returncode
        self.output = output
        self.timed_out = timed_out

    def __repr__(self):
        return "MpiResult(rc=%s, timed_out=%s)\n%s" % (self.returncode, self.timed_out, self.output)


def run_mpi(script, np, args=(), env=None, timeout=300, check=True, rank_env=None):
    """Runs `python script args...` on `np` ranks. Returns an MpiResult.

    `rank_env`, a list of `np` dicts, adds rank r's own variables to rank r's
    environment (one mpirun app context per rank).
    With check=True, fails the calling test unless every rank exited 0 in time.
    """
    full_env = dict(os.environ)
    full_env.update(MPI_ENV)
    if env:
        full_env.update({k: str(v) for k, v in env.items()})
    program = [sys.executable, script] + [str(a) for a in args]
    if rank_env is None:
        cmd = ["mpirun", "-np", str(np), "--bind-to", "none"] + program
    else:
        assert len(rank_env) == np, "rank_env needs one dict per rank"
        cmd = ["mpirun", "--bind-to", "none"]
        for r, own in enumerate(rank_env):
            cmd += ([":"] if r else []) + ["-np", "1", "env"] + ["%s=%s" % kv for kv in own.items()] + program
    try:
        proc = subprocess.run(cmd, env=full_env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        result = MpiResult(proc.returncode, proc.stdout, False)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        result = MpiResult(None, out, True)
    if check:
        assert not result.timed_out, "mpirun -np %d %s timed out after %ss:\n%s" % (
            np, script, timeout, result.output[-20000:])
        assert result.returncode == 0, "mpirun -np %d %s failed (rc=%s):\n%s" % (
            np, script, result.returncode, result.output[-20000:])
    return result


def assert_all_ranks_ok(result, np):
    """Every rank of `result` printed "[rank R] OK", the last line of an engine
    worker that found no failure (tests/engine/workers/engine_common.py finish)."""
    for r in range(np):
        assert "[rank %d] OK" % r in result.output, result.output[-20000:]
