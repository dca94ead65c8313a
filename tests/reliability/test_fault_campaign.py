"""A fixed sample of the fault campaign (fault_campaign.py): 2-rank jobs on
different paths, each losing a rank (SIGKILL or SIGSTOP) in a different phase.
Every promise of the campaign's verdict must hold: the survivors name the lost
rank within NVGROUP_TIMEOUT plus the detection and exit slack, nothing is left
behind (processes, shared memory, stray files), the checkpoint loads."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_campaign  # noqa: E402

pytest.importorskip("tensorflow")

SAMPLE = [
    {"path": "collectives", "phase": "train", "fault": "kill", "victim": 1, "delay_s": 0.3},
    {"path": "keras_fit", "phase": "checkpoint", "fault": "kill", "victim": 0, "delay_s": 0.02},
    {"path": "tape", "phase": "train", "fault": "stop", "victim": 1, "delay_s": 0.2},
    {"path": "xla", "phase": "train", "fault": "kill", "victim": 0, "delay_s": 0.1},
    {"path": "elastic", "phase": "train", "fault": "kill", "victim": 1, "delay_s": 0.2},
    {"path": "process_sets", "phase": "train", "fault": "stop", "victim": 0, "delay_s": 0.1},
]


@pytest.mark.parametrize("spec", SAMPLE, ids=lambda s: "%s-%s-%s" % (s["path"], s["phase"], s["fault"]))
def test_fault_campaign_sample(tmp_path, spec):
    spec = dict(spec, index=0, np=2)
    results = fault_campaign.campaign([spec], str(tmp_path))
    r = results[0]
    assert r["fault_delivered"], r
    assert r["verdict"] == [], r
    assert any(s["outcome"] == "error" for s in r["survivors"]), r
