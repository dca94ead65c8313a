"""XLA lowering measurements (docs/XLA.md).

    python scripts/xla_bench.py [--ranks 2] [--repeats 3] [--out benchmarks/results/xla_cpu]

launches, for each repeat and each mode (modes interleaved, so load on a shared
machine hits all alike), `mpirun -np RANKS python scripts/xla_bench.py MODE
FILE`, then writes the medians to OUT.json and OUT.png. Workloads:

  overlap  a chain of K dense layers (compute) where the output of layer k is
           allreduced (a "gradient bucket") while layer k+1 computes; the sum
           of all reduced buckets is returned. Step time in ms; "nocomm" is the
           same chain with `h * 2` in place of each allreduce (the compute alone).
  fit      Keras fit of a small conv net with DistributedOptimizer, img/s per rank.

Modes: "sync" (jit_compile=True, one custom call per collective that waits for
the engine, NVGROUP_XLA_START_DONE=0), "pair" (jit_compile=True, a start and a
done custom call per collective, NVGROUP_XLA_START_DONE=1), "async"
(jit_compile=True, NVGROUP_XLA_ASYNC=1: the handler returns a future), "tf"
(jit_compile=False: TF's executor and the AsyncOpKernels), "autocluster"
(jit_compile=False with tf.config.optimizer.set_jit("autoclustering") and, on
CPU, TF_XLA_FLAGS=--tf_xla_cpu_global_jit; fit only). NVGROUP_XLA_ASYNC and
NVGROUP_XLA_START_DONE are read once per process, hence one launch per mode.
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import nvgroup_tf as hvd  # noqa: E402


def timed(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    hvd.allreduce(tf.ones([1]), name="bench.barrier")
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def overlap(jit, comm=True, k=8, width=512, batch=256, iters=20):
    rng = np.random.default_rng(hvd.rank())
    ws = [tf.constant((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32))
          for _ in range(k)]
    x = tf.constant(rng.standard_normal((batch, width)).astype(np.float32))

    def step(x):
        h, total = x, tf.zeros([], tf.float32)
        for i in range(k):
            h = tf.tanh(tf.matmul(h, ws[i]))
            reduced = hvd.allreduce(h, op=hvd.Sum, name="bench.bucket%d" % i) if comm else h * 2.0
            total += tf.reduce_sum(reduced)
        return h, total

    fn = tf.function(step, jit_compile=jit)
    return timed(lambda: [t.numpy() for t in fn(x)], 3, iters)


def fit(jit, steps=20, batch=32):
    import keras
    import nvgroup_tf.keras as hvdk
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10)])
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
    rng = np.random.default_rng(hvd.rank())
    x = rng.standard_normal((batch * steps, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, size=(batch * steps,))
    model.fit(x[:batch * 2], y[:batch * 2], batch_size=batch, epochs=1, verbose=0)  # compile
    hvd.allreduce(tf.ones([1]), name="bench.fit_barrier")
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    return batch * steps / (time.perf_counter() - start)  # images/s per rank


MODES = ["sync", "pair", "async", "tf", "autocluster"]


def drive(argv):
    import argparse
    import statistics
    import subprocess
    import datetime
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/xla_cpu")
    args = ap.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = {m: [] for m in MODES}
    for rep in range(args.repeats):
        for mode in MODES:
            env = dict(os.environ, PYTHONPATH=root, NVGROUP_XLA_ASYNC="1" if mode == "async" else "0",
                       NVGROUP_XLA_START_DONE="1" if mode == "pair" else "0")
            if mode == "autocluster":
                env["TF_XLA_FLAGS"] = (env.get("TF_XLA_FLAGS", "") + " --tf_xla_cpu_global_jit").strip()
            tmp = "%s.%s.%d.json" % (args.out, mode, rep)
            cmd = ["mpirun", "-np", str(args.ranks), "--bind-to", "none", "--oversubscribe",
                   "-x", "PYTHONPATH", "-x", "NVGROUP_XLA_ASYNC", "-x", "NVGROUP_XLA_START_DONE", "-x", "TF_XLA_FLAGS",
                   sys.executable, os.path.abspath(__file__), mode, tmp]
            env.setdefault("TF_XLA_FLAGS", "")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            subprocess.run(cmd, env=env, check=True, cwd=root)
            with open(tmp) as f:
                runs[mode].append(json.load(f))
            os.remove(tmp)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=root).stdout.strip()
    table = {"machine": os.uname().nodename + ", %d CPUs (shared)" % os.cpu_count(),
             "date": datetime.date.today().isoformat(), "commit": commit, "ranks": args.ranks,
             "repeats": args.repeats, "modes": {}}
    for mode, rs in runs.items():
        med = {}
        for key in ("overlap_step_ms", "overlap_nocomm_step_ms", "fit_img_per_s_per_rank"):
            vals = [r[key] for r in rs if r[key] is not None]
            med[key] = statistics.median(vals) if vals else None
            med[key + "_all"] = vals
        table["modes"][mode] = med
    with open(args.out + ".json", "w") as f:
        json.dump(table, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, key, label in ((axes[0], "overlap_step_ms", "overlap step, ms (lower is better)"),
                           (axes[1], "fit_img_per_s_per_rank", "Keras fit, img/s per rank")):
        modes = [m for m in MODES if table["modes"][m][key] is not None]
        ax.bar(modes, [table["modes"][m][key] for m in modes])
        ax.set_title(label, fontsize=9)
    fig.suptitle("nvgroup_tf XLA on CPU, %d ranks, %s, %s" % (args.ranks, table["date"], commit), fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=100)
    print(json.dumps(table, indent=1))


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in MODES:
        return drive(sys.argv[1:])
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "autocluster":
        tf.config.optimizer.set_jit("autoclustering")
    hvd.init()
    jit = mode in ("sync", "pair", "async")
    result = {"mode": mode, "ranks": hvd.size(),
              "overlap_step_ms": None if mode == "autocluster" else 1e3 * overlap(jit),
              "overlap_nocomm_step_ms": None if mode == "autocluster" else 1e3 * overlap(jit, comm=False),
              "fit_img_per_s_per_rank": fit(jit)}
    if hvd.rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
        print(json.dumps(result), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
