"""Reliability: no hangs, no silent corruption.

Each test launches a worker under mpirun (tests/mpi_util.run_mpi) and asserts
on its output, exit code and duration. Where failure is the point (a killed or
stopped rank) the run uses check=False and the assertions say what must have
happened instead of a hang:

  * dead rank     -- SIGKILL of one rank: the survivors name it within ~1 s
                     (cc/transport/liveness.h), before mpirun's own kill, in
                     the pybind module and in TensorFlow (UnavailableError); a
                     clean exit (shutdown() says BYE) is never taken for one;
  * silent rank   -- SIGSTOP of one rank: NVGROUP_TIMEOUT fires and names it;
  * init() faults -- a rank stopped or killed in a phase of init(): every rank
                     ends within NVGROUP_INIT_TIMEOUT (+ the watchdog's 5 s),
                     naming the missing rank or the phase; a dead creator's
                     /dev/shm segment is swept by the next setup;
  * monitor alone -- a C++ driver of the LivenessMonitor's verdicts (ASan/UBSan);
  * stalls        -- a rank skips a tensor: rank 0 warns naming the tensor and
                     the rank; NVGROUP_STALL_SHUTDOWN_TIME turns it into errors;
  * shutdown()    -- with collectives in flight: each completes or is ABORTED,
                     init() works again;
  * duplicates    -- a second request with a name in flight is refused, and
                     fails on every rank;
  * soak          -- 10,000 random collectives, every element checked, ranks
                     bitwise equal, anonymous RSS stable;
  * validation    -- hypothesis properties of the Python API's arguments, of
                     malformed NVGROUP_* knobs and of the engine's Enqueue checks;
  * wire format   -- an ASan/UBSan fuzz run of the negotiation decoders;
  * timeline      -- NVGROUP_TIMELINE writes a valid Chrome trace with every phase.

Needs the engine module (NVGROUP_WITHOUT_TF=1 python setup.py build_ext --inplace)
and, for the Python API properties and the TensorFlow dead-rank test, the TF op
library (the full build); a C++ compiler for the ASan/UBSan drivers.
"""
import json
import os
import re
import shutil
import subprocess
import time

import pytest

from mpi_util import MPI_ENV, REPO, run_mpi

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers")
# Ranks outnumber the 2 cores of the CI box: let Open MPI yield while it polls.
# The workers import their helpers (rel_common) from their own directory.
ENV = {"OMPI_MCA_mpi_yield_when_idle": "1", "PYTHONPATH": REPO + os.pathsep + WORKERS}
FALSE_ALARM = "died or exited without shutdown()"


def run(script, np, args=(), env=None, timeout=240, check=True):
    full_env = dict(ENV)
    full_env.update(env or {})
    start = time.monotonic()
    result = run_mpi(os.path.join(WORKERS, script), np, args=args, env=full_env, timeout=timeout,
                     check=check)
    result.seconds = time.monotonic() - start
    return result


def lines(result, pattern):
    return re.findall(pattern, result.output, flags=re.MULTILINE)


def run_recorded(tmp_path, script, np, args, env):
    """run() for jobs that end in a rank failure: the workers' say() lines are
    also read back from REL_RECORD_DIR (mpirun may drop output in flight when it
    aborts the job) and appended to result.output."""
    record = tmp_path / "record"
    record.mkdir()
    full_env = dict(env)
    full_env["REL_RECORD_DIR"] = str(record)
    r = run(script, np, args, env=full_env, timeout=240, check=False)
    for f in sorted(record.iterdir()):
        r.output += "\n" + f.read_text()
    return r


def assert_no_false_alarm(result):
    """A clean run must never report a rank as dead (BYE before EOF)."""
    assert FALSE_ALARM not in result.output, result.output[-5000:]


# --- dead and silent ranks ----------------------------------------------------

@pytest.mark.parametrize("victim,kind", [(1, "allreduce"), (0, "allreduce"), (2, "broadcast"),
                                         (1, "allgather")])
