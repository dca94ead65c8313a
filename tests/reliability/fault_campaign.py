"""Fault campaign: small CPU jobs (mpirun, 2-4 ranks) on the user's paths, one
rank SIGKILLed or SIGSTOPped at a random time, and a verdict per trial.

    python tests/reliability/fault_campaign.py --trials N [--seed S] [--parallel P] \\
        [--out benchmarks/results/fault_campaign.json]

The paths, phases and faults are those of workers/campaign_worker.py; the plan
is a pure function of the seed. Verdict of a trial whose fault was delivered:

  * named    -- every survivor that had not finished ends with an error naming
                the lost rank ("rank V "), within the bound; a fault of phase
                init may instead end a survivor with init()'s own line naming
                the phase it was stuck in (the init watchdog, or mpirun's
                SIGTERM after a death: cc/engine/init_watchdog.h), mpirun's
                message then naming the dead rank for a kill; a survivor
                mpirun ended before it could say anything (still importing
                when the SIGTERM came, or its SIGKILL before the handler ran)
                passes for a kill in init when mpirun's message names the
                dead rank;
  * bounded  -- mpirun and every rank are gone within the bound after the
                fault: NVGROUP_TIMEOUT (set to TIMEOUT_S here; README "When
                things go wrong") plus EXIT_SLACK_S for the detection (heartbeats
                every 0.2 s, silent after 1 s: cc/transport/liveness.h) and
                the processes' exit; for a fault of phase init,
                NVGROUP_INIT_TIMEOUT (INIT_TIMEOUT_S) plus the watchdog's
                grace (INIT_GRACE_S) plus EXIT_SLACK_S. Processes still there
                (a rank gets EXIT_GRACE_S after mpirun returned, to finish its
                own exit) are killed and reported as left behind;
  * no leaks -- no /dev/shm segment created by a rank's pid
                (cc/transport/shm_group.h: /nvgroup.<pid>.*) left once the
                campaign's last job swept them (a killed creator's segment
                lasts until the next setup on the host removes it: Note [No
                segment left behind]), no listening TCP socket of a rank still
                alive, no stray file beside the checkpoint once the next
                save of it ran (a writer killed in a save leaves its
                temporary file; the next save on the host removes it);
  * checkpoint -- Keras fit's model.keras (saved before training and by
                ModelCheckpoint every epoch on rank 0) loads with
                keras.models.load_model after the trial: the old file or the
                new one, never a torn one.

A trial whose victim finished before its fault fired must end cleanly (exit
0, every rank DONE). Output: a JSON report (and a histogram PNG beside it when
matplotlib is there) with machine, date and commit.
"""
import argparse
import concurrent.futures
import glob
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests"))
from mpi_util import MPI_ENV  # noqa: E402

WORKER = os.path.join(HERE, "workers", "campaign_worker.py")
TIMEOUT_S = 5.0     # NVGROUP_TIMEOUT of the campaign's jobs
INIT_TIMEOUT_S = 20.0  # their NVGROUP_INIT_TIMEOUT: above the ranks' skew in reaching init() (TF import)
INIT_GRACE_S = 5.0   # kInitWatchdogGraceS (cc/engine/init_watchdog.h)
EXIT_SLACK_S = 10.0  # detection (<= 1.2 s) plus the processes' exit under load
EXIT_GRACE_S = 2.0   # a rank's own exit after mpirun returned
START_LIMIT_S = 400  # a job that never reaches its fault (imports under load) is cut here
PATHS = ["keras_fit", "tape", "xla", "collectives", "process_sets", "elastic", "engine"]
PHASES = ["init", "train", "checkpoint", "shutdown"]
# Seconds after the phase starts at which the victim fires: init() takes a
# fraction of a second here, a checkpoint save of the tiny model tens of ms.
DELAYS = {"init": (0.0, 0.6), "train": (0.0, 1.5), "checkpoint": (0.0, 0.08), "shutdown": (0.0, 0.05)}


