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

# Two trials failed before the runtime (cc/engine/runtime.cc) learned them:
# the SIGSTOP trial hung at exit in MPI_Finalize waiting for the stopped rank
# (now skipped once a peer is lost), and the kill at shutdown() waited out
# NVGROUP_TIMEOUT because Shutdown() took the engines out of reach of the
# liveness monitor's abort (now they stay reachable while they stop).
SAMPLE = [
    {"path": "collectives", "phase": "train", "fault": "kill", "victim": 1, "delay_s": 0.3},
    {"path": "keras_fit", "phase": "train", "fault": "kill", "victim": 1, "delay_s": 0.4},
    {"path": "tape", "phase": "train", "fault": "stop", "victim": 1, "delay_s": 0.2},
    {"path": "xla", "phase": "train", "fault": "kill", "victim": 0, "delay_s": 0.1},
    {"path": "elastic", "phase": "train", "fault": "kill", "victim": 1, "delay_s": 0.2},
    {"path": "process_sets", "phase": "shutdown", "fault": "kill", "victim": 1, "delay_s": 0.0},
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
