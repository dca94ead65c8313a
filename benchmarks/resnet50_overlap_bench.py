"""Bucket overlap of Keras ResNet-50 `fit` from the engine timeline.

Question: since the collective ops became stateful and run independently of
TF's automatic control dependencies (Note [Stateful ops] in nvgroup_tf/mpi_ops.py),
is each gradient bucket's collective still enqueued as soon as backprop has
produced its gradients, i.e. in flight while later layers' gradients are still
being computed, as with the old (not stateful) registration?

How it is measured
------------------
Driver (no MPI environment): for each repeat, for each variant (interleaved, so
load changes hit every variant alike) it launches
    mpirun -np 2 --bind-to none python <this file> --worker ...
with PYTHONPATH set to that variant's source tree. A worker trains
keras.applications.ResNet50 (random init, synthetic data, SGD momentum wrapped
in hvd.DistributedOptimizer, `model.fit`, verbose=0) at a small image size and
batch, starts the engine timeline (hvd.start_timeline, rank 0 writes it) after
the warm-up steps and stops it after the measured steps. A Keras callback
records the Python monotonic time at every batch begin/end; the engine
timeline's clock (steady_clock = CLOCK_MONOTONIC) is mapped onto it by
bracketing the start_timeline call (the offset's uncertainty, the call's
duration, is recorded).

From rank 0's timeline, per bucket (one grouped allreduce = one bucket; its
tensors are "<bucket op>[i]") and per step (k-th occurrence of a bucket name =
step k):
  enqueue  = QUEUE begin: the moment TF ran the op's kernel, i.e. when all of
             the bucket's gradients existed;
  start/end of its ALLREDUCE phase (after negotiation with rank 1).
Backprop end is taken as the step's last bucket enqueue: the last bucket holds
the first layers' gradients, the last ones backprop produces (the bucket order
is backprop order, nvgroup_tf/gradient_reducer.py). Per step the script reports
  * each bucket's enqueue time relative to the step's first and last enqueue
    (0 = first, 1 = last = backprop end) and to the batch begin;
  * buckets_started_before_backprop_end / _done_: how many buckets' collectives
    ran while gradients were still being produced;
  * overlap_fraction: the share of the step's collective time (union of the
    ALLREDUCE intervals) that lies before backprop end;
  * enqueued_after_previous_done: buckets whose enqueue came after the previous
    bucket's ALLREDUCE had ended by more than the engine's cycle time (what a
    chain of control edges between the collectives forces);
  * apply tail: last ALLREDUCE end -> batch end (optimizer apply + Keras).

Variants: LABEL=ROOT[:chained]. ROOT is a source tree with a built library.
":chained" is a control that shows what the measurement sees when the
collectives ARE serialised: the same tree with TF's
AutomaticControlDependencies.run_independently replaced by a no-op in the
worker, so the (stateful) collectives get chained in program order.

    python benchmarks/resnet50_overlap_bench.py \
        --variant current=. --variant old=../old-checkout --variant chained=.:chained \
        --repeats 3 --out benchmarks/results/resnet50_overlap_cpu_2rank

Writes OUT.json (every step of every run, per-variant summaries, machine, date,
commits, load averages) and OUT.png. Timings on a shared machine are noisy:
the structure (where the enqueues fall relative to backprop) is the result.
"""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))

sys.path.insert(0, os.path.join(REPO, "tests"))
from mpi_util import MPI_ENV  # noqa: E402  (the tests' Open MPI settings; PYTHONPATH is set per variant)


# ---------------------------------------------------------------- worker