def test_killed_rank_is_named_by_the_survivors(tmp_path, victim, kind):
    # NVGROUP_TIMEOUT far above the bound: only the liveness channel can explain
    # the failure in time. mpirun kills the survivors ~1 s after the death, so a
    # survivor that has not caught the error by then never prints CAUGHT.
    np_ = 3
    r = run_recorded(tmp_path, "rank_failure.py", np_, [victim, 150, "kill", kind], env={"NVGROUP_TIMEOUT": 60})
    assert not r.timed_out, r
    assert r.returncode != 0, r
    assert r.seconds < 30, "the job took %.0f s to end after a rank died" % r.seconds
    killed = lines(r, r"^rank %d: KILL ([0-9.]+)$" % victim)
    assert killed, r
    for survivor in (s for s in range(np_) if s != victim):
        caught = lines(r, r"^rank %d: CAUGHT ([0-9.]+) UNAVAILABLE: rank %d \(host [^,]+, pid \d+\) died or "
                          r"exited without shutdown\(\); aborting$" % (survivor, victim))
        assert caught, "rank %d did not report the death of rank %d:\n%s" % (survivor, victim, r.output)
        latency = float(caught[0]) - float(killed[0])
        assert latency < 1.0, "rank %d learned of the death after %.2f s" % (survivor, latency)
        assert lines(r, r"^rank %d: LATER UNAVAILABLE: rank %d \(host [^,]+, pid \d+\) died" % (survivor, victim)), \
            "rank %d accepted a collective after the death:\n%s" % (survivor, r.output)


def test_killed_rank_in_hierarchical_reducescatter_is_named_by_every_survivor(tmp_path):
    """4 ranks as 2 NV-groups of 2, reducescatter in a loop (the hierarchical
    reduce-scatter): rank 3 is killed; its group member and the ranks of the
    other group all report it, as for the allreduce."""
    r = run_recorded(tmp_path, "rank_failure.py", 4, [3, 150, "kill", "reducescatter"],
                     env={"NVGROUP_TIMEOUT": 60, "NVGROUP_GROUP_SIZE": 2})
    assert not r.timed_out, r
    assert r.returncode != 0, r
    killed = lines(r, r"^rank 3: KILL ([0-9.]+)$")
    assert killed, r
    for survivor in (0, 1, 2):
        caught = lines(r, r"^rank %d: CAUGHT ([0-9.]+) UNAVAILABLE: rank 3 \(host [^,]+, pid \d+\) died or "
                          r"exited without shutdown\(\); aborting$" % survivor)
        assert caught, "rank %d did not report the death of rank 3:\n%s" % (survivor, r.output)
        assert float(caught[0]) - float(killed[0]) < 1.0, r.output


def test_killed_rank_raises_unavailable_error_in_tensorflow(tmp_path):
    r = run_recorded(tmp_path, "tf_rank_failure.py", 3, [1, 30], env={"NVGROUP_TIMEOUT": 60})
    assert not r.timed_out, r
    assert r.returncode != 0, r
    killed = lines(r, r"^rank 1: KILL ([0-9.]+)$")
    assert killed, r
    for survivor in (0, 2):
        caught = lines(r, r"^rank %d: CAUGHT ([0-9.]+) UnavailableError .*rank 1 \(host [^,]+, pid \d+\) died or "
                          r"exited without shutdown\(\); aborting" % survivor)
        assert caught, "rank %d did not raise UnavailableError naming rank 1:\n%s" % (survivor, r.output)
        assert float(caught[0]) - float(killed[0]) < 1.0, r.output


