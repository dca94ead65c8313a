"""A fixed sample of the fault campaign (fault_campaign.py): 2-rank jobs on
different paths, each losing a rank (SIGKILL or SIGSTOP) in training or at
shutdown().
Every promise of the campaign's verdict must hold: the survivors name the lost
rank within NVGROUP_TIMEOUT plus the detection and exit slack, nothing is left
behind (processes, shared memory, stray files), the checkpoint loads."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_campaign  # noqa: E402

pytest.importorskip("tensorflow")

# A survivor of a SIGSTOPped rank names it when NVGROUP_TIMEOUT fires, then
# hangs at exit: nvgroup_tf's atexit calls MPI_Finalize (cc/engine/engine.cc
# FinalizeMpi), which waits for the stopped rank forever, so mpirun never ends.
FINALIZE_HANGS = pytest.mark.xfail(strict=True, reason="MPI_Finalize at exit waits for the stopped rank")
# A rank killed as it enters shutdown(): the survivor's shutdown() waits out
# NVGROUP_TIMEOUT in its shutdown agreement although the monitor saw the death
# at once (Shutdown() in cc/engine/engine.cc takes the engine out of reach of
# AbortEngine before stopping it), so mpirun kills it before it can say why.
SHUTDOWN_WAITS = pytest.mark.xfail(strict=True, reason="shutdown() is not aborted by a peer's death")

SAMPLE = [
    {"path": "collectives", "phase": "train", "fault": "kill", "victim": 1, "delay_s": 0.3},
    {"path": "keras_fit", "phase": "train", "fault": "kill", "victim": 1, "delay_s": 0.4},
    pytest.param({"path": "tape", "phase": "train", "fault": "stop", "victim": 1, "delay_s": 0.2},
                 marks=FINALIZE_HANGS),
    {"path": "xla", "phase": "train", "fault": "kill", "victim": 0, "delay_s": 0.1},
    {"path": "elastic", "phase": "train", "fault": "kill", "victim": 1, "delay_s": 0.2},
    pytest.param({"path": "process_sets", "phase": "shutdown", "fault": "kill", "victim": 1, "delay_s": 0.0},
                 marks=SHUTDOWN_WAITS),
]


@pytest.mark.parametrize("spec", SAMPLE, ids=lambda s: "%s-%s-%s" % (s["path"], s["phase"], s["fault"]))
def test_fault_campaign_sample(tmp_path, spec):
    spec = dict(spec, index=0, np=2)
    results = fault_campaign.campaign([spec], str(tmp_path))
    r = results[0]
    assert r["fault_delivered"], r
    assert r["verdict"] == [], r
    if spec["phase"] == "train":  # mid-training, the survivor cannot have finished its program
        assert [s["outcome"] for s in r["survivors"]] == ["error"], r
