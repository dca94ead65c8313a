"""nvgrouprun's elastic mode with Horovod's three TF2 elastic examples
(tensorflow2_mnist_elastic.py, tensorflow2_keras_mnist_elastic.py,
tensorflow2_synthetic_benchmark_elastic.py, byte for byte; `horovod` is
aliased to nvgroup_tf by horovod_examples/horovod) on this host:

    nvgrouprun -np 3 --min-np 2 --max-np 3 --host-discovery-script S python prog.py

S prints `localhost:N`, N read from a file the test writes. One run of the
MNIST program goes through the whole story, and each test checks one promise
of it:
  1. at about batch KILL_AT one worker is SIGKILLed while S says 2 slots:
     the job goes on with 2 ranks from the last commit and ends with one model
     on every rank;
  2. S then says 3 slots again: the running workers are told at a commit,
     leave, and the job is relaunched on 3 ranks from that commit;
  3. the committed batch counter never goes back by more than one commit (the
     program commits every batch).
The Keras MNIST program and the synthetic benchmark each get case 1 (a kill,
then the job goes on with 2 and finishes with one model on every rank). The
stand-in MNIST is 8x8 random images (the programs' models build on the first
batch's shape), so a step costs milliseconds; the benchmark runs
MobileNetV3Small on batches of 2 for a few iterations (its flags). After every
run: no process of the job is left, no /dev/shm segment of its workers' pids,
no commit directory.

These whole jobs take minutes on the 2-core CI machine: they are marked slow
(python -m pytest -m "not slow" skips them). The driver's own errors (below
--min-np for --elastic-timeout, a broken discovery script, the reset limit,
the blacklist, malformed settings) run a tiny program without TensorFlow.
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpi_util import MPI_ENV, REPO  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(HERE, "horovod_examples")
LAUNCH = os.path.join(REPO, "nvgroup_tf", "runner", "launch.py")
PROGRAM = "tensorflow2_mnist_elastic.py"
KILL_AT = 150        # batch of launch 0 after which a worker is killed
GROW_AFTER = 100     # batches of launch 1 after which the third slot comes back
RUN_TIMEOUT_S = 540
PID_SAMPLE_S = 0.3   # how often the workers' pids are collected (each lives for seconds)
STOP_S = 30          # a stopped driver's grace (its own is 10 s per launch, elastic_driver.py)


def _env(tmp, overrides=None):
    env = dict(os.environ)
    env.update(MPI_ENV)
    env["PYTHONPATH"] = EXAMPLES + os.pathsep + REPO
    env["KERAS_HOME"] = str(tmp / "keras")
    env["NVGROUP_ELASTIC_BASE"] = str(tmp / "commits")
    env.update(overrides or {})
    return env


def _discovery_script(tmp, slots):
    slots_file = tmp / "slots"
    slots_file.write_text("%d\n" % slots)
    script = tmp / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:$(cat %s)\n" % slots_file)
    script.chmod(0o755)
    return script, slots_file


def _set_slots(slots_file, n):
    tmp = str(slots_file) + ".tmp"
    with open(tmp, "w") as f:
        f.write("%d\n" % n)
    os.replace(tmp, slots_file)


def _children(pid):
    """Pids of all descendants of pid (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/stat" % entry) as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _workers(driver_pid, program=PROGRAM):
    found = []
    for pid in _children(driver_pid):
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(program.encode()) for a in argv) and b"mpirun" not in argv[0]:
            found.append(pid)
    return found


