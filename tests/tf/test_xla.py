"""The collectives under XLA (ops/xla_lowering.cc and the handlers): one launch per rank count runs
every check of tests/tf/workers/xla.py (see its docstring); a second launch
kills a rank inside an XLA program."""
import os
import re

import pytest

from mpi_util import REPO, run_mpi

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "xla.py")

pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(REPO, "nvgroup_tf", "lib", "libnvgroup_tf_ops.so")),
    reason="TF op library not built (python setup.py build_ext --inplace)")


@pytest.mark.parametrize("ranks", [2, 3])
def test_collectives_errors_and_fit_under_xla(ranks):
    result = run_mpi(WORKER, ranks, args=["collectives", "errors", "fit"], timeout=600)
    assert result.output.count(" 0 failures") == ranks, result.output[-20000:]


@pytest.mark.parametrize("start_done", ["0", "1"])
def test_dead_peer_fails_the_xla_program(tmp_path, start_done):
    """A rank killed inside an XLA program, as one call per collective or as
    start/done pairs (NVGROUP_XLA_START_DONE)."""
    result = run_mpi(WORKER, 3, args=["dead", 1], env={"NVGROUP_TIMEOUT": 60, "XLA_RECORD_DIR": tmp_path,
                                                        "NVGROUP_XLA_START_DONE": start_done},
                     timeout=300, check=False)
    for f in sorted(tmp_path.iterdir()):  # lines mpirun may have dropped when it aborted the job
        result.output += "\n" + f.read_text()
    assert not result.timed_out, result
    assert result.returncode != 0, result
    assert "rank 1: KILL" in result.output, result
    for survivor in (0, 2):
        assert re.search(r"rank %d: CAUGHT UnavailableError .*rank 1" % survivor, result.output), result


@pytest.mark.parametrize("lowerings", [["1", "0"], ["1", "0", "auto"]])
def test_ranks_may_lower_differently(lowerings):
    """NVGROUP_XLA_START_DONE differs by rank (it is read per process): one
    rank's pairs and another's single calls meet in the engine by name, in
    the one order of the chain (ops/xla_ops.h Note [Start and done]); the
    values, the bits across ranks and the mismatch errors as always."""
    ranks = len(lowerings)
    result = run_mpi(WORKER, ranks, args=["collectives", "errors"], timeout=600,
                     rank_env=[{"NVGROUP_XLA_START_DONE": v} for v in lowerings])
    assert result.output.count(" 0 failures") == ranks, result.output[-20000:]


def test_async_custom_call_variant():
    """NVGROUP_XLA_ASYNC=1: the host custom call returns a future (docs/XLA.md)."""
    result = run_mpi(WORKER, 2, args=["collectives", "errors"], env={"NVGROUP_XLA_ASYNC": "1"}, timeout=600)
    assert result.output.count(" 0 failures") == 2, result.output[-20000:]


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_start_done_pair_on_the_cpu(ranks):
    """NVGROUP_XLA_START_DONE=1: every collective lowers to a start and a done
    (ops/xla_ops.h Note [Start and done]); the same checks, the chain of
    starts on every rank, every start with its one done. One rank is the
    GPU default's case on one GPU (scripts/xla_gpu.sh): a gradient step then
    holds no collective. The mismatch checks ("errors") need a second rank."""
    sections = ["collectives", "errors", "fit"] if ranks > 1 else ["collectives", "fit"]
    result = run_mpi(WORKER, ranks, args=sections, env={"NVGROUP_XLA_START_DONE": "1"},
                     timeout=600)
    assert result.output.count(" 0 failures") == ranks, result.output[-20000:]