@pytest.mark.parametrize("np_", [2, 3])
def test_stranger_impersonating_ranks_cannot_take_their_place(tmp_path, np_):
    """A process that reaches rank 0's dead-rank port first (the ranks' connects
    are delayed 3 s) and sends a HELLO with the public magic for every rank,
    garbage and forged heartbeats, then hangs up: the job's allreduces all
    complete, and a rank killed afterwards is still named by the survivors.
    Before the per-job secret the forged HELLO took rank 1's place and the
    hang-up aborted the job as if rank 1 had died."""
    victim = np_ - 1
    r = run_recorded(tmp_path, "liveness_stranger.py", np_, [3, victim], env={"NVGROUP_TIMEOUT": 60})
    assert not r.timed_out, r
    connected = lines(r, r"^STRANGER CONNECTED ([0-9.]+) connections=(\d+)$")
    assert connected and int(connected[0][1]) > 0, r.output
    hung_up = lines(r, r"^STRANGER HUNG UP ([0-9.]+)$")
    assert hung_up, r.output
    # Lines come twice (stdout and the record files): compare sets.
    ranks_connect = {float(t) for t in lines(r, r"^rank [1-9]\d*: CONNECTS_AFTER ([0-9.]+)$")}
    assert len(ranks_connect) == np_ - 1, r.output
    assert float(connected[0][0]) < min(ranks_connect), "the stranger was not first; the test proves nothing:\n" + r.output
    assert lines(r, r"^rank 0: STRANGER_EXIT 0$"), r.output
    assert len(set(lines(r, r"^(rank \d+): ALLREDUCES_OK \d+$"))) == np_, r.output
    refused = lines(r, r"^\[nvgroup rank 0\] WARNING: dead-rank detection: refused (\d+) connection")
    assert len(refused) == 1 and int(refused[0]) == int(connected[0][1]), r.output
    killed = lines(r, r"^rank %d: KILL ([0-9.]+)$" % victim)
    assert killed, r.output
    for survivor in range(np_ - 1):
        caught = lines(r, r"^rank %d: CAUGHT [0-9.]+ UNAVAILABLE: rank %d \(host [^,]+, pid \d+\) died or "
                          r"exited without shutdown\(\); aborting$" % (survivor, victim))
        assert caught, "rank %d did not report the death of rank %d:\n%s" % (survivor, victim, r.output)
    assert r.returncode != 0, r


def test_stopped_rank_is_named_when_the_timeout_fires(tmp_path):
    r = run_recorded(tmp_path, "rank_failure.py", 3, [2, 150, "stop", "allreduce"], env={"NVGROUP_TIMEOUT": 4})
    assert not r.timed_out, r
    assert r.returncode != 0, r
    assert r.seconds < 60, r
    for survivor in (0, 1):
        caught = lines(r, r"^rank %d: CAUGHT [0-9.]+ UNAVAILABLE: .*NVGROUP_TIMEOUT.*rank 2 \(host [^,]+, pid "
                          r"\d+\) has sent no heartbeat" % survivor)
        assert caught, "rank %d did not name the silent rank 2:\n%s" % (survivor, r.output)


def test_clean_exit_at_different_times_is_not_a_death():
    # Fails without the BYE frame: rank 0's monitor would see ranks 1 and 2
    # close their sockets while it is still open.
    r = run("staggered_exit.py", 3)
    assert len(lines(r, r"EXITED_CLEANLY$")) == 3, r.output
    assert_no_false_alarm(r)


def test_liveness_monitor_verdicts_in_cpp(tmp_path):
    """The monitor alone (C++ driver, ASan/UBSan): a stuck engine and a stopped
    rank are named, a clean Close() and a stopped rank are not losses, a death
    is reported with host and pid within a second (see liveness_driver.cc)."""
    exe = str(tmp_path / "liveness_driver")
    sources = [os.path.join(HERE, "liveness_driver.cc")] + [
        os.path.join(REPO, "cc", p) for p in ("transport/liveness.cc", "transport/liveness_setup.cc",
                                              "transport/liveness_sockets.cc", "transport/liveness_address.cc",
                                              "common/env.cc", "common/status.cc", "common/logging.cc")]
    _compile_sanitized(sources, exe)
    record = tmp_path / "record"
    record.mkdir()
    full_env = dict(os.environ)
    full_env.update({k: str(v) for k, v in MPI_ENV.items()})
    # Rank 1 exits on purpose without MPI_Finalize: keep mpirun from killing
    # the others before they have written down what they saw.
    full_env["OMPI_MCA_orte_enable_recovery"] = "1"
    proc = subprocess.run(["mpirun", "-np", "3", "--bind-to", "none", exe, str(record)], env=full_env,
                          capture_output=True, text=True, timeout=120)
    text = "".join(f.read_text() for f in sorted(record.iterdir()))
    assert "FAIL" not in text, text + proc.stdout + proc.stderr
    for rank in (0, 2):
        assert "rank %d: OK DONE" % rank in text, text + proc.stdout + proc.stderr
    assert "rank 0: OK death of rank 1 reported" in text, text


# --- stalls -------------------------------------------------------------------

