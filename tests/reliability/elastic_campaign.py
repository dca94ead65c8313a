"""The fault campaign's elastic path: nvgrouprun's elastic mode
(nvgroup_tf/runner/elastic_driver.py) running workers/elastic_trainer.py on
2-3 ranks of this host, one worker SIGKILLed at a random point: in training,
inside a commit's file write, or during a relaunch's start-up.

    python tests/reliability/elastic_campaign.py --trials N [--seed S] \\
        [--out benchmarks/results/fault_campaign_elastic.json]

Verdict of a trial (its promises):
  * result  -- nvgrouprun exits 0 and every rank of the last launch ends with
               the final batch and the same weights (one model); or the
               driver exits with its own "nvgrouprun: error:" line;
  * bounded -- the job is over within BOUND_S of the start (the relaunch
               bound of MIGRATION.md's elastic section plus two start-ups of
               TensorFlow on this loaded machine);
  * no commit torn -- every relaunch resumes (a torn commit file would fail
               to unpickle and end the job with that error);
  * work lost -- at most one commit: the batch resumed from is at least the
               batch the victim was in, less one;
  * nothing left behind -- no process of the job, no commit directory, no
               /dev/shm segment of a rank's pid.
Figures: recovery time (the fault to the first rank of the next launch
resuming) and work lost (batches), median and max. Output: JSON (and a PNG
when matplotlib is there) with machine, date and commit.
"""
import argparse
import glob
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fault_campaign  # noqa: E402
from fault_campaign import MPI_ENV, REPO, machine, shm_of  # noqa: E402

TRAINER = os.path.join(HERE, "workers", "elastic_trainer.py")
LAUNCH = os.path.join(REPO, "nvgroup_tf", "runner", "launch.py")
STEPS = 120
BOUND_S = 300.0
PHASES = ["train", "commit", "relaunch"]
DELAYS = {"train": (0.2, 2.0), "commit": (0.0, 0.004), "relaunch": (0.0, 8.0)}


def plan(seed, trials):
    rng = random.Random(seed)
    out = []
    for i in range(trials):
        phase = PHASES[i % len(PHASES)]
        np_ = rng.choice([2, 3])
        victim = 0 if phase == "commit" else rng.randrange(np_)  # local rank 0 writes the commits
        out.append({"index": i, "phase": phase, "np": np_, "victim": victim,
                    "launch": 1 if phase == "relaunch" else 0,
                    "delay_s": round(rng.uniform(*DELAYS[phase]), 4)})
    return out


def _records(record_dir):
    out = {}
    for path in glob.glob(os.path.join(record_dir, "*.rec")):
        with open(path) as f:
            out[int(os.path.basename(path)[:-4])] = [line.split() for line in f]
    return out