def _alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _shm_of(pids):
    """The engine's segments of these processes (cc/transport/shm_group.h:
    nvgroup.<pid>.<pid ns>.*); other jobs on this shared machine have their own."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    return sorted(n for n in names for pid in pids if n.startswith("nvgroup.%d." % pid))


class Run:
    """An nvgrouprun job: its output lines, and every worker pid seen while it ran."""

    def __init__(self, proc, program=PROGRAM):
        self.proc = proc
        self.program = program
        self.lines = []
        self.pids = set()
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._sample_pids, daemon=True).start()

    def _sample_pids(self):
        while self.proc.poll() is None:
            self.pids.update(_workers(self.proc.pid, self.program))
            time.sleep(PID_SAMPLE_S)

    def _read(self):
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, pattern, start=0, timeout=RUN_TIMEOUT_S):
        """Index of the first line from `start` on matching `pattern`."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        with self.cond:
            while True:
                for i in range(start, len(self.lines)):
                    if rx.search(self.lines[i]):
                        return i
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None and not self._reader_alive():
                    raise AssertionError("no line matching %r; output:\n%s"
                                         % (pattern, "\n".join(self.lines[-200:])))
                self.cond.wait(min(left, 1.0))

    def _reader_alive(self):
        return any(t.is_alive() for t in threading.enumerate() if t.daemon)

    def text(self):
        with self.cond:
            return "\n".join(self.lines)


def _standin_mnist(tmp):
    """$KERAS_HOME/datasets/mnist-<rank>.npz, 8x8 random images (the shim reads them)."""
    (tmp / "keras" / "datasets").mkdir(parents=True)
    rng = np.random.default_rng(33)
    for r in range(3):  # the programs load mnist-<rank>.npz
        np.savez(tmp / "keras" / "datasets" / ("mnist-%d.npz" % r),
                 x_train=rng.integers(0, 256, (2048, 8, 8), dtype=np.uint8),
                 y_train=rng.integers(0, 10, 2048, dtype=np.uint8),
                 x_test=np.zeros((1, 8, 8), np.uint8), y_test=np.zeros(1, np.uint8))


def _start(tmp, program, args=()):
    """nvgrouprun -np 3 --min-np 2 --max-np 3 with a discovery script saying 3 slots."""
    script, slots_file = _discovery_script(tmp, 3)
    work = tmp / "work"
    work.mkdir()
    proc = subprocess.Popen(
        [sys.executable, LAUNCH, "-np", "3", "--min-np", "2", "--max-np", "3",
         "--host-discovery-script", str(script), "--elastic-timeout", "60",
         sys.executable, os.path.join(EXAMPLES, program)] + list(args),
        cwd=str(work), env=_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return Run(proc, program), slots_file


def _kill_one_worker(run, slots_file):
    """S says 2 slots, then one of the 3 workers gets SIGKILL; returns the line count then."""
    _set_slots(slots_file, 2)
    victims = _workers(run.proc.pid, run.program)
    assert len(victims) == 3, (victims, run.text())
    os.kill(max(victims), signal.SIGKILL)
    return len(run.lines)


def _finish(run, tmp, wait=True):
    """Waits for the job (wait=False: a test step failed, stop it now); what the
    tests check. Stopping is SIGTERM to the driver, which ends its launch's
    process group, then SIGKILL past STOP_S."""
    rc = None
    if wait:
        try:
            rc = run.proc.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    if rc is None:
        run.proc.terminate()
        try:
            run.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            run.proc.kill()
            run.proc.wait()
    run.wait_for(r"launch \d+ (finished|failed|ended)|nvgrouprun: error:", 0, timeout=10)
    (tmp / "story.log").write_text(run.text())  # for a failure's post-mortem
    time.sleep(1.0)  # the last workers' exits, reaped by mpirun
    return {"rc": rc, "lines": list(run.lines), "text": run.text(), "tmp": tmp, "driver": run.proc.pid,
            "pids": sorted(run.pids), "left_alive": [p for p in run.pids if _alive(p)],
            "shm_left": _shm_of(run.pids)}


def _assert_nothing_left_behind(result):
    assert len(result["pids"]) >= 3, result["pids"]  # the sampler saw the workers
    assert result["left_alive"] == [], result["left_alive"]
    assert _children(result["driver"]) == []
    assert result["shm_left"] == [], result["shm_left"]
    commits = result["tmp"] / "commits"
    assert not commits.exists() or os.listdir(commits) == [], os.listdir(commits)


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("elastic")
    _standin_mnist(tmp)
    run, slots_file = _start(tmp, PROGRAM)
    events, steered = {}, False
    try:
        run.wait_for(r"^Step #%d\t" % KILL_AT)
        events["killed"] = _kill_one_worker(run, slots_file)
        i = run.wait_for(r"elastic: launch 1: 2 rank\(s\)", events["killed"])
        j = run.wait_for(r"launch 1 resumes from commit", i)
        first = int(re.search(r"batch=(\d+)", run.lines[j]).group(1))
        run.wait_for(r"^Step #%d\t" % ((first + GROW_AFTER) // 10 * 10), j)
        _set_slots(slots_file, 3)
        events["grown"] = len(run.lines)
        steered = True
    finally:
        result = _finish(run, tmp, wait=steered)
    return dict(result, events=events)


def _resumes(lines, launch):
    out = []
    for line in lines:
        m = re.search(r"rank (\d+): launch %d resumes from commit (\d+) .*batch=(\d+)" % launch, line)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), int(m.group(3))))
    return out


