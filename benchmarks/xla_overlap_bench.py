"""How much gradient communication XLA hides behind backward: Keras ResNet-50
(or, with --model elementwise, a stack of elementwise layers) trained with
`jit_compile=True` and hvd.DistributedOptimizer, collectives
lowered as one custom call or as a start/done pair (ops/xla_ops.h
Note [Start and done]), with a simulated link delay per bucket.

Question: with the start/done pair, does backward work run while a bucket is
in flight, so that a slower link costs less step time than with the single
call (which makes XLA's stream wait for each bucket where it stands)?

How it is measured
------------------
Driver (no MPI environment): for each repeat, for each lowering (alternated, so
load changes hit both alike) it launches
    mpirun -np RANKS python <this file> --worker ...
with NVGROUP_XLA_START_DONE=1 (pair) or 0 (single call). A worker builds
keras.applications.ResNet50 (random init, synthetic data fixed per rank, SGD
momentum wrapped in hvd.DistributedOptimizer, compiled with XLA or as a graph),
warms up, then for ROUNDS rounds and for each delay D of --delays (in order)
sets the engine's simulated link delay (op_library.set_bucket_delay_for_testing:
every bucket's communicator stream is held D us after its data moved,
cc/engine/execution.cc DelayBucket), runs one untimed step and STEPS timed
`train_on_batch` steps (each returns the loss to the host: the step ended).
A step's time is that span / STEPS; per D the median over rounds, the maximum
over ranks. The engine counts the buckets the link delayed
(op_library.delayed_buckets_for_testing), read around the timed steps: the
link time the delay added to a step is that count per step times D (the
engine fuses collectives that arrive together into one bucket, so the HLO's
count of collectives is not it; it is reported beside). Per lowering the
script reports the step time at each D and
`exposed(D) = (step(D) - step(0)) / (delayed buckets per step * D)`: the share
of the added link time that the step pays (1 = none hidden, 0 = all hidden).
Lowerings: `pair` (NVGROUP_XLA_START_DONE=1) and `single` (=0) compile the
step with XLA; `graph` runs it as a TF graph without XLA (each bucket's ops
start as its gradients appear). --mixed trains in mixed_float16.

With --dump on the first launch of each lowering, XLA dumps its HLO
(XLA_FLAGS=--xla_dump_to, rank 0) and the driver reads the scheduled train-step
module (`*after_optimizations.txt`, ENTRY's instruction order is the schedule):
for every start/done pair, its positions and how many instructions of each
kind (fusions, cuDNN/cuBLAS calls, other calls) XLA scheduled between them:
backward work between a start and its done is communication that can overlap.

Not a test: nothing is asserted about speed. Writes JSON (+ PNG) with the
machine, date and commit.

    python benchmarks/xla_overlap_bench.py --ranks 2 --delays 0,500,2000 \
        --json overlap.json --png overlap.png --dump /tmp/hlo
"""
import argparse
import datetime
import glob
import json
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # this tree's nvgroup_tf, unless PYTHONPATH names another

# name -> (settings, jit_compile): the XLA start/done pair, the XLA single
# call, and the TF graph path (no XLA: each bucket's ops start as its
# gradients appear, ops/adapter.cc), its ops finishing on TF's stream (graph)
# or on the host (graph_host, NVGROUP_TF_CUDA_WAIT=host).
LOWERINGS = {"pair": ({"NVGROUP_XLA_START_DONE": "1"}, True),
             "single": ({"NVGROUP_XLA_START_DONE": "0"}, True),
             "graph": ({"NVGROUP_TF_CUDA_WAIT": "stream"}, False),
             "graph_host": ({"NVGROUP_TF_CUDA_WAIT": "host"}, False)}


# ---------------------------------------------------------------- HLO schedule

def _strip_type(rest):
    """`rest` = the text after '= ' of an HLO instruction; returns it without the
    leading shape (a tuple shape is parenthesized and may hold spaces)."""
    rest = rest.lstrip()
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            depth += c == "("
            depth -= c == ")"
            if depth == 0:
                return rest[i + 1:].lstrip()
        return ""
    space = rest.find(" ")
    return rest[space + 1:].lstrip() if space >= 0 else ""


INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
TARGET = re.compile(r'custom_call_target="([^"]+)"')
OPERAND = re.compile(r"%?([\w.\-]+)")


def entry_schedule(text):
    """ENTRY's instructions in order: (name, opcode, target, operand names)."""
    out = []
    inside = False
    for line in text.splitlines():
        if line.startswith("ENTRY "):
            inside = True
            continue
        if inside:
            if line.startswith("}"):
                break
            m = INSTRUCTION.match(line)
            if not m:
                continue
            name, rest = m.group(1), _strip_type(m.group(2))
            paren = rest.find("(")
            if paren < 0:
                continue
            opcode = rest[:paren].strip()
            # operands: up to the matching parenthesis
            depth, end = 0, len(rest)
            for i in range(paren, len(rest)):
                depth += rest[i] == "("
                depth -= rest[i] == ")"
                if depth == 0:
                    end = i
                    break
            operands = [o for o in OPERAND.findall(rest[paren + 1:end]) if not o[0].isdigit()]
            t = TARGET.search(rest)
            out.append((name, opcode, t.group(1) if t else "", operands))
    return out


