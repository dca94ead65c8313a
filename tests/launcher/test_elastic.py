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
The Keras MNIST program and the synthetic benchmark each go through the same
story in one run of their own (example_story, parametrized by program), with
the same three checks: the kill, the growth back to 3 ranks (read from the
driver's log and from the program's own output of hvd.size()), and their
committed counters (epoch and batch; iter, img_secs and warm; and the commit
counter of every relaunch) never going back by more than one commit. The
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
import ast
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

# The Keras MNIST program and the synthetic benchmark each go through the same
# story as MNIST, in one run per program (example_story): at a progress line of
# launch 0 one worker is SIGKILLed while S says 2 slots; launch 1 goes on with 2
# ranks from the last commit; at its first progress line S says 3 slots again
# and the job grows back to 3 ranks (launch 2), which finishes.
#
# What they commit and print:
#  * Keras MNIST commits after every batch (state.batch = the batch's index in
#    its epoch) and at every epoch end (state.epoch + 1, batch 0)
#    (CommitStateCallback, batches_per_commit=1). Every rank prints "Epoch k/N"
#    as the k-th epoch of its fit starts, N = 24 - state.epoch at the launch's
#    start (fit(epochs=24 - state.epoch)): the epoch in progress is 24 - N + k - 1,
#    and the epoch end's commit before it is written (a commit ends with a
#    broadcast from rank 0, which writes the commit first). Its progress lines
#    "b/S" show the launch's steps per epoch S = 500 // hvd.size(). After a
#    resume fit runs the resumed epoch from its batch 0 again (Keras 3's fit
#    keeps its own step count, nvgroup_tf/keras/elastic.py), so state.batch
#    restarts there; state.epoch and the commit counter only go forward.
#  * The synthetic benchmark commits after every batch (batch=0), once after the
#    warm-up (warm=True) and after each iteration (iter=x, img_secs + [its
#    img/sec]); rank 0 prints "Iter #x: v img/sec per CPU" just before committing
#    iter=x, "Number of CPUs: n" at every start and "Total img/sec on n CPU(s)"
#    at the end. A resumed iter=x runs iteration x again (its loop starts at
#    state.iter).
# The commit counter (one more at every commit()) is in the workers' messages:
# "launch L resumes from commit M", "state written at commit M" (ranks leaving
# for new hosts: one more commit, of the state of the commit before it), and
# "leaving for the driver to relaunch from commit M" (a survivor of the kill).

KERAS_EPOCHS = 24          # tensorflow2_keras_mnist_elastic.py: 24 epochs
KERAS_STEPS = 500          # of 500 // hvd.size() steps
BENCH_WARMUP = 2           # --num-warmup-batches
BENCH_BATCHES = 2          # --num-batches-per-iter
BENCH_ITERS = 8            # --num-iters: iterations left for the grow after its first one on 2 ranks

OTHER_EXAMPLES = {
    "tensorflow2_keras_mnist_elastic": dict(
        program="tensorflow2_keras_mnist_elastic.py", args=[],
        start=dict(epoch=0, batch=0),  # KerasState(model, batch=0, epoch=0)
        kill_after=r"Epoch 3/24\s*$",
        # launch 1 finished a whole epoch on 2 ranks: "Epoch 2/N" of its fit
        grow_after=lambda attrs: r"Epoch 2/%d\s*$" % (KERAS_EPOCHS - attrs["epoch"])),
    "tensorflow2_synthetic_benchmark_elastic": dict(
        program="tensorflow2_synthetic_benchmark_elastic.py",
        args=["--model", "MobileNetV3Small", "--batch-size", "2", "--num-warmup-batches", str(BENCH_WARMUP),
              "--num-batches-per-iter", str(BENCH_BATCHES), "--num-iters", str(BENCH_ITERS), "--no-cuda"],
        start=dict(img_secs=[], iter=0, batch=0, warm=False),
        kill_after=r"^Iter #1:",
        grow_after=lambda attrs: r"^Iter #\d+:"),
}


