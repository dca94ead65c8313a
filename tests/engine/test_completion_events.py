"""The deferred completion path that CUDA buckets take (completion events
announced through completion_event_ready before `done`, cc/engine/completion.cc),
run on the CPU through testing.host_completion_events: the worker
(tests/engine/workers/engine_completion_events.py) resubmits names right after
their completion, checks every element against float64 on every rank, the
bits across ranks and against the engine without host events, a mismatch on
every rank, and that every event came before its `done`."""
import os

import pytest

from mpi_util import assert_all_ranks_ok, run_mpi

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "engine_completion_events.py")


@pytest.mark.parametrize("np", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_completion_events_on_the_cpu(np):
    result = run_mpi(WORKER, np, timeout=180)
    assert_all_ranks_ok(result, np)
