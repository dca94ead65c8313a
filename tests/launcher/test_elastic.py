"""nvgrouprun's elastic mode with Horovod's TF2 elastic example
(tensorflow2_mnist_elastic.py, byte for byte; `horovod` is aliased to
nvgroup_tf by horovod_examples/horovod) on this host:

    nvgrouprun -np 3 --min-np 2 --max-np 3 --host-discovery-script S python prog.py

S prints `localhost:N`, N read from a file the test writes. One run goes
through the whole story, and each test checks one promise of it:
  1. at about batch KILL_AT one worker is SIGKILLed while S says 2 slots:
     the job goes on with 2 ranks from the last commit and ends with one model
     on every rank;
  2. S then says 3 slots again: the running workers are told at a commit,
     leave, and the job is relaunched on 3 ranks from that commit;
  3. the committed batch counter never goes back by more than one commit (the
     program commits every batch).
The stand-in MNIST is 8x8 random images (the program's model builds on the
first batch's shape), so a step costs milliseconds and the run is short.
Plus the driver's own errors (below --min-np for --elastic-timeout, a broken
discovery script, the reset limit) on a tiny program without TensorFlow.
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


def _env(tmp, extra=None):
    env = dict(os.environ)
    env.update(MPI_ENV)
    env["PYTHONPATH"] = EXAMPLES + os.pathsep + REPO
    env["KERAS_HOME"] = str(tmp / "keras")
    env["NVGROUP_ELASTIC_BASE"] = str(tmp / "commits")
    env.update(extra or {})
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


def _workers(driver_pid):
    found = []
    for pid in _children(driver_pid):
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(PROGRAM.encode()) for a in argv) and b"mpirun" not in argv[0]:
            found.append(pid)
    return found


def _shm():
    """The engine's segments (cc/transport/shm_group.h: nvgroup.<pid>.*); Open MPI's
    vader segments of other jobs on this shared machine come and go."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("nvgroup.")}
    except OSError:
        return set()


class Run:
    def __init__(self, proc):
        self.proc = proc
        self.lines = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

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


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("elastic")
    (tmp / "keras" / "datasets").mkdir(parents=True)
    rng = np.random.default_rng(33)
    for r in range(3):  # the program loads mnist-<rank>.npz
        np.savez(tmp / "keras" / "datasets" / ("mnist-%d.npz" % r),
                 x_train=rng.integers(0, 256, (2048, 8, 8), dtype=np.uint8),
                 y_train=rng.integers(0, 10, 2048, dtype=np.uint8),
                 x_test=np.zeros((1, 8, 8), np.uint8), y_test=np.zeros(1, np.uint8))
    script, slots_file = _discovery_script(tmp, 3)
    work = tmp / "work"
    work.mkdir()
    shm_before = _shm()
    proc = subprocess.Popen(
        [sys.executable, LAUNCH, "-np", "3", "--min-np", "2", "--max-np", "3",
         "--host-discovery-script", str(script), "--elastic-timeout", "60",
         sys.executable, os.path.join(EXAMPLES, PROGRAM)],
        cwd=str(work), env=_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = Run(proc)
    events = {}
    try:
        run.wait_for(r"^Step #%d\t" % KILL_AT)
        _set_slots(slots_file, 2)
        victims = _workers(proc.pid)
        assert len(victims) == 3, (victims, run.text())
        os.kill(max(victims), signal.SIGKILL)
        events["killed"] = len(run.lines)
        i = run.wait_for(r"elastic: launch 1: 2 rank\(s\)", events["killed"])
        j = run.wait_for(r"launch 1 resumes from commit", i)
        first = int(re.search(r"batch=(\d+)", run.lines[j]).group(1))
        run.wait_for(r"^Step #%d\t" % ((first + GROW_AFTER) // 10 * 10), j)
        _set_slots(slots_file, 3)
        events["grown"] = len(run.lines)
        rc = proc.wait(RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run.wait_for(r"launch \d+ (finished|failed)", 0, timeout=10)
    (tmp / "story.log").write_text(run.text())  # for a failure's post-mortem
    return {"rc": rc, "lines": list(run.lines), "text": run.text(), "events": events,
            "tmp": tmp, "driver": proc.pid, "shm_new": _shm() - shm_before}


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
    # nothing left behind: processes, commit files, shared memory
    assert _children(story["driver"]) == []
    commits = story["tmp"] / "commits"
    assert not commits.exists() or os.listdir(commits) == [], os.listdir(commits)
    assert story["shm_new"] == set(), story["shm_new"]


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


# ------------------------------------------------------------ driver errors

TINY = ("import os, sys\n"
        "sys.exit(int(os.environ.get('TINY_EXIT', '0')))\n")


def _driver(tmp, args, extra_env=None, timeout=120):
    prog = tmp / "tiny.py"
    prog.write_text(TINY)
    res = subprocess.run([sys.executable, LAUNCH] + args + [sys.executable, str(prog)],
                         env=_env(tmp, extra_env), capture_output=True, text=True, timeout=timeout)
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


def test_a_host_that_keeps_failing_is_blacklisted(tmp_path):
    script, _ = _discovery_script(tmp_path, 2)
    rc, out = _driver(tmp_path, ["--min-np", "2", "--host-discovery-script", str(script),
                                 "--blacklist-after", "2", "--elastic-timeout", "1"], {"TINY_EXIT": "3"})
    assert rc == 2, out
    assert "host localhost blacklisted: 2 failed launches in a row" in out, out
    assert "blacklisted: localhost" in out and "fewer than --min-np 2" in out, out