def plan(seed, trials, max_ranks=4):
    """The trial specs, deterministic from `seed`."""
    rng = random.Random(seed)
    out = []
    for i in range(trials):
        # Every path in turn; two kills for one stop; Keras fit cycles through
        # all phases (the checkpoint save is its own), the others draw theirs.
        path = PATHS[i % len(PATHS)]
        if path == "keras_fit":
            phase = PHASES[(i // len(PATHS)) % len(PHASES)]
        else:
            phase = rng.choice([p for p in PHASES if p != "checkpoint"])
        fault = "stop" if i % 3 == 2 else "kill"
        np_ = rng.randint(2, max_ranks)
        victim = 0 if phase == "checkpoint" else rng.randrange(np_)
        lo, hi = DELAYS[phase]
        out.append({"index": i, "path": path, "phase": phase, "fault": fault, "np": np_, "victim": victim,
                    "delay_s": round(rng.uniform(lo, hi), 3)})
    return out


def bound_s(spec):
    """Seconds from the fault by which every rank must be gone."""
    if spec["phase"] == "init":
        return INIT_TIMEOUT_S + INIT_GRACE_S + EXIT_SLACK_S
    return TIMEOUT_S + EXIT_SLACK_S


def _alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _listening_inodes():
    """inode -> "addr:port" of every LISTEN TCP socket (IPv4 and IPv6)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A":  # TCP_LISTEN
                        out[fields[9]] = fields[1]
        except OSError:
            pass
    return out


def _sockets_of(pid, listening):
    found = []
    for fd in glob.glob("/proc/%d/fd/*" % pid):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        m = re.match(r"socket:\[(\d+)\]", target)
        if m and m.group(1) in listening:
            found.append(listening[m.group(1)])
    return found


def _records(record_dir):
    by_pid = {}
    for f in glob.glob(os.path.join(record_dir, "*.log")):
        pid = int(os.path.basename(f)[:-4])
        with open(f) as fh:
            by_pid[pid] = fh.read().splitlines()
    return by_pid


def shm_of(pids):
    return sorted(os.path.basename(p) for pid in pids for p in glob.glob("/dev/shm/nvgroup.%d.*" % pid))


INIT_LINE = re.compile(r"^\[nvgroup rank [^\]]*\] ERROR: (nvgroup_tf\.init|add_process_set) (was stuck|ended by SIGTERM).*$",
                       flags=re.MULTILINE)


def _init_line(record_dir, pid):
    """(time, text) of init()'s own last words in the rank's stderr, or None.
    The time is the file's last write (the line is the last thing written)."""
    path = os.path.join(record_dir, "%d.stderr" % pid) if pid else None
    if not path or not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        m = INIT_LINE.search(f.read())
    return (os.path.getmtime(path), m.group(0)[:700]) if m else None


def names_rank(text, rank):
    """Whether an error text names `rank`: "rank 1" as words, as the engine's
    messages write it ("rank 1 (host h, pid p) has sent no heartbeat", "group
    ranks 1 (rank 1) did not arrive"), not "rank 10"."""
    return re.search(r"\brank %d\b" % rank, text) is not None


def run_trial(spec, workdir):
    """Runs one trial; returns its spec with the observations and verdict."""
    record_dir = os.path.join(workdir, "trial%03d" % spec["index"])
    shutil.rmtree(record_dir, ignore_errors=True)
    os.makedirs(os.path.join(record_dir, "ckpt"))
    env = dict(os.environ)
    env.update(MPI_ENV)
    env.update({"NVGROUP_TIMEOUT": str(TIMEOUT_S), "NVGROUP_INIT_TIMEOUT": str(INIT_TIMEOUT_S),
                "OMPI_MCA_mpi_yield_when_idle": "1",
                "PYTHONPATH": REPO + os.pathsep + os.path.join(HERE, "workers")})
    cmd = ["mpirun", "-np", str(spec["np"]), "--bind-to", "none", sys.executable, WORKER, spec["path"],
           spec["phase"], spec["fault"], str(spec["victim"]), str(spec["delay_s"]), record_dir]
    log = open(os.path.join(record_dir, "mpirun.out"), "w")
    started = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    fault_at = None
    hung = False
    while proc.poll() is None:
        time.sleep(0.2)
        if fault_at is None:
            for lines in _records(record_dir).values():
                for line in lines:
                    if line.startswith("FAULT "):
                        fault_at = float(line.split()[2])
        now = time.time()
        limit = fault_at + bound_s(spec) if fault_at is not None else started + START_LIMIT_S
        if now > limit:
            hung = True
            break
    ended = time.time()
    records = _records(record_dir)
    pids = {}
    for pid, lines in records.items():
        for line in lines:
            if line.startswith("START "):
                pids[int(line.split()[1])] = pid
    # A rank mpirun ended may still be on its way out when mpirun returns:
    # it has EXIT_GRACE_S to be gone (within the bound: mpirun returned).
    if not hung:
        deadline = time.time() + EXIT_GRACE_S
        while time.time() < deadline and any(_alive(pid) for pid in pids.values()):
            time.sleep(0.1)
    listening = _listening_inodes()
    left = []
    for rank, pid in sorted(pids.items()):
        if _alive(pid):
            left.append({"rank": rank, "pid": pid, "listening": _sockets_of(pid, listening)})
    if proc.poll() is None:
        left.append({"rank": "mpirun", "pid": proc.pid, "listening": []})
    for item in left:  # where a rank is stuck (workers dump their Python stacks on SIGUSR1)
        if item["rank"] != "mpirun" and item["rank"] != spec["victim"]:
            try:
                os.kill(item["pid"], signal.SIGUSR1)
            except OSError:
                pass
    if left:
        time.sleep(1.0)
    for item in left:  # nothing stays behind the campaign
        stack = os.path.join(record_dir, "%d.stack" % item["pid"])
        if os.path.exists(stack):
            with open(stack) as f:
                item["stack"] = f.read()[-3000:]
        try:
            os.kill(item["pid"], signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()
    log.close()
    with open(os.path.join(record_dir, "mpirun.out"), errors="replace") as f:
        mpirun_out = f.read()
    # A killed rank's shared-memory names stay in /dev/shm until the next setup.
    shm = shm_of(pids.values())
    ckpt_dir = os.path.join(record_dir, "ckpt")
    stray = sorted(f for f in os.listdir(ckpt_dir) if f != "model.keras")

    victim_pid = pids.get(spec["victim"])
    fault_line = next((line for line in records.get(victim_pid, []) if line.startswith("FAULT ")), None)
    result = dict(spec)
    result.update({"pids": sorted(pids.values()), "returncode": proc.returncode, "seconds": round(ended - started, 2), "hung": hung,
                   "left_behind": left, "shm_left": shm, "stray_files": stray, "ckpt_dir": ckpt_dir,
                   "fault_delivered": bool(fault_line),
                   "fault_phase_seen": fault_line.split()[3] if fault_line else None, "survivors": []})
    if fault_line:
        t_fault = float(fault_line.split()[2])
        mpirun_names_victim = ("process rank %d with PID" % spec["victim"]) in mpirun_out
        result["gone_after_s"] = round(ended - t_fault, 2)
        for rank in range(spec["np"]):
            if rank == spec["victim"]:
                continue
            lines = records.get(pids.get(rank), [])
            err = next((line for line in lines if line.startswith("ERROR ")), None)
            done = next((line for line in lines if line.startswith("DONE ")), None)
            ended = _init_line(record_dir, pids.get(rank))
            s = {"rank": rank}
            if err:
                t_err = float(err.split()[1])
                s.update({"outcome": "error", "after_s": round(t_err - t_fault, 3), "message": err[-700:],
                          "names_victim": names_rank(err, spec["victim"])})
            elif done:
                s.update({"outcome": "done", "after_s": round(float(done.split()[1]) - t_fault, 3)})
            elif ended:
                # Ended inside init(): its line names the phase; mpirun's names a dead rank.
                s.update({"outcome": "ended in init", "after_s": round(ended[0] - t_fault, 3), "message": ended[1],
                          "names_victim": names_rank(ended[1], spec["victim"]) or mpirun_names_victim})
            else:
                # Ended without a word of its own: mpirun's SIGTERM reached it
                # before its program was inside init() (still importing), or
                # its SIGKILL came before the SIGTERM handler ran. Only
                # mpirun's message can name the dead rank then.
                s.update({"outcome": "ended by mpirun", "reached_init": any(
                    line.startswith("PHASE init ") for line in lines), "names_victim": mpirun_names_victim})
            result["survivors"].append(s)
    else:
        result["clean"] = proc.returncode == 0 and all(
            any(line.startswith("DONE ") for line in lines) for lines in records.values()) and \
            len(records) == spec["np"]
    result["checkpoint"] = os.path.join(record_dir, "ckpt", "model.keras") if spec["path"] == "keras_fit" else None
    result["verdict"] = verdict(result)
    return result


def verdict(r):
    """Which promises the trial broke ([] when none)."""
    broken = []
    if r["hung"]:
        broken.append("hang: the job was still running %.0f s after the fault" % bound_s(r))
    if r["left_behind"]:
        broken.append("left behind: %s" % ", ".join("%s (pid %d)" % (x["rank"], x["pid"]) for x in r["left_behind"]))
    if r.get("shm_after_sweep"):
        broken.append("shared memory left: %s" % ", ".join(r["shm_after_sweep"]))
    stray = r.get("stray_after_next_save", r["stray_files"])
    if stray:
        broken.append("stray files: %s" % ", ".join(stray))
    if r.get("checkpoint_loads") not in (None, "ok", "none written"):
        broken.append("torn checkpoint: %s" % r["checkpoint_loads"][:300])
    if not r["fault_delivered"]:
        if not r.get("clean"):
            broken.append("no fault fired, yet the job did not end cleanly (rc %s)" % r["returncode"])
        return broken
    for s in r["survivors"]:
        if s["outcome"] == "done":
            continue  # it had finished its program when the fault came
        if s["outcome"] == "ended by mpirun":
            # Before the liveness monitor exists (init) only mpirun sees a
            # death, and its message is the one that names it; later the
            # survivor's own error must.
            if r["phase"] != "init" or not s["names_victim"]:
                broken.append("rank %d ended without an error naming rank %d" % (s["rank"], r["victim"]))
            continue
        elif s["outcome"] == "ended in init" and r["phase"] != "init":
            broken.append("rank %d was ended in init() by a fault of phase %s: %s" % (s["rank"], r["phase"], s["message"]))
        elif s["outcome"] == "error" and not s["names_victim"]:
            broken.append("rank %d's error does not name rank %d: %s" % (s["rank"], r["victim"], s["message"]))
        elif s["after_s"] > bound_s(r):
            broken.append("rank %d named rank %d after %.1f s" % (s["rank"], r["victim"], s["after_s"]))
    return broken


def check_checkpoints(results):
    """Loads every Keras fit checkpoint in one process; marks the torn ones."""
    for r in results:  # the fault came before rank 0's first save: nothing to tear
        if r.get("checkpoint") and not os.path.exists(r["checkpoint"]):
            r["checkpoint_loads"] = "none written"
            r["checkpoint"] = None
    paths = [r["checkpoint"] for r in results if r.get("checkpoint")]
    if not paths:
        return
    code = ("import json, sys, os\nos.environ['TF_CPP_MIN_LOG_LEVEL'] = '2'\nimport keras\nout = {}\n"
            "for p in sys.argv[1:]:\n    try:\n        keras.models.load_model(p, compile=False)\n"
            "        out[p] = 'ok'\n    except Exception as e:\n        out[p] = '%s: %s' % (type(e).__name__, e)\n"
            "print('CHECKPOINTS ' + json.dumps(out))\n")
    p = subprocess.run([sys.executable, "-c", code] + paths, capture_output=True, text=True, timeout=600)
    m = re.search(r"^CHECKPOINTS (.*)$", p.stdout, flags=re.MULTILINE)
    loaded = json.loads(m.group(1)) if m else {}
    for r in results:
        if r.get("checkpoint"):
            r["checkpoint_loads"] = loaded.get(r["checkpoint"], "not checked: " + p.stderr[-300:])
            r["verdict"] = verdict(r)


def save_again_and_recheck(results):
    """A writer killed in a save leaves its temporary file; the next save of
    that file on the host removes it (nvgroup_tf/keras/compat.py,
    _saved_then_renamed). Where a trial left files beside its checkpoint, one
    process saves a small model there with nvgroup_tf.keras imported (as a
    resumed job's next ModelCheckpoint does), then the files are counted again."""
    dirs = sorted({r["ckpt_dir"] for r in results if r["stray_files"]})
    if not dirs:
        return
    code = ("import os, sys\nos.environ['TF_CPP_MIN_LOG_LEVEL'] = '2'\nimport keras\nimport nvgroup_tf.keras\n"
            "model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
            "for d in sys.argv[1:]:\n    model.save(os.path.join(d, 'model.keras'))\n")
    p = subprocess.run([sys.executable, "-c", code] + dirs, cwd=REPO, capture_output=True, text=True, timeout=600)
    for r in results:
        if r["stray_files"]:
            if p.returncode != 0:
                r["stray_after_next_save"] = r["stray_files"] + ["(the next save failed: %s)" % p.stderr[-300:]]
            else:
                r["stray_after_next_save"] = sorted(f for f in os.listdir(r["ckpt_dir"]) if f != "model.keras")
            r["verdict"] = verdict(r)


def summarize(results):
    ended = [s for r in results for s in r["survivors"] if s["outcome"] in ("error", "ended in init")]
    times = [s["after_s"] for s in ended]
    delivered = [r for r in results if r["fault_delivered"]]
    return {
        "trials": len(results),
        "faults_delivered": len(delivered),
        "bounded": sum(1 for r in results if not r["hung"] and not r["left_behind"]),
        "passed": sum(1 for r in results if not r["verdict"]),
        "time_to_error_s": {"count": len(times), "max": max(times) if times else None,
                            "median": statistics.median(times) if times else None},
        # How the survivors' errors named the cause: the lost rank (their
        # own error, or mpirun's message for a death in init()), or only the
        # phase of init() they were stuck in (a frozen rank).
        "survivors_naming_the_rank": sum(1 for s in ended if s["names_victim"]),
        "survivors_naming_the_init_phase_only": sum(1 for s in ended if not s["names_victim"]),
        "left_behind": sum(1 for r in results if r["left_behind"]),
        # Segments or files that outlive the campaign (listening sockets die
        # with their process: see each left-behind process's "listening");
        # segments seen right after a job and swept later are counted apart.
        "leaks": sum(1 for r in results
                     if r.get("shm_after_sweep") or r.get("stray_after_next_save", r["stray_files"])),
        "stray_removed_by_next_save": sum(1 for r in results
                                          if r["stray_files"] and not r.get("stray_after_next_save")),
        "shm_swept_later": sum(1 for r in results if r["shm_left"] and not r.get("shm_after_sweep")),
        "findings": [{"index": r["index"], "path": r["path"], "phase": r["phase"], "fault": r["fault"],
                      "np": r["np"], "victim": r["victim"], "delay_s": r["delay_s"], "broken": r["verdict"]}
                     for r in results if r["verdict"]],
    }


def machine():
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    # Tracked files changed since the commit: then the commit is not the code that ran.
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                             capture_output=True, text=True).stdout.split("\n")
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"host": platform.node(), "kind": "%d-core %s" % (os.cpu_count(), model), "cpus": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(), "commit": commit,
            "uncommitted_changes": [line for line in changed if line.strip()],
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def histogram(results, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ended = ("error", "ended in init")
    kill = [s["after_s"] for r in results if r["fault"] == "kill" for s in r["survivors"] if s["outcome"] in ended]
    stop = [s["after_s"] for r in results if r["fault"] == "stop" for s in r["survivors"] if s["outcome"] in ended]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist([kill, stop], bins=30, label=["SIGKILL", "SIGSTOP"], stacked=True)
    ax.axvline(TIMEOUT_S, color="k", linestyle="--", label="NVGROUP_TIMEOUT")
    ax.axvline(INIT_TIMEOUT_S + INIT_GRACE_S, color="r", linestyle=":", label="NVGROUP_INIT_TIMEOUT + watchdog grace")
    ax.set_xlabel("seconds from the fault to a survivor's error")
    ax.set_ylabel("survivors")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    return True


def sweep_and_recheck(results):
    """Runs one engine-only init() (its shared-memory setup sweeps the segments
    of dead creators), then records per trial the segments still there."""
    env = dict(os.environ)
    env.update(MPI_ENV)
    code = "import nvgroup_tf._engine as e; e.init(); e.shutdown(); e.finalize_mpi()"
    subprocess.run(["mpirun", "-np", "1", sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                   timeout=120)
    for r in results:
        r["shm_after_sweep"] = shm_of(r.get("pids", []))
        r["verdict"] = verdict(r)


def campaign(specs, workdir, progress=None, parallel=1):
    """Runs the trials, `parallel` at a time; results in the specs' order."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = [pool.submit(run_trial, spec, workdir) for spec in specs]
        for f in concurrent.futures.as_completed(futures):
            if progress:
                progress(f.result())
        results = [f.result() for f in futures]
    sweep_and_recheck(results)
    check_checkpoints(results)
    save_again_and_recheck(results)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-ranks", type=int, default=4)
    ap.add_argument("--parallel", type=int, default=1, help="trials at a time")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "fault_campaign.json"))
    ap.add_argument("--workdir", default=None, help="keep the trials' records here (default: a temporary dir)")
    ap.add_argument("--plot-from", default=None, help="only draw the histogram of an existing JSON report")
    args = ap.parse_args()
    if args.plot_from:
        with open(args.plot_from) as f:
            drawn = histogram(json.load(f)["trials"], os.path.splitext(args.plot_from)[0] + ".png")
        sys.exit(0 if drawn else "matplotlib is needed for the histogram")
    workdir = args.workdir or tempfile.mkdtemp(prefix="fault_campaign.")
    specs = plan(args.seed, args.trials, args.max_ranks)

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    done = []
    where = machine()  # the commit the campaign started from

    def write(results, complete):
        report = {"machine": where, "seed": args.seed, "trials_planned": len(specs), "complete": complete,
                  "parallel": args.parallel, "nvgroup_timeout_s": TIMEOUT_S, "bound_s": TIMEOUT_S + EXIT_SLACK_S,
                  "nvgroup_init_timeout_s": INIT_TIMEOUT_S,
                  "init_bound_s": INIT_TIMEOUT_S + INIT_GRACE_S + EXIT_SLACK_S,
                  "summary": summarize(results), "trials": results}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        return report

    def progress(r):
        print("trial %d %s np=%d %s %s victim=%d delay=%.3f: %s" % (
            r["index"], r["path"], r["np"], r["phase"], r["fault"], r["victim"], r["delay_s"],
            "; ".join(r["verdict"]) or "ok"), flush=True)
        done.append(r)
        write(done, False)  # an interrupted campaign still leaves its trials

    results = campaign(specs, workdir, progress, args.parallel)
    report = write(results, True)
    png = os.path.splitext(args.out)[0] + ".png"
    histogram(results, png)
    print(json.dumps(report["summary"], indent=1))
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