def run_trial(spec, workdir):
    d = os.path.join(workdir, "elastic%03d" % spec["index"])
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(os.path.join(d, "rec"))
    os.makedirs(os.path.join(d, "commits"))
    script = os.path.join(d, "discover.sh")
    with open(script, "w") as f:
        f.write("#!/bin/sh\necho localhost:%d\n" % spec["np"])
    os.chmod(script, 0o755)
    env = dict(os.environ)
    env.update(MPI_ENV)
    env.update({"NVGROUP_TIMEOUT": "5", "OMPI_MCA_mpi_yield_when_idle": "1", "NVGROUP_ELASTIC_BASE":
                os.path.join(d, "commits"), "CAMPAIGN_FAULT": "%s %d %d %s" % (
                    spec["phase"], spec["launch"], spec["victim"], spec["delay_s"])})
    if spec["phase"] == "relaunch":  # a first failure (rank 1 in training) makes the relaunch
        env["CAMPAIGN_FIRST"] = "1"
    cmd = [sys.executable, LAUNCH, "-np", str(spec["np"]), "--min-np", str(spec["np"]),
           "--host-discovery-script", script, "--reset-limit", "4", "--elastic-timeout", "30",
           sys.executable, TRAINER, str(STEPS), os.path.join(d, "rec")]
    started = time.time()
    with open(os.path.join(d, "driver.out"), "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=d, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(BOUND_S)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
            os.killpg(proc.pid, 9)
            rc = proc.wait()
    seconds = time.time() - started
    with open(os.path.join(d, "driver.out"), errors="replace") as f:
        out = f.read()
    recs = _records(os.path.join(d, "rec"))
    time.sleep(1.0)
    left = [pid for pid in recs if fault_campaign._alive(pid)]
    for pid in left:
        os.kill(pid, 9)
    starts = {pid: (int(l[1]), int(l[2]), float(l[3])) for pid, ls in recs.items() for l in ls if l[0] == "START"}
    faults = [(float(l[1]), int(l[2])) for ls in recs.values() for l in ls
              if l[0] == "FAULT" and l[3] == spec["phase"]]
    resumes = sorted((starts[pid][1], float(l[1]), int(l[2])) for pid, ls in recs.items() for l in ls
                     if l[0] == "RESUMED")
    last = max((s[1] for s in starts.values()), default=0)
    results = [l for pid, ls in recs.items() if starts.get(pid, (0, -1))[1] == last for l in ls if l[0] == "RESULT"]
    r = dict(spec, returncode=rc, seconds=round(seconds, 2), hung=hung, left_behind=left,
             launches=last + 1, fault_delivered=bool(faults),
             commit_dirs_left=os.listdir(os.path.join(d, "commits")),
             shm_left=shm_of(list(recs)), driver_error=[l for l in out.splitlines() if "nvgrouprun: error:" in l])
    if faults:
        t_fault, batch = faults[0]
        after = [x for x in resumes if x[1] > t_fault]
        if after:
            r["recovery_s"] = round(after[0][1] - t_fault, 2)
            r["work_lost_batches"] = max(0, batch - after[0][2]) if batch >= 0 else 0
            r["resumed_batch"], r["fault_batch"] = after[0][2], batch
    r["result_ok"] = (rc == 0 and len(results) == int(results[0][3]) if results else False) and \
        all(l[1] == str(STEPS - 1) and l[2] == results[0][2] for l in results)
    r["verdict"] = verdict(r)
    return r


def verdict(r):
    broken = []
    if r["hung"]:
        broken.append("hang: still running after %.0f s" % BOUND_S)
    if r["left_behind"]:
        broken.append("left behind: pids %s" % r["left_behind"])
    if r["commit_dirs_left"]:
        broken.append("commit files left: %s" % r["commit_dirs_left"])
    if r["shm_left"]:
        broken.append("shared memory left: %s" % r["shm_left"])
    if not r["result_ok"] and not r["driver_error"]:
        broken.append("neither the result nor a driver error (rc %s)" % r["returncode"])
    if r["fault_delivered"] and "recovery_s" not in r and not r["driver_error"]:
        broken.append("no relaunch resumed after the fault")
    if r.get("fault_batch", -1) >= 0 and r["resumed_batch"] < r["fault_batch"] - 1:
        broken.append("work lost: resumed at batch %d, the fault came in batch %d"
                      % (r["resumed_batch"], r["fault_batch"]))
    return broken


def summarize(results):
    rec = [r["recovery_s"] for r in results if "recovery_s" in r]
    lost = [r["work_lost_batches"] for r in results if "work_lost_batches" in r]
    def stat(xs):
        return {"count": len(xs), "median": statistics.median(xs) if xs else None,
                "max": max(xs) if xs else None}

    return {"trials": len(results), "faults_delivered": sum(r["fault_delivered"] for r in results),
            "passed": sum(not r["verdict"] for r in results),
            "finished_with_the_result": sum(r["result_ok"] for r in results),
            "ended_with_a_driver_error": sum(bool(r["driver_error"]) for r in results),
            "bounded": sum(not r["hung"] for r in results), "recovery_s": stat(rec),
            "work_lost_batches": stat(lost), "commit_interval_batches": 1,
            "findings": [{"index": r["index"], "broken": r["verdict"]} for r in results if r["verdict"]]}


def histogram(results, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for phase in PHASES:
        xs = [r["recovery_s"] for r in results if r["phase"] == phase and "recovery_s" in r]
        ax.scatter(xs, [phase] * len(xs), label=phase)
    ax.set_xlabel("seconds from the worker's SIGKILL to the relaunched job resuming")
    ax.set_title("nvgrouprun elastic: recovery time per trial")
    fig.tight_layout()
    fig.savefig(png)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "fault_campaign_elastic.json"))
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="elastic_campaign.")
    where = machine()
    results = []
    for spec in plan(args.seed, args.trials):
        results.append(run_trial(spec, workdir))
        r = results[-1]
        print("trial %d %s np=%d victim=%d delay=%.4f: %.1fs recovery %s lost %s: %s" % (
            r["index"], r["phase"], r["np"], r["victim"], r["delay_s"], r["seconds"], r.get("recovery_s"),
            r.get("work_lost_batches"), "; ".join(r["verdict"]) or "ok"), flush=True)
        report = {"machine": where, "seed": args.seed, "steps": STEPS, "bound_s": BOUND_S,
                  "summary": summarize(results), "trials": results}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    histogram(results, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps(report["summary"], indent=1))
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