def test_stall_warning_names_the_tensor_and_the_missing_rank():
    r = run("stall.py", 3, ["warn"], env={"NVGROUP_STALL_WARNING_TIME": 2})
    assert lines(r, r"^\[nvgroup rank 0\] WARNING: Stalled ranks: tensor 'skipme' is ready on ranks \[0, 2\] "
                    r"but missing on \[1\]"), r.output
    assert len(lines(r, r"skipme completed$")) == 3, r.output
    assert_no_false_alarm(r)


def test_stall_shutdown_time_fails_the_stalled_tensor_on_every_rank_holding_it():
    r = run("stall.py", 3, ["shutdown"],
            env={"NVGROUP_STALL_WARNING_TIME": 1, "NVGROUP_STALL_SHUTDOWN_TIME": 3})
    for holder in (0, 2):
        assert lines(r, r"^rank %d: STALL_ERROR DEADLINE_EXCEEDED: Stalled ranks: tensor 'skipme' is ready on "
                        r"ranks \[0, 2\] but missing on \[1\]" % holder), r.output
    assert len(lines(r, r"OK after the stall$")) == 3, r.output
    assert_no_false_alarm(r)


# --- shutdown, duplicates -----------------------------------------------------

def test_shutdown_with_collectives_in_flight_then_init_again():
    r = run("shutdown_inflight.py", 3, [4], timeout=180)
    assert len(lines(r, r"SHUTDOWN_OK ok=\d+ aborted=\d+ refused=\d+$")) == 3, r.output
    assert_no_false_alarm(r)


def test_duplicate_names_in_flight_are_refused():
    r = run("duplicates.py", 2)
    assert len(lines(r, r"DUPLICATES_OK$")) == 2, r.output
    assert_no_false_alarm(r)


# --- soak ---------------------------------------------------------------------

def test_soak_10000_random_collectives():
    # 100 rounds x 100 collectives; RSS after the first quarter vs at the end,
    # 6 MiB slack (measured growth here: -0.5..2.2 MiB).
    r = run("soak.py", 4, [100, 100, 6], timeout=280)
    soaks = lines(r, r"SOAK checked=(\d+) ")
    assert soaks == ["10000"] * 4, r.output
    assert_no_false_alarm(r)


# --- Python API validation ----------------------------------------------------

def test_validation_properties():
    r = run("validation_props.py", 1, env={"REL_EXAMPLES": 40}, timeout=400)
    ok = lines(r, r"^PROPERTY (\w+) OK$")
    assert ok == ["prop_reduce_op", "prop_broadcast_root", "prop_names", "prop_scale_factors", "prop_dtypes",
                  "prop_tensor_argument", "prop_malformed_knobs"], r.output


def test_engine_request_validation_properties():
    r = run("engine_validation_props.py", 1, env={"REL_EXAMPLES": 400}, timeout=200)
    assert lines(r, r"^PROPERTY prop_requests OK \((\d+) refused, (\d+) completed\)$"), r.output


# --- wire format fuzzing --------------------------------------------------------

def _mpi_flags(which):
    return subprocess.check_output(["mpicxx", "--showme:" + which], text=True).split()


