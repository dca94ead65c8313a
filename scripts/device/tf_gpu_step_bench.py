"""Step cost of the TF GPU op on ResNet-50's 214 gradients (25.6M float32).

    mpirun -np N python scripts/device/tf_gpu_step_bench.py --label new --json out.json

One tf.function per variant, called STEPS times back to back (as a training
loop calls its step) after warm-up calls, then one sync (the device finishing
the last step); the time per step is that span / STEPS, the median of REPEATS
such spans, the maximum over ranks. Variants, all on the GPU:
  * tf_only:    `t * 1.0` on each of the 214 tensors (TensorFlow's own cost of
                214 GPU ops in a function: the floor of any per-tensor variant)
  * grouped:    one hvd.grouped_allreduce of the 214 (Average)
  * per_tensor: 214 hvd.allreduce ops (Average), one per tensor
  * grouped_after_compute: `t * 1.0` then the grouped allreduce, as a step
                that produces its gradients on the GPU just before
Not a test: nothing is asserted about speed.
"""
import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import nvgroup_tf as hvd  # noqa: E402


def gradient_shapes(path):
    shapes = []
    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            shapes.append(tuple(int(d) for d in line.split()[2].split("x")))
    return shapes


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gradients", default=os.path.join(os.environ.get("NVG_REPO", "."),
                                                       "benchmarks", "resnet50_gradients.txt"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--label", default="")
    p.add_argument("--json", default="", help="append the record (one JSON line) here")
    args = p.parse_args()

    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    gpu = gpus[hvd.local_rank() % len(gpus)]
    tf.config.set_visible_devices(gpu, "GPU")
    tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=4096)])
    shapes = gradient_shapes(args.gradients)
    rng = np.random.default_rng(hvd.rank())
    with tf.device("/GPU:0"):
        grads = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    assert all(g.device.endswith("GPU:0") for g in grads)

    @tf.function
    def tf_only(ts):
        return [t * 1.0 for t in ts]

    @tf.function
    def grouped(ts):
        return hvd.grouped_allreduce(ts, op=hvd.Average, name="bench.grouped")

    @tf.function
    def per_tensor(ts):
        return [hvd.allreduce(t, op=hvd.Average, name="bench.t%d" % i) for i, t in enumerate(ts)]

    @tf.function
    def grouped_after_compute(ts):
        return hvd.grouped_allreduce([t * 1.0 for t in ts], op=hvd.Average, name="bench.gac")

    variants = [("tf_only", tf_only), ("grouped", grouped), ("per_tensor", per_tensor),
                ("grouped_after_compute", grouped_after_compute)]
    results = {}
    for name, fn in variants:
        with tf.device("/GPU:0"):
            for _ in range(3):
                fn(grads)[0].numpy()
            spans = []
            for _ in range(args.repeats):
                hvd.allreduce(tf.zeros([1]), name="bench.sync").numpy()  # ranks start together
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    out = fn(grads)
                out[-1].numpy()  # TF's stream has finished the last step
                spans.append((time.perf_counter() - t0) / args.steps)
        mine = float(np.median(spans))
        worst = max(hvd.allgather_object(mine))
        results[name] = {"ms_per_step": worst * 1e3, "spans_ms_rank0": [s * 1e3 for s in spans]}
    if hvd.rank() == 0:
        record = {
            "what": "TF GPU op step cost, ResNet-50 gradient set (%d tensors, %.1fM float32)"
                    % (len(shapes), sum(int(np.prod(s)) for s in shapes) / 1e6),
            "label": args.label, "ranks": hvd.size(), "gpus": len(gpus),
            "gpu": tf.config.experimental.get_device_details(gpu).get("device_name", "?"),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "host": platform.node(), "tf": tf.__version__, "steps": args.steps, "repeats": args.repeats,
            "commit": os.environ.get("NVG_COMMIT", "?"), "results": results,
        }
        print("STEP %s ranks=%d %s" % (args.label, hvd.size(), " ".join(
            "%s=%.2fms" % (k, v["ms_per_step"]) for k, v in results.items())), flush=True)
        if args.json:  # one JSON object per line, appended
            with open(args.json, "a") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    sys.exit(main())