def kind_of(opcode, target):
    if opcode == "custom-call":
        if "nvgroup" in target:
            return "nvgroup"
        if "cudnn" in target.lower():
            return "cudnn"
        if "cublas" in target.lower() or "gemm" in target.lower():
            return "cublas"
        return "custom-call"
    if opcode == "fusion":
        return "fusion"
    if opcode in ("call", "while", "conditional", "async-start", "async-done"):
        return "call"
    if opcode == "convolution":
        return "cudnn"
    return "other"


def schedule_summary(dump_dir):
    """The scheduled train-step module of an XLA dump: collectives and the work between each start/done."""
    best, best_count = None, 0
    for path in glob.glob(os.path.join(dump_dir, "**", "*after_optimizations.txt"), recursive=True):
        with open(path) as f:
            text = f.read()
        count = text.count('custom_call_target="nvgroup_collective')
        if count > best_count:
            best, best_count, best_text = path, count, text
    if best is None:
        return {"module": None, "error": "no module with an nvgroup collective in %s" % dump_dir}
    sched = entry_schedule(best_text)
    position = {name: i for i, (name, _, _, _) in enumerate(sched)}
    producer = {name: ops for name, opcode, _, ops in sched if opcode == "get-tuple-element"}
    starts = [i for i, s in enumerate(sched) if s[2] == "nvgroup_collective_start"]
    singles = [i for i, s in enumerate(sched) if s[2] == "nvgroup_collective"]
    dones = [i for i, s in enumerate(sched) if s[2] == "nvgroup_collective_done"]
    work_kinds = ("fusion", "cudnn", "cublas", "call", "custom-call")
    pairs = []
    for d in dones:
        start = None
        for o in sched[d][3]:
            src = producer.get(o, [o])[0] if o in producer else o
            if src in position and sched[position[src]][2] == "nvgroup_collective_start":
                start = position[src]
                break
        if start is None:
            pairs.append({"done": d, "start": None})
            continue
        between = {}
        for _, opcode, target, _ in sched[start + 1:d]:
            k = kind_of(opcode, target)
            between[k] = between.get(k, 0) + 1
        pairs.append({"start": start, "done": d, "between": between,
                      "work_between": sum(between.get(k, 0) for k in work_kinds)})
    total = {}
    for _, opcode, target, _ in sched:
        k = kind_of(opcode, target)
        total[k] = total.get(k, 0) + 1
    return {"module": os.path.basename(best), "instructions": len(sched), "kinds": total,
            "starts": starts, "dones": dones, "single_calls": singles, "pairs": pairs,
            "buckets": len(starts) + len(singles)}


# ---------------------------------------------------------------- worker

def elementwise_model(keras, layers, features):
    """`layers` layers of y = tanh(x * w + b), w and b of `features` elements
    each: a backward pass of elementwise kernels only, and two gradients per
    layer. It needs no cuBLAS, so TF's GPU build can run it without the kit's
    cuBLAS parts (../shared/tfgpu). The graph lowering needs no cuDNN either;
    XLA's GPU compiler opens cuDNN for any program ("DNN library
    initialization failed" without it), so the XLA lowerings need the cuDNN
    parts. It still gives backward work to hide communication behind."""

    class Elementwise(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1],), initializer="ones", name="w")
            self.b = self.add_weight(shape=(shape[-1],), initializer="zeros", name="b")

        def call(self, x):
            return keras.ops.tanh(x * self.w + self.b)

    inputs = keras.Input((features,))
    h = inputs
    for _ in range(layers):
        h = Elementwise()(h)
    return keras.Model(inputs, h)