def _compile_sanitized(sources, exe):
    """Builds a test driver against engine sources with ASan and UBSan (any
    finding aborts the run)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed for the test drivers"
    cmd = [cxx, "-std=c++17", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
           "-fno-omit-frame-pointer", "-DOMPI_SKIP_MPICXX=1", "-I" + os.path.join(REPO, "cc", "include"),
           "-I" + os.path.join(REPO, "cc")] + _mpi_flags("compile") + sources + _mpi_flags("link") + ["-o", exe]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_wire_format_fuzz_asan_ubsan(tmp_path):
    exe = str(tmp_path / "fuzz_wire_format")
    sources = [os.path.join(HERE, "fuzz_wire_format.cc")] + [
        os.path.join(REPO, "cc", p) for p in ("engine/wire_format.cc", "common/status.cc", "common/types.cc")]
    _compile_sanitized(sources, exe)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=1", UBSAN_OPTIONS="print_stacktrace=1")
    for seed in (1, 2):
        p = subprocess.run([exe, "150000", str(seed)], capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        assert re.search(r"150000 iterations, \d+ rejected as malformed, \d+ decoded: OK", p.stdout), p.stdout


# --- timeline -------------------------------------------------------------------

def test_timeline_is_a_chrome_trace_with_every_phase(tmp_path):
    path = tmp_path / "timeline.json"
    r = run("timeline.py", 2, env={"NVGROUP_TIMELINE": str(path)})
    assert_no_false_alarm(r)
    events = json.loads(path.read_text())  # valid JSON: a Chrome trace array
    assert isinstance(events, list) and events
    rows = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    phases = {}  # tensor -> [(phase, B|E, ts)]
    for e in events:
        if e.get("ph") in ("B", "E"):
            assert isinstance(e["ts"], int) and e["ts"] >= 0, e
            phases.setdefault(rows[e["tid"]], []).append((e["name"], e["ph"], e["ts"]))
    expected = {"layer%d/grad" % k: ["QUEUE", "NEGOTIATE", "FUSION_COPY_IN", "ALLREDUCE", "FUSION_COPY_OUT"]
                for k in range(4)}
    # A lone tensor runs on the fused path too: same phases.
    expected["lone"] = ["QUEUE", "NEGOTIATE", "FUSION_COPY_IN", "ALLREDUCE", "FUSION_COPY_OUT"]
    expected["gathered"] = ["QUEUE", "NEGOTIATE", "ALLGATHER"]
    expected["bcast"] = ["QUEUE", "NEGOTIATE", "BROADCAST"]
    assert set(phases) == set(expected), sorted(phases)
    for tensor, want in expected.items():
        seq = phases[tensor]
        # Every phase opens and closes, in order, with non-decreasing timestamps.
        assert [p for p, ph, _ in seq if ph == "B"][:len(want)] == want, (tensor, seq)
        stack = []
        last = -1
        for name, ph, ts in seq:
            assert ts >= last, (tensor, seq)
            last = ts
            if ph == "B":
                stack.append(name)
            else:
                assert stack and stack.pop() == name, (tensor, seq)
        assert not stack, (tensor, seq)
    # Three steps: the group fused three times (the last two from its cached
    # plan), the lone tensor through the same path three times.
    assert sum(1 for p, ph, _ in phases["layer0/grad"] if p == "FUSION_COPY_IN" and ph == "B") == 3
    assert sum(1 for p, ph, _ in phases["lone"] if p == "ALLREDUCE" and ph == "B") == 3
    assert sum(1 for p, ph, _ in phases["lone"] if p == "FUSION_COPY_OUT" and ph == "B") == 3


# --- faults during init() -----------------------------------------------------
# NVGROUP_INIT_TIMEOUT 4 s: every rank must end within 4 s (arrival check:
# + 2 s) or 4 + 5 s (a phase stuck in a blocking MPI call, the init
# watchdog) of the fault; the run's own timeout only catches a hang.
INIT_ENV = {"NVGROUP_INIT_TIMEOUT": 4, "NVGROUP_TIMEOUT": 2}


def init_fault(tmp_path, np_, victim, phase, kind):
    r = run_recorded(tmp_path, "init_fault.py", np_, [victim, phase, kind], env=INIT_ENV)
    assert not r.timed_out, r
    assert r.returncode != 0, r
    return r


def ended_in_phase(r, rank, phase):
    """The init watchdog's line or the SIGTERM handler's (mpirun ends the
    others once one rank exits) for `rank` (None: before MPI knows it) in
    `phase`."""
    who = r"\?" if rank is None else str(rank)
    watchdog = lines(r, r"^\[nvgroup rank %s\] ERROR: nvgroup_tf.init was stuck for 9 s in phase %s \(.*\): a rank "
                        r"stopped, hung or died inside a blocking MPI call" % (who, phase))
    term = lines(r, r"^\[nvgroup rank %s\] ERROR: nvgroup_tf.init ended by SIGTERM in phase %s \(.*\): mpirun ends "
                    r"every rank this way when a rank dies during init\(\)" % (who, phase))
    return watchdog, term


@pytest.mark.parametrize("phase", ["cpu_communicator", "control_dup"])
def test_rank_frozen_in_a_blocking_init_phase_ends_every_rank(tmp_path, phase):
    """Rank 1 stops (SIGSTOP) where the others block in MPI without a timeout
    (MPI_Comm_dup / MPI_Comm_split of the CPU communicator's setup, the control
    communicator's MPI_Comm_dup): the init watchdog ends them, naming the
    phase, and mpirun ends the job. Before the watchdog they hung for good."""
    r = init_fault(tmp_path, 3, 1, phase, "stop")
    fired = 0
    for survivor in (0, 2):
        watchdog, term = ended_in_phase(r, survivor, phase)
        assert watchdog or term, "rank %d did not say where init() was stuck:\n%s" % (survivor, r.output[-5000:])
        fired += bool(watchdog)
    assert fired >= 1, r.output[-5000:]
    assert lines(r, r"^\[nvgroup rank \d\] ERROR: .*every rank reached init\(\)"), r.output[-5000:]


@pytest.mark.parametrize("phase", ["before_init", "mpi_init"])
def test_rank_frozen_in_mpi_init_ends_every_rank(tmp_path, phase):
    """Rank 1 stops before init() (from Python, no hook) or just before
    MPI_Init_thread: Open MPI's MPI_Init of the others waits for it forever
    (it did on the old code); the watchdog ends them."""
    r = init_fault(tmp_path, 2, 1, phase, "stop")
    watchdog, term = ended_in_phase(r, None, "mpi_init")
    assert watchdog or term, r.output[-5000:]


@pytest.mark.parametrize("victim", [2, 0])
def test_rank_that_never_arrives_is_named_by_every_rank(tmp_path, victim):
    """A rank that stops before the arrival check is named in init()'s error
    on every rank that arrived (by rank 0's verdict; rank 0 missing: by the
    ranks that heard nothing from it)."""
    r = init_fault(tmp_path, 3, victim, "arrival", "stop")
    for survivor in (s for s in range(3) if s != victim):
        if victim == 0:
            want = r"UNAVAILABLE: nvgroup_tf.init: rank 0 did not answer the arrival check within 6 s"
        else:
            want = r"UNAVAILABLE: nvgroup_tf.init: rank %d (of 3 )?did not reach init\(\) within 4 s" % victim
        assert lines(r, r"^rank %d: INIT_ERROR [0-9.]+ %s" % (survivor, want)), \
            "rank %d did not name rank %d:\n%s" % (survivor, victim, r.output[-5000:])


def test_rank_killed_during_init_is_reported_by_every_rank(tmp_path):
    """A rank dies (SIGKILL) in the knob agreement: Open MPI ends the others
    with SIGTERM (before the liveness monitor exists only mpirun sees a death,
    and its message names the rank); each says so, naming the phase."""
    r = init_fault(tmp_path, 3, 1, "knobs", "kill")
    assert re.search(r"rank 1 with PID \d+ on node \S+ exited on signal 9", r.output), r.output[-5000:]
    for survivor in (0, 2):
        watchdog, term = ended_in_phase(r, survivor, "knobs")
        assert term, "rank %d did not say it was ended in init():\n%s" % (survivor, r.output[-5000:])


def test_stale_shared_memory_of_a_dead_creator_is_removed_at_init(tmp_path):
    """A /dev/shm segment named after a creator that is gone from this pid
    namespace (a rank killed between shm_open and shm_unlink) is unlinked by
    the next setup of a shared-memory group; one of a live process, of another
    pid namespace or of another name format stays."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    ns = os.stat("/proc/self/ns/pid").st_ino
    stale = "/dev/shm/nvgroup.%d.%d.1.2.3.0" % (dead.pid, ns)
    kept = ["/dev/shm/nvgroup.%d.%d.1.2.3.0" % (os.getpid(), ns), "/dev/shm/nvgroup.%d.%d.1.2.3.0" % (dead.pid, ns + 1),
            "/dev/shm/nvgroup.%d.1.2.0" % dead.pid]
    for p in [stale] + kept:
        with open(p, "wb") as f:
            f.write(b"\0" * 4096)
    try:
        r = run_recorded(tmp_path, "init_fault.py", 2, [-1, "none", "stop"], env=INIT_ENV)
        assert r.returncode == 0 and len(set(lines(r, r"^(rank \d): INIT_OK$"))) == 2, r
        assert not os.path.exists(stale), "the dead creator's segment is still there"
        assert all(os.path.exists(p) for p in kept), [p for p in kept if not os.path.exists(p)]
    finally:
        for p in [stale] + kept:
            if os.path.exists(p):
                os.unlink(p)


# --- a rank lost between shutdown() and MPI_Finalize ----------------------------

FINALIZE_ENV = {"NVGROUP_TIMEOUT": 3}


def test_rank_frozen_after_shutdown_does_not_hold_the_others_in_mpi_finalize(tmp_path):
    """Rank 1 stops (SIGSTOP) after shutdown(), before it finalizes MPI. MPI_Finalize
    has no timeout: the others waited in it for good on the old code. Now each
    of them sees rank 1's heartbeats stop (the liveness monitor outlives the
    engine until MPI_Finalize returns), says which rank after NVGROUP_TIMEOUT
    and exits non-zero, and mpirun ends the job."""
    r = run_recorded(tmp_path, "finalize_fault.py", 3, [1, "stop", 0], env=FINALIZE_ENV)
    assert not r.timed_out, r
    assert r.returncode != 0, r
    for survivor in (0, 2):
        assert lines(r, r"^rank %d: SHUTDOWN_OK" % survivor), r.output[-5000:]
        assert not lines(r, r"^rank %d: FINALIZED" % survivor), r.output[-5000:]
    said = lines(r, r"^\[nvgroup rank \d\] ERROR: MPI_Finalize waited \d+ s \(NVGROUP_TIMEOUT\) for a rank that "
                    r"stopped after shutdown\(\): .*rank 1 .*; this rank exits without finalizing MPI")
    assert said, r.output[-5000:]
    assert_no_false_alarm(r)


def test_rank_busy_after_shutdown_is_waited_for_in_mpi_finalize(tmp_path):
    """A rank that works for longer than NVGROUP_TIMEOUT after shutdown() (rank 0
    evaluating a model) is alive: its heartbeats go on, the others wait for it
    in MPI_Finalize and every rank finalizes and exits 0."""
    r = run_recorded(tmp_path, "finalize_fault.py", 3, [0, "busy", 8], env=FINALIZE_ENV)
    assert not r.timed_out, r
    assert r.returncode == 0, r.output[-5000:]
    for rank in range(3):
        assert lines(r, r"^rank %d: FINALIZED" % rank), r.output[-5000:]
    assert "MPI_Finalize waited" not in r.output, r.output[-5000:]
    assert_no_false_alarm(r)


@pytest.mark.parametrize("np_", [2, 3])
def test_rank_stopped_in_add_process_set_is_named_by_every_rank(tmp_path, np_):
    """Rank 1 stops as add_process_set begins (after init() succeeded on every
    rank): the others' rank-list exchange gives up after its bound and a
    liveness probe on the control communicator names rank 1 in their error.
    Before, the error said only that some rank did not answer."""
    r = init_fault(tmp_path, np_, 1, "process_set", "stop")
    for survivor in (s for s in range(np_) if s != 1):
        assert lines(r, r"^rank %d: ADD_ERROR [0-9.]+ .*exchanging rank lists.*; rank 1 did not answer a liveness "
                        r"probe" % survivor), "rank %d did not name rank 1:\n%s" % (survivor, r.output[-5000:])


@pytest.mark.parametrize("np_,victim,phase,wait", [(3, 0, "device_check", "Init's device check"),
                                                    (2, 1, "dup", "Init's communicator duplication"),
                                                    (3, 1, "dup", "Init's communicator duplication")])
def test_rank_stopped_after_the_arrival_check_is_named_by_every_rank(tmp_path, np_, victim, phase, wait):
    """A rank stops after every rank arrived, in a bounded wait of init(): the
    agreement on CUDA at init (on the engine's communicator) or the
    duplication of the user's communicator right after the arrival check. The
    others' wait gives up after Init's bound and a liveness probe names the
    rank in their init() error. Before, the error said only that some rank did
    not answer (the duplication's until the fault campaign found it under
    load)."""
    r = init_fault(tmp_path, np_, victim, phase, "stop")
    for survivor in (s for s in range(np_) if s != victim):
        assert lines(r, r"^rank %d: INIT_ERROR [0-9.]+ .*%s.*; rank %d did not answer a liveness probe"
                        % (survivor, wait, victim)), \
            "rank %d did not name rank %d:\n%s" % (survivor, victim, r.output[-5000:])