def _digests(lines, launch):
    return {int(m.group(1)): m.group(2) for m in
            (re.search(r"ELASTIC_WEIGHTS launch=%d rank=(\d+) digest=(\w+)" % launch, l) for l in lines)
            if m}


@pytest.mark.slow
def test_a_killed_worker_the_job_goes_on_with_two_from_the_last_commit(story):
    lines, text = story["lines"], story["text"]
    assert story["rc"] == 0, text[-20000:]
    killed = story["events"]["killed"]
    assert any(re.search(r"launch 0 failed with exit status", l) for l in lines[killed:]), text[-8000:]
    assert any("launch 1: 2 rank(s) on localhost:2" in l for l in lines[killed:]), text[-8000:]
    resumed = _resumes(lines, 1)
    assert sorted(r for r, _, _ in resumed) == [0, 1], text[-8000:]
    assert len({(c, b) for _, c, b in resumed}) == 1, resumed  # one commit on both ranks
    last = _resumes(lines, 2)
    final_launch = 2 if last else 1
    digests = _digests(lines, final_launch)
    assert len(digests) == (3 if last else 2) and len(set(digests.values())) == 1, (digests, text[-4000:])
    _assert_nothing_left_behind(story)


@pytest.mark.slow
def test_three_slots_again_the_job_grows_back(story):
    lines, text = story["lines"], story["text"]
    grown = story["events"]["grown"]
    assert any("hosts changed to localhost:3" in l for l in lines[grown:]), text[-8000:]
    assert any("launch 1 ended for the new hosts" in l for l in lines[grown:]), text[-8000:]
    assert any("launch 2: 3 rank(s) on localhost:3" in l for l in lines[grown:]), text[-8000:]
    resumed = _resumes(lines, 2)
    assert sorted(r for r, _, _ in resumed) == [0, 1, 2], text[-8000:]
    assert len({(c, b) for _, c, b in resumed}) == 1, resumed
    digests = _digests(lines, 2)
    assert sorted(digests) == [0, 1, 2] and len(set(digests.values())) == 1, digests
    assert any("launch 2 finished" in l for l in lines), text[-4000:]


@pytest.mark.slow
def test_committed_batches_never_go_back_more_than_one_commit(story):
    """Each launch prints Step #b (b % 10 == 0) before committing batch b; a
    relaunch resumes from commit batch=c: c must be >= the last b printed before
    it, less one (the commit of b may have been cut off by the kill), and the
    steps after it start at c."""
    lines = story["lines"]
    for launch in (1, 2):
        resumed = _resumes(lines, launch)
        assert resumed, "launch %d did not resume" % launch
        at = min(i for i, l in enumerate(lines) if "launch %d resumes" % launch in l)
        before = [int(m.group(1)) for m in (re.match(r"^Step #(\d+)\t", l) for l in lines[:at]) if m]
        c = resumed[0][2]
        assert c >= max(before) - 1, (launch, c, max(before))
        after = [int(m.group(1)) for m in (re.match(r"^Step #(\d+)\t", l) for l in lines[at:]) if m]
        assert after and after[0] >= c and after[0] - c <= 10, (launch, c, after[:3])
    # the counters only go forward inside a launch
    steps = [int(m.group(1)) for m in (re.match(r"^Step #(\d+)\t", l) for l in lines) if m]
    assert steps[-1] >= 10000 // 3 - 10 + _resumes(lines, 2)[0][2], steps[-5:]