def worker(args):
    if args.dump and os.environ.get("OMPI_COMM_WORLD_RANK", "0") == "0":  # rank 0 dumps
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_dump_to=%s --xla_dump_hlo_as_text" % args.dump).strip()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    import keras
    import nvgroup_tf as hvd
    from nvgroup_tf import op_library

    hvd.init()
    if hvd.size() == 1:  # one rank: the buckets still go through the engine (and the simulated link)
        from nvgroup_tf import gradient_reducer
        gradient_reducer.set_reduce_alone_for_testing(True)
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        gpu = gpus[hvd.local_rank() % len(gpus)]
        tf.config.set_visible_devices(gpu, "GPU")
        tf.config.set_logical_device_configuration(
            gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=args.gpu_memory_mb)])
    rng = np.random.default_rng(1234 + hvd.rank())
    keras.utils.set_random_seed(7)
    if args.mixed:
        keras.mixed_precision.set_global_policy("mixed_float16")
    if args.model == "resnet50":
        s = args.image_size
        x = rng.standard_normal((args.batch, s, s, 3)).astype("float32")
        y = rng.integers(0, 1000, size=(args.batch,)).astype("int32")
        model = keras.applications.ResNet50(weights=None, input_shape=(s, s, 3), classes=1000)
        loss = "sparse_categorical_crossentropy"
    else:
        x = rng.standard_normal((args.batch, args.features)).astype("float32")
        y = rng.standard_normal((args.batch, args.features)).astype("float32")
        model = elementwise_model(keras, args.layers, args.features)
        loss = "mean_squared_error"
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    if args.mixed:
        opt = keras.mixed_precision.LossScaleOptimizer(opt)
    opt = hvd.DistributedOptimizer(opt)
    model.compile(optimizer=opt, loss=loss, jit_compile=args.jit)
    x, y = tf.constant(x), tf.constant(y)
    for _ in range(args.warmup):
        model.train_on_batch(x, y)
    delays = [float(d) for d in args.delays.split(",")]
    per_delay = {d: [] for d in delays}
    delayed = {d: [] for d in delays}  # buckets the link delayed per timed step
    for _ in range(args.rounds):
        for d in delays:
            op_library.set_bucket_delay_for_testing(d)
            model.train_on_batch(x, y)
            before = op_library.delayed_buckets_for_testing()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                loss = model.train_on_batch(x, y)
            float(np.asarray(loss))
            per_delay[d].append((time.perf_counter() - t0) / args.steps)
            delayed[d].append((op_library.delayed_buckets_for_testing() - before) / args.steps)
    op_library.set_bucket_delay_for_testing(0)
    medians = np.array([float(np.median(per_delay[d])) for d in delays])
    worst = hvd.allreduce(tf.constant(medians), op=hvd.Max, name="xla_overlap/worst").numpy()
    record = {"rank": hvd.rank(), "size": hvd.size(), "delays_us": delays,
              "step_ms": [1e3 * v for v in worst.tolist()],
              "step_ms_rounds": {str(d): [1e3 * v for v in per_delay[d]] for d in delays},
              "delayed_buckets_per_step": [float(np.median(delayed[d])) for d in delays],
              "precision": "mixed_float16" if args.mixed else "float32", "jit_compile": args.jit,
              "devices": [d.name for d in tf.config.list_logical_devices()]}
    if hvd.rank() == 0:
        print("OVERLAP_RESULT " + json.dumps(record), flush=True)
    hvd.shutdown()


# ---------------------------------------------------------------- driver

def launch(args, lowering, dump):
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    settings, jit = LOWERINGS[lowering]
    env.update(settings)
    cmd = ["mpirun", "-np", str(args.ranks), "--bind-to", "none"]
    for k in sorted(env):
        if k.startswith(("NVGROUP_", "CUDA_", "LD_LIBRARY_PATH", "PYTHONPATH", "TF_", "XLA_")):
            cmd += ["-x", k]
    cmd += [sys.executable, os.path.abspath(__file__), "--worker", "--delays", args.delays,
            "--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--image-size", str(args.image_size), "--batch", str(args.batch), "--model", args.model,
            "--layers", str(args.layers), "--features", str(args.features),
            "--gpu-memory-mb", str(args.gpu_memory_mb)]
    if jit:
        cmd += ["--jit"]
    if args.mixed:
        cmd += ["--mixed"]
    if dump and jit:
        cmd += ["--dump", dump]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=args.launch_timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("OVERLAP_RESULT "):
            rec = json.loads(line[len("OVERLAP_RESULT "):])
            rec["wall_s"] = time.time() - t0
            return rec
    raise RuntimeError("%s launch failed (rc=%s):\n%s" % (lowering, proc.returncode, proc.stdout[-6000:]))


def machine():
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip().splitlines()
    except OSError:
        gpu = []
    return {"host": platform.node(), "cores": os.cpu_count(), "gpus": gpu,
            "load_average": os.getloadavg()}


def commit():
    if os.environ.get("NVG_COMMIT"):
        return os.environ["NVG_COMMIT"]
    from bench_common import commit as git_commit
    return git_commit()