def worker(args):
    import numpy as np
    import tensorflow as tf
    import keras

    from tensorflow.python.framework import auto_control_deps
    acd_class = auto_control_deps.AutomaticControlDependencies
    run_independently = acd_class.run_independently
    if args.chained:
        # Control variant: collectives stay stateful, but are no longer taken
        # out of automatic control dependencies, so TF chains them.
        acd_class.run_independently = lambda self, op: None

    import nvgroup_tf.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(2)

    keras.utils.set_random_seed(100 + rank)
    shape = (args.image_size, args.image_size, 3)
    rng = np.random.default_rng(rank)
    images = rng.uniform(0.0, 1.0, size=(args.batch_size,) + shape).astype(np.float32)
    labels = rng.integers(0, args.num_classes, size=(args.batch_size,)).astype(np.int32)
    dataset = tf.data.Dataset.from_tensors((images, labels)).repeat()

    model = keras.applications.ResNet50(weights=None, input_shape=shape, classes=args.num_classes)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9))
    # Backprop-end marker: a timestamp that runs once every gradient exists
    # (control dependencies on all of them), just before the gradients enter
    # DistributedOptimizer. It runs independently of automatic control
    # dependencies in every variant, so it neither waits for nor delays a
    # collective; its value goes to a variable the callback reads.
    with tf.device("/cpu:0"):
        backprop_end = tf.Variable(0.0, dtype=tf.float64, trainable=False)
    apply_gradients = opt.apply_gradients

    def marked_apply_gradients(grads_and_vars, *a, **k):
        grads_and_vars = list(grads_and_vars)
        with tf.control_dependencies([g for g, _ in grads_and_vars if g is not None]):
            stamp = tf.timestamp()
        acd = getattr(stamp.op.graph, "experimental_acd_manager", None)
        if acd is not None:
            run_independently(acd, stamp.op)
        backprop_end.assign(stamp)
        return apply_gradients(grads_and_vars, *a, **k)
    opt.apply_gradients = marked_apply_gradients
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")

    timeline = os.path.join(args.run_dir, "timeline.json")
    record = {"rank": rank, "size": size, "batch_begin": [], "batch_end": [], "backprop_end": [],
              "timeline": timeline}

    class Recorder(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch >= args.warmup_steps:
                record["batch_begin"].append(time.monotonic())

        def on_train_batch_end(self, batch, logs=None):
            if batch == args.warmup_steps - 1:
                t0 = time.monotonic()
                hvd.start_timeline(timeline)
                t1 = time.monotonic()
                record["timeline_started_between"] = [t0, t1]
            elif batch >= args.warmup_steps:
                record["batch_end"].append(time.monotonic())
                # tf.timestamp is wall-clock time: onto the monotonic clock.
                record["backprop_end"].append(float(backprop_end.numpy()) - time.time() + time.monotonic())
                if "loss" in (logs or {}):
                    record.setdefault("loss", []).append(float(logs["loss"]))

    # Horovod's callback: the ranks start from the same weights.
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), Recorder()]
    model.fit(dataset, epochs=1, steps_per_epoch=args.warmup_steps + args.steps, callbacks=callbacks,
              verbose=0, shuffle=False)
    hvd.stop_timeline()
    # What the collectives looked like in the traced train function (op type
    # and control inputs): shows whether they were chained.
    fn = getattr(model, "train_function", None)
    graph_info = describe_collectives(fn)
    record["graph"] = graph_info
    record["trainable_bytes"] = int(sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables))
    record["trainable_tensors"] = len(model.trainable_variables)
    with open(os.path.join(args.run_dir, "rank%d.json" % rank), "w") as f:
        json.dump(record, f)
    # No rank leaves before every rank has stopped its timeline: one rank's
    # shutdown (at exit) ends the engine loop on all ranks (as in Horovod).
    hvd.allreduce(np.float64(rank), name="overlap_bench.done").numpy()
    return 0