# ------------------------------------------- the other two TF2 elastic examples

# (program, its flags, the output line after which a worker is killed, the
# progress lines before it: (pattern with one group, the state attribute the
# group counts, how far the committed value may be behind the last one seen)).
# The Keras program commits every batch (CommitStateCallback) and prints
# "Epoch k/24" as epoch k-1 starts: the resumed epoch is the one in progress or
# the next. The benchmark prints "Iter #x" and then commits iter=x: the resumed
# iter is x, or x-1 when the kill cut that commit off.
OTHER_EXAMPLES = [
    ("tensorflow2_keras_mnist_elastic.py", [], r"^Epoch 3/24", (r"^Epoch (\d+)/24", "epoch", 1)),
    ("tensorflow2_synthetic_benchmark_elastic.py",
     ["--model", "MobileNetV3Small", "--batch-size", "2", "--num-warmup-batches", "2",
      "--num-batches-per-iter", "2", "--num-iters", "5", "--no-cuda"], r"^Iter #1:", (r"^Iter #(\d+):", "iter", 1)),
]


@pytest.mark.slow
@pytest.mark.parametrize("program,args,kill_after,progress", OTHER_EXAMPLES,
                         ids=[p.split(".")[0] for p, _, _, _ in OTHER_EXAMPLES])
def test_horovod_example_a_killed_worker_goes_on_with_two_and_finishes(tmp_path, program, args, kill_after,
                                                                        progress):
    _standin_mnist(tmp_path)
    run, slots_file = _start(tmp_path, program, args)
    steered = False
    try:
        run.wait_for(kill_after)
        killed = _kill_one_worker(run, slots_file)
        steered = True
    finally:
        result = _finish(run, tmp_path, wait=steered)
    lines, text = result["lines"], result["text"]
    assert result["rc"] == 0, text[-20000:]
    assert any(re.search(r"launch 0 failed with exit status", l) for l in lines[killed:]), text[-8000:]
    assert any("launch 1: 2 rank(s) on localhost:2" in l for l in lines[killed:]), text[-8000:]
    assert not any("launch 2:" in l for l in lines), text[-8000:]
    resumed = [l for l in lines if "launch 1 resumes from commit" in l]
    assert sorted(int(re.search(r"rank (\d+):", l).group(1)) for l in resumed) == [0, 1], text[-8000:]
    assert len({l.split(": ", 2)[2] for l in resumed}) == 1, resumed  # one commit on both ranks
    pattern, attr, behind = progress
    at = min(i for i, l in enumerate(lines) if "launch 1 resumes from commit" in l)
    seen = [int(m.group(1)) for m in (re.match(pattern, l) for l in lines[:at]) if m]
    value = int(re.search(r"\b%s=(\d+)" % attr, resumed[0]).group(1))
    last = seen[-1] - 1 if attr == "epoch" else seen[-1]  # "Epoch k/24" is epoch k-1
    assert value >= last - behind, (attr, value, seen[-3:])
    digests = _digests(lines, 1)
    assert sorted(digests) == [0, 1] and len(set(digests.values())) == 1, (digests, text[-4000:])
    assert any("launch 1 finished" in l for l in lines), text[-4000:]
    _assert_nothing_left_behind(result)


# ------------------------------------------------------------ driver errors

TINY = ("import os, sys\n"
        "sys.exit(int(os.environ.get('TINY_EXIT', '0')))\n")


def _driver(tmp, args, env_overrides=None, timeout=120):
    prog = tmp / "tiny.py"
    prog.write_text(TINY)
    res = subprocess.run([sys.executable, LAUNCH] + args + [sys.executable, str(prog)],
                         env=_env(tmp, env_overrides), capture_output=True, text=True, timeout=timeout)
    return res.returncode, res.stdout + res.stderr


def test_below_min_np_for_longer_than_the_elastic_timeout_fails_clearly(tmp_path):
    script, _ = _discovery_script(tmp_path, 1)
    start = time.monotonic()
    rc, out = _driver(tmp_path, ["--min-np", "2", "--host-discovery-script", str(script),
                                 "--elastic-timeout", "2"])
    assert rc == 2, out
    assert "fewer than --min-np 2" in out and "--elastic-timeout 2" in out, out
    assert time.monotonic() - start < 30


