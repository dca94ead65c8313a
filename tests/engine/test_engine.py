"""Multi-rank tests of the engine through its pybind11 module: each test runs
a worker from tests/engine/workers under mpirun (tests/mpi_util.run_mpi); the
worker checks every result on every rank and exits non-zero on any failure."""
import json
import os
import re

import pytest

from mpi_util import assert_all_ranks_ok, run_mpi

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")


def worker(name):
    return os.path.join(WORKERS, name)


@pytest.mark.parametrize("np", [2, 3, 4])
def test_collectives(np):
    """200 random tensors in rank-specific orders, fused == unfused bitwise, grouped,
    allgather, broadcast, cache invalidation, init after shutdown."""
    result = run_mpi(worker("engine_collectives.py"), np, args=["big"] if np == 2 else [],
                     env={"NVGROUP_LOG_LEVEL": "debug"}, timeout=150)
    assert_all_ranks_ok(result, np)
    # The response cache carries the steady state: the three repeated steps of
    # the 200 tensors (600 responses) complete without a round trip to rank 0.
    cached = [int(m.group(1)) for m in re.finditer(
        r"\[nvgroup rank 0\] DEBUG: cycle \d+: executing \d+ responses \((\d+) from the response cache",
        result.output)]
    assert sum(cached) >= 600, "only %d responses came from the cache" % sum(cached)


def test_collectives_with_a_tiny_response_cache():
    """16 cache slots for ~400 names: constant eviction and re-negotiation, groups
    partly evicted; results must not change."""
    assert_all_ranks_ok(run_mpi(worker("engine_collectives.py"), 2, env={"NVGROUP_CACHE_CAPACITY": "16"},
                                timeout=150), 2)


def test_collectives_through_the_hierarchical_path():
    """4 ranks as 2 NV-groups of 2 (NVGROUP_GROUP_SIZE=2): the fused buffers go
    through the group reduce-scatter / cross allreduce / group allgather."""
    assert_all_ranks_ok(run_mpi(worker("engine_collectives.py"), 4, env={"NVGROUP_GROUP_SIZE": "2"},
                                timeout=150), 4)


@pytest.mark.parametrize("np", [2, 3, 4])
def test_errors(np):
    assert_all_ranks_ok(run_mpi(worker("engine_errors.py"), np, timeout=90), np)


@pytest.mark.parametrize("np", [2, 3])
def test_shutdown_with_requests_in_flight(np):
    assert_all_ranks_ok(run_mpi(worker("engine_shutdown.py"), np, timeout=90), np)


@pytest.mark.parametrize("mode,env", [("all", {"NVGROUP_FUSION_THRESHOLD": "abc"}), ("one", {}),
                                      ("differs", {})])
def test_malformed_environment_fails_init_on_every_rank(mode, env):
    assert_all_ranks_ok(run_mpi(worker("engine_bad_env.py"), 2, args=[mode], env=env, timeout=60), 2)


@pytest.mark.parametrize("np", [2, 3])
def test_fast_path_plans_events_and_state_digest(np):
    """Cached plans of grouped collectives (and their invalidation), lone tensors on
    the fused path, one wait per distinct ready event, bursts + wait_all, and a
    diverged cache failing on every rank (engine_fast_path.py)."""
    assert_all_ranks_ok(run_mpi(worker("engine_fast_path.py"), np, timeout=120), np)


def test_one_rank_runs_without_agreement_allreduce_and_buffer():
    """One rank: no cycle pays an MPI agreement allreduce, and fused buckets
    (grouped from their plan, and lone tensors) are the members' scaled copies,
    bitwise round(round(x*pre)*post), every dtype/op, in place or not
    (engine_one_rank.py)."""
    assert_all_ranks_ok(run_mpi(worker("engine_one_rank.py"), 1, timeout=90), 1)


@pytest.mark.parametrize("np", [2, 3])
def test_every_algorithm_knob_must_agree_across_ranks(np):
    """One rank with a different NVGROUP_ONESHOT_MAX_BYTES, _PIPELINE_CHUNK,
    _PIPELINE_MIN_CHUNK, _CROSS_ALLGATHER_MAX_BYTES, _ALLREDUCE_ALGORITHM,
    _FUSION_THRESHOLD, _CACHE_CAPACITY or _BUCKET_CAP_MB
    (in turn, one launch): init fails on every rank naming the knob and the values."""
    assert_all_ranks_ok(run_mpi(worker("engine_bad_env.py"), np, args=["knobs"], timeout=90), np)


def test_stall_inspector_warns_then_fails():
    result = run_mpi(worker("engine_stall.py"), 2, timeout=90,
                     env={"NVGROUP_STALL_WARNING_TIME": "1", "NVGROUP_STALL_SHUTDOWN_TIME": "3"})
    assert_all_ranks_ok(result, 2)
    for name in ("stall/new", "stall/cached"):
        assert ("[nvgroup rank 0] WARNING: Stalled ranks: tensor '%s' is ready on ranks [0] but missing "
                "on [1] for 1 s" % name) in result.output


@pytest.mark.parametrize("np", [2, 3])
def test_peer_timeout_fails_pending_requests_naming_the_silent_rank(tmp_path, np):
    result = run_mpi(worker("engine_timeout.py"), np, args=[str(tmp_path)], env={"NVGROUP_TIMEOUT": "2"},
                     timeout=90, check=False)
    assert not result.timed_out, result.output[-20000:]
    assert_all_ranks_ok(result, np)


def test_timeline_is_valid_chrome_trace(tmp_path):
    path = tmp_path / "timeline.json"
    assert_all_ranks_ok(run_mpi(worker("engine_timeline.py"), 2, args=[str(path)], timeout=60), 2)
    events = json.loads(path.read_text())
    assert any(e["name"] == "ALLREDUCE" for e in events)


@pytest.mark.parametrize("np", [2, 3])
def test_abort_hook_fails_everything_with_the_given_reason(tmp_path, np):
    """AbortEngine (cc/engine/engine_control.h), as a liveness monitor calls it."""
    result = run_mpi(worker("engine_abort.py"), np, args=[str(tmp_path)], timeout=90, check=False)
    assert not result.timed_out, result.output[-20000:]
    assert_all_ranks_ok(result, np)


@pytest.mark.parametrize("np", [2, 3])
def test_lone_requests_skip_the_admission_gap(np):
    """A caller in lock-step stops paying the admission gap after a few takes;
    a burst turns the batching back on; results right throughout
    (engine_lone_requests.py)."""
    assert_all_ranks_ok(run_mpi(worker("engine_lone_requests.py"), np, timeout=120), np)


@pytest.mark.parametrize("np", [2, 3])
def test_idle_engine_sleeps(np):
    """An idle engine runs a few background cycles a second, not one per
    NVGROUP_CYCLE_TIME; late submitters, a small allreduce after a quiet spell
    and a shutdown while peers sleep still work (engine_idle.py)."""
    assert_all_ranks_ok(run_mpi(worker("engine_idle.py"), np, timeout=120), np)


@pytest.mark.parametrize("np", [2, 3])
def test_duplicate_names_fail_on_every_rank(np):
    """A second collective under a name in flight, refused on some ranks and
    accepted on the others (each ordering forced): the error on every rank
    within seconds, then the name and a fresh one work (engine_duplicate_names.py)."""
    assert_all_ranks_ok(run_mpi(worker("engine_duplicate_names.py"), np, timeout=240), np)