def tf_functions_in(obj, depth=0, seen=None):
    """The tf.function objects reachable through `obj`'s closures (Keras 3's
    train_function is a Python wrapper around them)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4:
        return []
    seen.add(id(obj))
    if hasattr(obj, "_list_all_concrete_functions"):
        return [obj]
    found = []
    for cell in getattr(obj, "__closure__", None) or ():
        try:
            found += tf_functions_in(cell.cell_contents, depth + 1, seen)
        except ValueError:  # empty cell
            pass
    return found


def describe_collectives(fn):
    """Counts the collective ops in the traced train function (and the
    functions it calls), how many have a control input from another
    collective (a chain), and how many are control outputs of their function."""
    info = {"collectives": 0, "with_control_input_from_a_collective": 0, "with_control_input_from_the_marker": 0,
            "in_control_outputs": 0, "types": set()}
    done = set()
    for function in tf_functions_in(fn):
        for concrete in function._list_all_concrete_functions():  # noqa: SLF001 -- tf.function internals
            for fdef in concrete.graph.as_graph_def().library.function:
                if fdef.signature.name in done:
                    continue
                done.add(fdef.signature.name)
                nodes = [n for n in fdef.node_def if n.op.startswith("Nvgroup")]
                names = {n.name for n in nodes}
                returned = set(fdef.control_ret.values())
                for n in nodes:
                    info["collectives"] += 1
                    info["types"].add(n.op)
                    controls = {i[1:].split(":")[0] for i in n.input if i.startswith("^")}
                    info["with_control_input_from_a_collective"] += bool(controls & names)
                    info["with_control_input_from_the_marker"] += any(c.startswith("Timestamp") for c in controls)
                    info["in_control_outputs"] += n.name in returned
    info["types"] = sorted(info["types"])
    info["functions_inspected"] = len(done)
    return info


# ---------------------------------------------------------------- analysis

BUCKET_TENSOR = re.compile(r"^(.*)\[(\d+)\]$")


def load_timeline(path):
    """{tensor row name: {phase: [(B ts, E ts), ...]}} in seconds."""
    with open(path) as f:
        text = f.read().strip()
    if not text.endswith("]"):  # tolerate an unclosed file
        text = text.rstrip(",\n") + "]"
    events = json.loads(text)
    rows = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            rows[e["tid"]] = e["args"]["name"]
    open_ = {}
    phases = {}
    for e in events:
        if e.get("ph") not in ("B", "E"):
            continue
        row = rows.get(e["tid"])
        key = (row, e["name"])
        if e["ph"] == "B":
            open_[key] = e["ts"] * 1e-6
        elif key in open_:
            phases.setdefault(row, {}).setdefault(e["name"], []).append((open_.pop(key), e["ts"] * 1e-6))
    return phases


def union_length(intervals, upto=None):
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if upto is not None:
            e = min(e, upto)
            if e <= s:
                continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def analyse_run(run_dir, cycle_time_s):
    rank0 = json.load(open(os.path.join(run_dir, "rank0.json")))
    phases = load_timeline(rank0["timeline"])
    t0, t1 = rank0["timeline_started_between"]
    offset = 0.5 * (t0 + t1)  # timeline ts 0 = engine clock at open, within [t0, t1]
    # One bucket = all rows "<op>[i]" of one grouped allreduce.
    buckets = {}
    for row, ph in phases.items():
        m = BUCKET_TENSOR.match(row or "")
        if not m or "QUEUE" not in ph or "_Allreduce" not in m.group(1):
            continue
        b = buckets.setdefault(m.group(1), {"tensors": 0, "enqueue": None, "start": None, "end": None})
        b["tensors"] += 1
        # Per step: earliest enqueue / start, latest end over the bucket's tensors.
        for key, phase, pick, idx in (("enqueue", "QUEUE", min, 0), ("start", "ALLREDUCE", min, 0),
                                      ("end", "ALLREDUCE", max, 1)):
            vals = [iv[idx] for iv in ph.get(phase, [])]
            if b[key] is None:
                b[key] = vals
            else:
                b[key] = [pick(a, v) for a, v in zip(b[key], vals)]
    if not buckets:
        raise RuntimeError("%s: no bucket collectives in the timeline" % run_dir)
    steps = min(len(b["enqueue"]) for b in buckets.values())
    steps = min(steps, len(rank0["batch_begin"]), len(rank0["batch_end"]))
    out = []
    # Bucket i = the i-th bucket DistributedOptimizer built (backprop order).
    def bucket_index(name):
        m = re.search(r"nvg_grad_bucket_(\d+)_", name)
        return int(m.group(1)) if m else name
    order = sorted(buckets, key=bucket_index)
    for k in range(steps):
        enq = [buckets[n]["enqueue"][k] for n in order]
        start = [buckets[n]["start"][k] for n in order]
        end = [buckets[n]["end"][k] for n in order]
        first, last = min(enq), max(enq)
        begin = rank0["batch_begin"][k] - offset
        batch_end = rank0["batch_end"][k] - offset
        bp_end = rank0["backprop_end"][k] - offset
        span = max(bp_end - first, 1e-9)
        comm = union_length(list(zip(start, end)))
        hidden = union_length(list(zip(start, end)), upto=bp_end)
        out.append({
            "step": k,
            "step_time_s": batch_end - begin,
            "backprop_end_from_batch_begin_s": bp_end - begin,
            "first_enqueue_from_batch_begin_s": first - begin,
            "first_enqueue_to_backprop_end_s": bp_end - first,
            "last_enqueue_after_backprop_end_s": last - bp_end,
            "last_allreduce_end_to_batch_end_s": batch_end - max(end),
            "buckets": len(order),
            "enqueue_order": sorted(range(len(enq)), key=lambda i: enq[i]),
            "enqueue_rel_first_to_backprop_end": [(e - first) / span for e in enq],
            "enqueue_from_batch_begin_s": [e - begin for e in enq],
            "allreduce_start_from_batch_begin_s": [x - begin for x in start],
            "allreduce_end_from_batch_begin_s": [x - begin for x in end],
            "buckets_enqueued_before_backprop_end": sum(1 for e in enq if e < bp_end),
            "buckets_started_before_backprop_end": sum(1 for x in start if x < bp_end),
            "buckets_done_before_backprop_end": sum(1 for x in end if x < bp_end),
            "collective_time_s": comm,
            "overlap_fraction": hidden / comm if comm > 0 else 0.0,
            "enqueued_after_previous_done": sum(1 for i in range(1, len(enq))
                                                if enq[i] > end[i - 1] + cycle_time_s),
        })
    bucket_sizes = {n: buckets[n]["tensors"] for n in buckets}
    return {"steps": out, "bucket_tensors": bucket_sizes, "clock_offset_uncertainty_s": t1 - t0,
            "graph": rank0.get("graph"), "trainable_bytes": rank0.get("trainable_bytes"),
            "loss": rank0.get("loss")}


def summarise(runs):
    steps = [s for r in runs for s in r["steps"]]
    if not steps:
        return {}
    n = len(steps)

    def mean(key):
        return sum(s[key] for s in steps) / n

    def median(key):
        v = sorted(s[key] for s in steps)
        return v[n // 2]
    nb = steps[0]["buckets"]

    def enqueued_by_backprop_end(s, slack):
        return sum(1 for e in s["enqueue_from_batch_begin_s"] if e <= s["backprop_end_from_batch_begin_s"] + slack)
    rel = [sum(s["enqueue_rel_first_to_backprop_end"][i] for s in steps) / n for i in range(nb)]
    return {
        "steps_analysed": n,
        "buckets": nb,
        "step_time_s_median": median("step_time_s"),
        "first_enqueue_to_backprop_end_s_median": median("first_enqueue_to_backprop_end_s"),
        "last_enqueue_after_backprop_end_s_median": median("last_enqueue_after_backprop_end_s"),
        "overlap_fraction_mean": mean("overlap_fraction"),
        "overlap_fraction_min": min(s["overlap_fraction"] for s in steps),
        "overlap_fraction_max": max(s["overlap_fraction"] for s in steps),
        "buckets_enqueued_before_backprop_end_mean": mean("buckets_enqueued_before_backprop_end"),
        # The last bucket and the marker wait for the same last gradient: either may run first.
        "buckets_enqueued_by_backprop_end_plus_5ms_mean":
            sum(enqueued_by_backprop_end(s, 0.005) for s in steps) / n,
        "steps_all_buckets_enqueued_by_backprop_end_plus_5ms":
            sum(1 for s in steps if enqueued_by_backprop_end(s, 0.005) == nb),
        "last_enqueue_after_backprop_end_s_max": max(s["last_enqueue_after_backprop_end_s"] for s in steps),
        "buckets_started_before_backprop_end_mean": mean("buckets_started_before_backprop_end"),
        "buckets_done_before_backprop_end_mean": mean("buckets_done_before_backprop_end"),
        "enqueued_after_previous_done_mean": mean("enqueued_after_previous_done"),
        "steps_in_bucket_order": sum(1 for s in steps if s["enqueue_order"] == sorted(s["enqueue_order"])),
        "enqueue_rel_first_to_backprop_end_mean": rel,
        "collective_time_s_median": median("collective_time_s"),
        "apply_tail_s_median": median("last_allreduce_end_to_batch_end_s"),
        "graph": runs[0].get("graph"),
    }


# ---------------------------------------------------------------- driver

def git(root, *cmd):
    try:
        return subprocess.run(["git", "-C", root] + list(cmd), stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run_variant(label, root, chained, args, run_dir):
    env = dict(os.environ)
    env.update(MPI_ENV)
    env["PYTHONPATH"] = root
    cmd = ["mpirun", "-np", "2", "--bind-to", "none", sys.executable, HERE, "--worker",
           "--run-dir", run_dir, "--image-size", str(args.image_size), "--batch-size", str(args.batch_size),
           "--num-classes", str(args.num_classes), "--steps", str(args.steps),
           "--warmup-steps", str(args.warmup_steps), "--intra-op-threads", str(args.intra_op_threads)]
    if chained:
        cmd.append("--chained")
    load_before = os.getloadavg()
    t = time.time()
    proc = subprocess.run(cmd, env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=args.timeout)
    wall = time.time() - t
    with open(os.path.join(run_dir, "output.txt"), "w") as f:
        f.write(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError("variant %s failed (rc %d):\n%s" % (label, proc.returncode, proc.stdout[-5000:]))
    return {"load_average_before": load_before, "load_average_after": os.getloadavg(), "wall_s": wall}


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    variants = list(result["variants"])
    fig, axes = plt.subplots(1, len(variants), figsize=(5.2 * len(variants), 4.2), sharey=True, squeeze=False)
    for ax, label in zip(axes[0], variants):
        runs = result["variants"][label]["runs"]
        # One representative step: the median-step-time step of the first run.
        steps = sorted(runs[0]["steps"], key=lambda s: s["step_time_s"])
        s = steps[len(steps) // 2]
        nb = s["buckets"]
        for i in range(nb):
            ax.barh(i, s["allreduce_end_from_batch_begin_s"][i] - s["allreduce_start_from_batch_begin_s"][i],
                    left=s["allreduce_start_from_batch_begin_s"][i], color="tab:orange", height=0.5)
            ax.plot(s["enqueue_from_batch_begin_s"][i], i, "k|", markersize=14)
        ax.axvline(s["backprop_end_from_batch_begin_s"], color="tab:red", ls="--",
                   label="backprop end (all gradients exist)")
        ax.axvline(s["step_time_s"], color="gray", ls="-", label="batch end")
        summ = result["variants"][label]["summary"]
        ax.set_title("%s: median step shown (%.2f s)\nover %d steps: %.1f of %d buckets enqueued by backprop end"
                     " (+5 ms),\nlast enqueue %+.3f s after it (median), overlap fraction %.2f (mean)"
                     % (label, s["step_time_s"], summ["steps_analysed"],
                        summ["buckets_enqueued_by_backprop_end_plus_5ms_mean"], nb,
                        summ["last_enqueue_after_backprop_end_s_median"], summ["overlap_fraction_mean"]),
                     fontsize=8)
        ax.set_xlabel("s from batch begin (rank 0)")
        ax.set_yticks(range(nb))
        ax.set_yticklabels(["bucket %d" % i for i in range(nb)], fontsize=8)
        ax.invert_yaxis()
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=2)
    fig.suptitle("ResNet-50 fit, 2 ranks CPU, %dx%d batch %d: bucket enqueue (|) and ALLREDUCE (bar)"
                 % (result["config"]["image_size"], result["config"]["image_size"],
                    result["config"]["batch_size"]), fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)


def driver(args):
    variants = []
    for spec in args.variant:
        label, _, rest = spec.partition("=")
        root, _, flag = rest.partition(":")
        if not label or not root or flag not in ("", "chained"):
            raise SystemExit("--variant LABEL=ROOT[:chained], got %r" % spec)
        root = os.path.abspath(root)
        variants.append((label, root, flag == "chained"))
    result = {
        "benchmark": "resnet50_overlap_bench",
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "processor": platform.processor(), "note": "shared machine (several engineers)"},
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "config": {"ranks": 2, "image_size": args.image_size, "batch_size": args.batch_size,
                   "num_classes": args.num_classes, "steps": args.steps, "warmup_steps": args.warmup_steps,
                   "intra_op_threads": args.intra_op_threads, "repeats": args.repeats,
                   "cycle_time_s_for_chain_test": args.cycle_time_ms * 1e-3},
        "variants": {},
    }
    for label, root, chained in variants:
        result["variants"][label] = {
            "root": root, "commit": git(root, "rev-parse", "HEAD"),
            "uncommitted_diff": git(root, "diff"), "chained_control": chained, "runs": []}
    work = tempfile.mkdtemp(prefix="overlap_bench_")
    for r in range(args.repeats):
        for label, root, chained in variants:
            run_dir = os.path.join(work, "%s_%d" % (label, r))
            os.makedirs(run_dir)
            info = run_variant(label, root, chained, args, run_dir)
            run = analyse_run(run_dir, args.cycle_time_ms * 1e-3)
            run.update(info)
            run["repeat"] = r
            result["variants"][label]["runs"].append(run)
            summ = summarise([run])
            print("repeat %d %-8s load %.1f  step %.2f s  first enqueue->backprop end %.2f s  overlap %.2f  "
                  "before backprop end: enqueued %.1f started %.1f done %.1f of %d  "
                  "enqueued after previous done %.1f  last enqueue %+.3f s after backprop end"
                  % (r, label, info["load_average_before"][0], summ["step_time_s_median"],
                     summ["first_enqueue_to_backprop_end_s_median"], summ["overlap_fraction_mean"],
                     summ["buckets_enqueued_before_backprop_end_mean"],
                     summ["buckets_started_before_backprop_end_mean"],
                     summ["buckets_done_before_backprop_end_mean"], summ["buckets"],
                     summ["enqueued_after_previous_done_mean"], summ["last_enqueue_after_backprop_end_s_median"]),
                  flush=True)
            print("    graph: %s" % json.dumps(run["graph"]), flush=True)
    for label in result["variants"]:
        result["variants"][label]["summary"] = summarise(result["variants"][label]["runs"])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out + ".png")
    print("wrote %s.json, %s.png (run directories in %s)" % (args.out, args.out, work))
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--chained", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--variant", action="append", default=[], help="LABEL=ROOT[:chained] (repeatable)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--steps", type=int, default=6, help="timeline-recorded steps per run")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--intra-op-threads", type=int, default=1)
    p.add_argument("--cycle-time-ms", type=float, default=5.0,
                   help="slack for 'enqueued after the previous bucket was done' (>= the engine cycle time)")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--resummarise", default=None, help="recompute summaries and PNG of an existing OUT.json")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "resnet50_overlap_cpu_2rank"))
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.resummarise:  # recompute the summaries and the plot of a written JSON
        with open(args.resummarise) as f:
            result = json.load(f)
        for label in result["variants"]:
            result["variants"][label]["summary"] = summarise(result["variants"][label]["runs"])
        with open(args.resummarise, "w") as f:
            json.dump(result, f, indent=1)
        plot(result, os.path.splitext(args.resummarise)[0] + ".png")
        return 0
    if not args.variant:
        args.variant = ["current=" + REPO]
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