def test_reset_limit_and_a_broken_discovery_script(tmp_path):
    script, _ = _discovery_script(tmp_path, 2)
    rc, out = _driver(tmp_path, ["--min-np", "2", "--host-discovery-script", str(script),
                                 "--reset-limit", "1", "--blacklist-after", "5"], {"TINY_EXIT": "3"})
    assert rc == 2 and "reset 2 times (--reset-limit 1)" in out, out
    assert out.count("failed with exit status 3") == 2, out
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/sh\necho 'not a host list:x'\n")
    bad.chmod(0o755)
    rc, out = _driver(tmp_path, ["--min-np", "1", "--host-discovery-script", str(bad)])
    assert rc == 2 and "printed 'not a host list:x'" in out, out


def test_malformed_elastic_base_is_an_error_naming_it(tmp_path):
    script, _ = _discovery_script(tmp_path, 2)
    rc, out = _driver(tmp_path, ["--min-np", "2", "--host-discovery-script", str(script)],
                      {"NVGROUP_ELASTIC_BASE": "commits"})
    assert rc == 2, out
    assert ("nvgrouprun: error: environment variable NVGROUP_ELASTIC_BASE='commits' is not valid: "
            "expected an absolute path (starting with /)") in out, out
    assert "launch 0" not in out, out


WORKER_SETTINGS = """
import nvgroup_tf.elastic as elastic
try:
    elastic._elastic_job()
    print("NO ERROR")
except ValueError as e:
    print("ValueError:", e)
"""


@pytest.mark.parametrize("variables,message", [
    ({"NVGROUP_ELASTIC_JOB": "0123456789abcdef0123456789abcdef", "NVGROUP_ELASTIC_DIR": "/tmp/x"},
     "NVGROUP_ELASTIC_JOB is set but NVGROUP_ELASTIC_NOTIFY and NVGROUP_ELASTIC_LAUNCH are not: these "
     "variables are set together by nvgrouprun's elastic mode"),
    ({"NVGROUP_ELASTIC_JOB": "job-1"},
     "environment variable NVGROUP_ELASTIC_JOB='job-1' is not valid: expected 32 lowercase hexadecimal digits"),
])
def test_a_worker_with_partial_or_malformed_driver_settings_fails_naming_them(tmp_path, variables, message):
    env = _env(tmp_path, variables)
    res = subprocess.run([sys.executable, "-c", WORKER_SETTINGS], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "ValueError: " + message in res.stdout, res.stdout + res.stderr


ONE_WRITE = """
import sys
import nvgroup_tf.elastic as elastic
writes = []
class Recorder:
    def write(self, text):
        writes.append(text)
    def flush(self):
        pass
real, sys.stderr = sys.stderr, Recorder()
elastic._report("rank 0: launch 1 resumes from commit 3")
sys.stderr = real
print(repr(writes))
"""


def test_the_elastic_messages_are_one_write_each(tmp_path):
    """mpirun joins the ranks' output as it comes: a line written in two parts
    (print's text, then its newline) ends up glued to other ranks' lines."""
    res = subprocess.run([sys.executable, "-c", ONE_WRITE], env=_env(tmp_path), capture_output=True, text=True,
                         timeout=300)
    assert res.stdout.strip().splitlines()[-1] == repr(
        ["nvgroup_tf.elastic: rank 0: launch 1 resumes from commit 3\n"]), res.stdout + res.stderr


def test_a_host_that_keeps_failing_is_blacklisted(tmp_path):
    script, _ = _discovery_script(tmp_path, 2)
    rc, out = _driver(tmp_path, ["--min-np", "2", "--host-discovery-script", str(script),
                                 "--blacklist-after", "2", "--elastic-timeout", "1"], {"TINY_EXIT": "3"})
    assert rc == 2, out
    assert "host localhost blacklisted: 2 failed launches in a row" in out, out
    assert "blacklisted: localhost" in out and "fewer than --min-np 2" in out, out