def driver(args):
    lowerings = args.lowerings.split(",")
    runs = {name: [] for name in lowerings}
    schedules = {}
    for rep in range(args.repeats):
        for name in lowerings:
            dump = None
            if args.dump and rep == 0:
                dump = os.path.join(args.dump, name)
            rec = launch(args, name, dump)
            rec["load_average"] = os.getloadavg()
            runs[name].append(rec)
            if dump and LOWERINGS[name][1]:
                schedules[name] = schedule_summary(os.path.join(dump))
            print("%-6s repeat %d: step ms %s (load %.1f)" % (
                name, rep, " ".join("%.2f" % v for v in rec["step_ms"]), rec["load_average"][0]), flush=True)
    delays = [float(d) for d in args.delays.split(",")]
    summary = {}
    for name in lowerings:
        import statistics
        step = [statistics.median(r["step_ms"][i] for r in runs[name]) for i in range(len(delays))]
        hlo_collectives = schedules.get(name, {}).get("buckets")
        # the engine's own count: collectives that arrive together share a bucket
        delayed = [statistics.median(r["delayed_buckets_per_step"][i] for r in runs[name])
                   for i in range(len(delays))]
        exposed, added_ms, exposed_ms = [], [], []
        for i, d in enumerate(delays):
            added = delayed[i] * d / 1e3  # link time the delay added per step, ms
            added_ms.append(added)
            exposed_ms.append(step[i] - step[0])
            exposed.append((step[i] - step[0]) / added if d > 0 and added > 0 else None)
        summary[name] = {"step_ms": step, "exposed": exposed, "added_ms": added_ms, "exposed_ms": exposed_ms,
                         "delayed_buckets_per_step": delayed, "hlo_collectives": hlo_collectives}
    result = {"benchmark": "xla_overlap_bench", "commit": commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "ranks": args.ranks, "model": args.model, "image_size": args.image_size,
              "layers": args.layers, "features": args.features, "batch": args.batch,
              "steps": args.steps, "rounds": args.rounds, "repeats": args.repeats, "delays_us": delays,
              "precision": "mixed_float16" if args.mixed else "float32",
              "environment": {k: v for k, v in os.environ.items() if k.startswith(("NVGROUP_", "CUDA_MPS"))},
              "summary": summary, "schedules": schedules, "runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.png:
        from bench_common import pyplot, save_png
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in lowerings:
            ax.plot(delays, summary[name]["step_ms"], marker="o", label=name)
        ax.set_xlabel("simulated link delay per bucket (us)")
        ax.set_ylabel("step time (ms, median, max over ranks)")
        what = ("ResNet-50 %dpx" % args.image_size if args.model == "resnet50" else
                "%d elementwise layers x %d" % (args.layers, args.features))
        ax.set_title("%s b%d %s, %d ranks, %s" % (what, args.batch, result["precision"], args.ranks,
                                                 result["commit"][:8]), fontsize=9)
        ax.legend()
        save_png(fig, args.png)
    print("=== XLA overlap (%s, %d ranks, %s)" % (result["commit"][:10], args.ranks, machine()["gpus"]))
    print("delay_us  " + "  ".join("%10s" % n for n in lowerings) + "   (exposed = step(D) - step(0) over "
          "delayed buckets x D; buckets per step)")
    for i, d in enumerate(delays):
        print("%8.0f  " % d + "  ".join("%7.2f ms" % summary[n]["step_ms"][i] for n in lowerings) +
              "   exposed " + " ".join("%s=%s/%.1f" % (n, "%.2f" % summary[n]["exposed"][i]
                                                  if summary[n]["exposed"][i] is not None else "-",
                                                  summary[n]["delayed_buckets_per_step"][i])
                                       for n in lowerings))
    for name, sch in schedules.items():
        if sch.get("module") is None:
            print("%s schedule: %s" % (name, sch.get("error")))
            continue
        print("%s schedule: %s, %d instructions, %d starts, %d dones, %d single calls" % (
            name, sch["module"][:60], sch["instructions"], len(sch["starts"]), len(sch["dones"]),
            len(sch["single_calls"])))
        for p in sch["pairs"]:
            print("  start@%s done@%s work between %s %s" % (p.get("start"), p["done"], p.get("work_between"),
                                                          p.get("between", "")))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--lowerings", default="pair,single")
    p.add_argument("--delays", default="0,500,2000", help="simulated link delay per bucket, us")
    p.add_argument("--repeats", type=int, default=2, help="launches per lowering, alternated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--model", choices=["resnet50", "elementwise"], default="resnet50",
                   help="elementwise: --layers layers of tanh(x * w + b) over --features (no cuBLAS)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--features", type=int, default=1 << 20)
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--gpu-memory-mb", type=int, default=24000)
    p.add_argument("--jit", action="store_true", help="worker: compile the train step with XLA")
    p.add_argument("--mixed", action="store_true", help="mixed_float16 (a LossScaleOptimizer inside the wrapper)")
    p.add_argument("--launch-timeout", type=int, default=400)
    p.add_argument("--dump", default="", help="XLA dump folder (first launch of each lowering)")
    p.add_argument("--json", default="")
    p.add_argument("--png", default="")
    args = p.parse_args()
    if args.worker:
        from bench_common import run_worker
        run_worker(worker, args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