def _plain(line):
    """The line without its terminal colours (Keras's progress bar has them)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", line)


def _keras_epochs(lines):
    """(line index, epoch in progress) of every "Epoch k/N" line. (A fit of one
    epoch, as the program's warm-up and reset fits, prints none.)"""
    out = []
    for i, line in enumerate(lines):
        m = re.search(r"Epoch (\d+)/(\d+)\s*$", _plain(line))
        if m:
            out.append((i, KERAS_EPOCHS - int(m.group(2)) + int(m.group(1)) - 1))
    return out


def _keras_steps_seen(lines, steps):
    """Whether a progress line "b/steps" is among lines."""
    return any(re.match(r"^\s*\d+/%d\s" % steps, _plain(line)) for line in lines)


def _bench_iters(lines):
    """(line index, x, the printed img/sec) of every "Iter #x: v img/sec" line."""
    out = []
    for i, line in enumerate(lines):
        m = re.search(r"Iter #(\d+): ([\d.]+) img/sec", line)
        if m:
            out.append((i, int(m.group(1)), float(m.group(2))))
    return out


def _committed(name, start, size, n):
    """The program's committed attributes n commits after a launch of `size`
    ranks started from the attributes `start` (see above)."""
    if "img_secs" in start:
        start = dict(start, img_secs=len(start["img_secs"]))  # compared by their count
    if n == 0:
        return dict(start)
    if name.startswith("tensorflow2_keras"):
        epochs, r = divmod(n, KERAS_STEPS // size + 1)  # its batches' commits, then the epoch end's
        return dict(epoch=start["epoch"] + epochs, batch=r - 1 if r else 0)
    warm, it, imgs = start["warm"], start["iter"], start["img_secs"]
    if not warm:
        if n <= BENCH_WARMUP:
            return dict(start)
        n -= BENCH_WARMUP + 1
        warm = True
    done = n // (BENCH_BATCHES + 1)
    return dict(warm=warm, iter=it + done - 1 if done else it, batch=0, img_secs=imgs + done)


def _attrs(line):
    """The committed attributes a resume line prints, "(name=repr, ...)": name -> value."""
    call = ast.parse("f(%s)" % line.split(" (", 1)[1].rsplit(")", 1)[0], mode="eval").body
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords}


def _resume_lines(lines, launch):
    """{rank: (line index, commit counter, attributes)} of launch's resume lines."""
    out = {}
    for i, line in enumerate(lines):
        m = re.search(r"rank (\d+): launch %d resumes from commit (\d+) " % launch, line)
        if m:
            out[int(m.group(1))] = (i, int(m.group(2)), _attrs(line[m.start():]))
    return out


def _line_of(lines, text, start=0):
    return next((i for i in range(start, len(lines)) if text in lines[i]), None)


@pytest.fixture(scope="module", params=sorted(OTHER_EXAMPLES))
def example_story(request, tmp_path_factory):
    spec = OTHER_EXAMPLES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    _standin_mnist(tmp)
    run, slots_file = _start(tmp, spec["program"], spec["args"])
    events, steered = {}, False
    try:
        run.wait_for(spec["kill_after"])
        events["killed"] = _kill_one_worker(run, slots_file)
        i = run.wait_for(r"elastic: launch 1: 2 rank\(s\)", events["killed"])
        j = run.wait_for(r"launch 1 resumes from commit", i)
        run.wait_for(spec["grow_after"](_attrs(run.lines[j])), j + 1)
        _set_slots(slots_file, 3)
        events["grown"] = len(run.lines)
        steered = True
    finally:
        result = _finish(run, tmp, wait=steered)
    return dict(result, events=events, name=request.param, spec=spec)


def _one_commit_on_all(resumed):
    return len({(c, repr(sorted(a.items()))) for _, c, a in resumed.values()}) == 1


@pytest.mark.slow
def test_horovod_example_a_killed_worker_goes_on_with_two_from_the_last_commit(example_story):
    story = example_story
    lines, text = story["lines"], story["text"]
    assert story["rc"] == 0, text[-20000:]
    killed, grown = story["events"]["killed"], story["events"]["grown"]
    assert _line_of(lines, "launch 0 failed with exit status", killed) is not None, text[-8000:]
    launched = _line_of(lines, "elastic: launch 1: 2 rank(s) on localhost:2", killed)
    assert launched is not None, text[-8000:]
    resumed = _resume_lines(lines, 1)
    assert sorted(resumed) == [0, 1] and _one_commit_on_all(resumed), (resumed, text[-8000:])
    start = min(i for i, _, _ in resumed.values())
    # the program trained on the 2 ranks (hvd.size() == 2) before the grow
    if story["name"].startswith("tensorflow2_keras"):
        assert any(start < i < grown and e > resumed[0][2]["epoch"] for i, e in _keras_epochs(lines)), text[-8000:]
        assert _keras_steps_seen(lines[start:grown], KERAS_STEPS // 2), text[-8000:]
    else:
        assert "Number of CPUs: 2" in lines[launched:start], text[-8000:]
        assert any(start < i < grown for i, _, _ in _bench_iters(lines)), text[-8000:]
    digests = _digests(lines, 2)  # the job's end, after the grow
    assert sorted(digests) == [0, 1, 2] and len(set(digests.values())) == 1, (digests, text[-4000:])
    _assert_nothing_left_behind(story)


@pytest.mark.slow
def test_horovod_example_three_slots_again_the_job_grows_back(example_story):
    story = example_story
    lines, text = story["lines"], story["text"]
    grown = story["events"]["grown"]
    assert _line_of(lines, "hosts changed to localhost:3", grown) is not None, text[-8000:]
    ended = _line_of(lines, "launch 1 ended for the new hosts", grown)
    assert ended is not None, text[-8000:]
    assert _line_of(lines, "elastic: launch 2: 3 rank(s) on localhost:3", ended) is not None, text[-8000:]
    resumed = _resume_lines(lines, 2)
    assert sorted(resumed) == [0, 1, 2] and _one_commit_on_all(resumed), (resumed, text[-8000:])
    # the program itself runs on 3 ranks again (hvd.size() == 3)
    after = lines[min(i for i, _, _ in resumed.values()):]
    if story["name"].startswith("tensorflow2_keras"):
        assert _keras_steps_seen(after, KERAS_STEPS // 3), text[-8000:]
    else:
        assert "Number of CPUs: 3" in lines[ended:], text[-8000:]
        assert any(line.startswith("Total img/sec on 3 CPU(s)") for line in after), text[-8000:]
    digests = _digests(lines, 2)
    assert sorted(digests) == [0, 1, 2] and len(set(digests.values())) == 1, digests
    assert _line_of(lines, "launch 2 finished") is not None, text[-4000:]
    assert _line_of(lines, "elastic: launch 3:") is None, text[-4000:]


@pytest.mark.slow
def test_horovod_example_committed_counters_never_go_back_more_than_one_commit(example_story):
    """At each relaunch: the commit counter resumed is at most one behind the
    last commit known to be written (a survivor of the kill can be inside a
    commit the victim never wrote; leaving for new hosts loses none); the
    program's counters resumed are those of that commit, and not behind its
    progress lines by more than one commit; the program goes on from them; at
    the end its counters are complete."""
    story = example_story
    name, lines, text = story["name"], story["lines"], story["text"]
    keras = name.startswith("tensorflow2_keras")
    resumed = {launch: _resume_lines(lines, launch) for launch in (1, 2)}
    assert resumed[1] and resumed[2], text[-8000:]
    at = {launch: min(i for i, _, _ in r.values()) for launch, r in resumed.items()}
    counter = {launch: r[0][1] for launch, r in resumed.items()}
    attrs = {launch: r[0][2] for launch, r in resumed.items()}

    # the commit counter
    survivors = [int(m.group(1)) for m in (re.search(r"leaving for the driver to relaunch from commit (\d+)", l)
                                           for l in lines[:at[1]]) if m]
    if survivors:  # when mpirun has not ended them first
        assert max(survivors) - 1 <= counter[1] <= max(survivors) + 1, (counter[1], survivors)
    written = [int(m.group(1)) for m in (re.search(r"hosts changed; state written at commit (\d+)", l)
                                         for l in lines[at[1]:at[2]]) if m]
    assert len(written) == 2 and len(set(written)) == 1, (written, text[-8000:])
    assert counter[2] == written[0] > counter[1], (counter, written)

    # the program's counters are those of the resumed commit: launch 0 started
    # at commit 0 from the program's initial state on 3 ranks, launch 1 from
    # its resumed commit on 2 (its last commit repeated by the leaving ranks)
    expect1 = _committed(name, story["spec"]["start"], 3, counter[1])
    expect2 = _committed(name, attrs[1], 2, counter[2] - 1 - counter[1])
    for launch, expect in ((1, expect1), (2, expect2)):
        got = dict(attrs[launch])
        if "img_secs" in got:
            got["img_secs"] = len(got["img_secs"])
        assert got == expect, (launch, counter, got, expect)

    # ... not behind the progress printed before the relaunch by more than one
    # commit, and the program goes on from them
    if keras:
        epochs = _keras_epochs(lines)
        for launch, size_before in ((1, 3), (2, 2)):
            seen = [e for i, e in epochs if i < at[launch]]
            # seen[-1] is committed as (seen[-1], 0); one commit before: (seen[-1] - 1, its last batch)
            assert (attrs[launch]["epoch"], attrs[launch]["batch"]) >= (seen[-1] - 1, KERAS_STEPS // size_before - 1), (
                launch, attrs[launch], seen[-3:])
            nxt = [e for i, e in epochs if i > at[launch]]
            assert nxt and nxt[0] == attrs[launch]["epoch"], (launch, attrs[launch], nxt[:3])
        for a, b in _pairs_inside_launches(lines, epochs):
            assert b in (a, a + 1), (a, b)  # every rank prints every epoch
        assert epochs[-1][1] == KERAS_EPOCHS - 1, epochs[-5:]
    else:
        iters = _bench_iters(lines)
        for launch in (1, 2):
            seen = [(x, v) for i, x, v in iters if i < at[launch]]
            # "Iter #x: v" is printed before the commit of iter=x, img_secs + [v]
            assert attrs[launch]["iter"] >= seen[-1][0] - 1, (launch, attrs[launch], seen[-3:])
            printed, kept = [v for _, v in seen], [round(v, 1) for v in attrs[launch]["img_secs"]]
            assert len(kept) >= len(printed) - 1 and kept == printed[:len(kept)], (launch, kept, printed)
            nxt = [x for i, x, _ in iters if i > at[launch]]
            assert nxt and nxt[0] == attrs[launch]["iter"], (launch, attrs[launch], nxt[:3])
        for a, b in _pairs_inside_launches(lines, [(i, x) for i, x, _ in iters]):
            assert b == a + 1, (a, b)
        assert iters[-1][1] == BENCH_ITERS - 1, iters[-3:]


def _pairs_inside_launches(lines, progress):
    """Consecutive (value, next value) of progress [(line index, value)] within one launch."""
    starts = [i for i, line in enumerate(lines) if re.search(r"elastic: launch \d+: ", line)]

    def launch_of(i):
        return sum(1 for s in starts if s < i)
    return [(a, b) for (i, a), (j, b) in zip(progress, progress[1:]) if launch_of(i) == launch_of(j)]


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
