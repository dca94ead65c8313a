"""Data-parallel ResNet-50 (Keras 3) with nvgroup_tf, Horovod style.

    nvgrouprun -np 2 python examples/resnet50/train.py --image-size 64 --batch-size 8 --steps 20

Synthetic data by default (random images and labels made once per rank and
repeated: the benchmark measures training, not input). --data-dir reads real
data: TFRecords in the ImageNet layout (image/encoded, image/class/label) if the
directory holds *.tfrecord* or train-* files, else an image directory with one
subdirectory per class. Each rank reads its own shard.

Timing: the first --warmup-steps steps (graph tracing, engine negotiation,
caches) are not timed. Rank 0 prints a progress line every --log-every steps
with img/s per rank and in total (ranks step in lockstep under synchronous
SGD, so total = per-rank x ranks) and at the end a summary plus one line
"NVG_RESULT {json}" that scaling.py parses.

Keras' progress bar is shown on rank 0 only (verbose=1 if rank == 0), and the
loss it and the progress lines show at epoch ends and log steps is averaged over
ranks (MetricAverageCallback; an allreduce at each log step). --log-local-loss
makes every rank print its own loss to its stderr as well.

Checkpoints (--checkpoint-dir) are whole models (.keras: weights and optimizer
state), written by rank 0 only after each epoch; --resume loads the newest one
on every rank with hvd.load_model (the optimizer comes back distributed with
its iterations and momenta) and continues from the epoch after it.

--cores-per-rank K pins each rank to its own K cores (local rank r gets cores
r*K .. r*K+K-1), so a 1-rank baseline and each of N ranks get the same CPU
share (with --intra-op-threads K).
"""
import argparse
import json
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--steps", type=int, default=100, help="timed steps per epoch")
    p.add_argument("--warmup-steps", type=int, default=5, help="untimed steps before the timed ones")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.0125, help="learning rate per rank (scaled by the number of ranks)")
    p.add_argument("--lr-warmup-epochs", type=int, default=0,
                   help="Goyal et al. warmup from lr to lr*ranks over this many epochs (0: off)")
    p.add_argument("--mixed-precision", action="store_true", help="mixed_float16 + LossScaleOptimizer")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="gradient fusion bucket cap, MiB (default: NVGROUP_BUCKET_CAP_MB or the library default)")
    p.add_argument("--fusion-threshold-mb", type=float, default=None, help="sets NVGROUP_FUSION_THRESHOLD")
    p.add_argument("--cycle-time-ms", type=float, default=None, help="sets NVGROUP_CYCLE_TIME")
    p.add_argument("--data-dir", default=None, help="TFRecords or class-per-directory images (default: synthetic)")
    p.add_argument("--checkpoint-dir", default=None, help="rank 0 saves the model here after each epoch")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir (all ranks load it)")
    p.add_argument("--cores-per-rank", type=int, default=0,
                   help="pin each rank to its own this many cores (0: no pinning)")
    p.add_argument("--reduce-only", action="store_true",
                   help="time only the gradient reduction (random gradients of ResNet-50's shapes, "
                        "bucketed as in training): isolates what --bucket-cap-mb changes")
    p.add_argument("--intra-op-threads", type=int, default=0,
                   help="TF intra-op threads per rank (0: this host's cores / ranks on it)")
    p.add_argument("--log-local-loss", action="store_true",
                   help="every rank also prints its own (not averaged) epoch loss to its stderr "
                        "(to check the averaging or spot a diverging rank; see --output-filename)")
    args = p.parse_args(argv)
    for name in ("batch_size", "image_size", "num_classes", "steps", "epochs", "log_every"):
        if getattr(args, name) < 1:
            p.error("--%s must be >= 1" % name.replace("_", "-"))
    if args.warmup_steps < 0:
        p.error("--warmup-steps must be >= 0")
    if args.image_size < 32:
        p.error("--image-size must be >= 32 (ResNet-50 downsamples by 32)")
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    return args


def pin_cores(cores_per_rank):
    """Pins this process (before TF starts its threads) to the cores of its
    local rank; returns the cores, or None when not pinning."""
    if cores_per_rank <= 0:
        return None
    local_rank = 0
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(var, "").isdigit():
            local_rank = int(os.environ[var])
            break
    available = sorted(os.sched_getaffinity(0))
    first = local_rank * cores_per_rank
    if first + cores_per_rank > len(available):
        raise SystemExit("--cores-per-rank %d: local rank %d needs cores %d-%d, this host has %d"
                         % (cores_per_rank, local_rank, first, first + cores_per_rank - 1, len(available)))
    cores = set(available[first:first + cores_per_rank])
    os.sched_setaffinity(0, cores)
    return sorted(cores)


CHECKPOINT_PATTERN = "resnet50-%03d.keras"


def newest_checkpoint(directory):
    """(path, epoch) of the newest resnet50-NNN.keras in directory, or (None, 0)."""
    import re
    best = (None, 0)
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        m = re.fullmatch(r"resnet50-(\d{3})\.keras", name)
        if m and int(m.group(1)) > best[1]:
            best = (os.path.join(directory, name), int(m.group(1)))
    return best


def main(argv=None):
    args = parse_args(argv)
    cores = pin_cores(args.cores_per_rank)
    # Engine knobs must be in the environment before init (cc/common/env.h reads them once).
    if args.fusion_threshold_mb is not None:
        os.environ["NVGROUP_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * (1 << 20)))
    if args.cycle_time_ms is not None:
        os.environ["NVGROUP_CYCLE_TIME"] = str(args.cycle_time_ms)

    import numpy as np
    import tensorflow as tf
    import keras

    import nvgroup_tf.keras as hvd

    hvd.init()
    rank, size, local_size = hvd.rank(), hvd.size(), hvd.local_size()

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:  # one GPU per rank
        gpu = gpus[hvd.local_rank() % len(gpus)]
        tf.config.set_visible_devices(gpu, "GPU")
        tf.config.experimental.set_memory_growth(gpu, True)
    else:  # CPU: share the host's cores among its ranks
        threads = args.intra_op_threads or max(1, (os.cpu_count() or 1) // local_size)
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    if args.mixed_precision:
        keras.mixed_precision.set_global_policy("mixed_float16")

    untimed = max(1, args.warmup_steps)  # the first step always traces the graph
    steps_per_epoch = untimed + args.steps
    dataset = make_dataset(args, rank, size, tf, np)

    if rank == 0 and cores is not None:
        print("# each rank pinned to %d core(s) (this one: %s), %d intra-op thread(s)"
              % (args.cores_per_rank, cores, tf.config.threading.get_intra_op_parallelism_threads() or -1),
              flush=True)
    bucket_cap = None if args.bucket_cap_mb is None else int(args.bucket_cap_mb * (1 << 20))
    initial_epoch = 0
    resume_path = None
    if args.resume:
        resume_path, initial_epoch = newest_checkpoint(args.checkpoint_dir)
    if resume_path is not None:
        # Every rank loads rank 0's checkpoint: weights, and an optimizer that
        # comes back distributed with its saved iterations and momenta.
        model = hvd.load_model(resume_path, bucket_cap_bytes=bucket_cap)
        if rank == 0:
            print("# resumed from %s (epoch %d, optimizer iterations %d)"
                  % (resume_path, initial_epoch, int(model.optimizer.iterations.numpy())), flush=True)
    else:
        if args.resume and rank == 0:
            print("# --resume: no checkpoint in %s, starting fresh" % args.checkpoint_dir, flush=True)
        keras.utils.set_random_seed(1000 + rank)  # different init per rank: the broadcast fixes it
        model = keras.applications.ResNet50(weights=None, input_shape=(args.image_size, args.image_size, 3),
                                            classes=args.num_classes)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr * size, momentum=0.9),
                                       bucket_cap_bytes=bucket_cap)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    if initial_epoch >= args.epochs:
        if rank == 0:
            print("# nothing to do: checkpoint epoch %d >= --epochs %d" % (initial_epoch, args.epochs))
        return 0

    timer = ThroughputTimer(args, rank, size, untimed, steps_per_epoch)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    if args.log_local_loss:  # before MetricAverageCallback: sees this rank's own loss
        callbacks.append(LocalLossLogger(rank))
    callbacks.append(hvd.callbacks.MetricAverageCallback())
    if args.lr_warmup_epochs > 0:
        callbacks.append(hvd.callbacks.LearningRateWarmupCallback(args.lr * size, warmup_epochs=args.lr_warmup_epochs,
                                                                  steps_per_epoch=steps_per_epoch, verbose=1))
    callbacks.append(timer)
    if args.checkpoint_dir and rank == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(args.checkpoint_dir, "resnet50-{epoch:03d}.keras")))

    if args.reduce_only:
        return reduce_only(args, model, rank, size, untimed, bucket_cap, np, tf)
    model.fit(dataset, epochs=args.epochs, initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
              callbacks=callbacks, shuffle=False, verbose=1 if rank == 0 else 0)
    timer.report()
    return 0


def reduce_only(args, model, rank, size, untimed, bucket_cap, np, tf):
    """Times DistributedOptimizer's reduction alone on ResNet-50's gradient shapes."""
    from nvgroup_tf.gradient_reducer import GradientReducer, ReduceOptions
    variables = model.trainable_variables
    rng = np.random.default_rng(rank)
    grads = [tf.constant(rng.standard_normal(v.shape).astype(np.float32)) for v in variables]
    reducer = GradientReducer(ReduceOptions(bucket_cap_bytes=bucket_cap))
    step = tf.function(lambda gs: reducer.reduce(gs, variables))
    times = []
    for i in range(untimed + args.steps):
        t = time.perf_counter()
        out = step(grads)
        out[0].numpy()
        if i >= untimed:
            times.append(time.perf_counter() - t)
    if rank == 0:
        times.sort()
        nbytes = sum(int(np.prod(v.shape)) * 4 for v in variables)
        result = {"model": "resnet50", "mode": "reduce_only", "ranks": size, "bucket_cap_mb": args.bucket_cap_mb,
                  "gradient_bytes": nbytes, "tensors": len(variables), "steps": args.steps,
                  "batch_size": args.batch_size, "image_size": args.image_size, "data": "random gradients",
                  "step_time_ms_mean": 1e3 * sum(times) / len(times),
                  "step_time_ms_median": 1e3 * times[len(times) // 2],
                  # "throughput" of this mode: reductions per second (scaling.py's columns)
                  "img_per_sec_per_rank": len(times) / sum(times), "img_per_sec_total": len(times) / sum(times)}
        print("# reduce-only: %d tensors, %.1f MB, %d ranks: median %.1f ms per step"
              % (len(variables), nbytes / 1e6, size, result["step_time_ms_median"]))
        print("NVG_RESULT " + json.dumps(result), flush=True)
    return 0


def make_dataset(args, rank, size, tf, np):
    shape = (args.image_size, args.image_size, 3)
    if args.data_dir is None:
        rng = np.random.default_rng(rank)
        images = rng.uniform(0.0, 1.0, size=(args.batch_size,) + shape).astype(np.float32)
        labels = rng.integers(0, args.num_classes, size=(args.batch_size,)).astype(np.int32)
        return tf.data.Dataset.from_tensors((images, labels)).repeat()
    files = sorted(tf.io.gfile.glob(os.path.join(args.data_dir, "*.tfrecord*")) +
                   tf.io.gfile.glob(os.path.join(args.data_dir, "train-*")))
    if files:
        if len(files) < size:
            raise SystemExit("--data-dir has %d TFRecord files, fewer than the %d ranks" % (len(files), size))
        features = {"image/encoded": tf.io.FixedLenFeature([], tf.string),
                    "image/class/label": tf.io.FixedLenFeature([], tf.int64)}

        def parse(record):
            ex = tf.io.parse_single_example(record, features)
            image = tf.image.decode_jpeg(ex["image/encoded"], channels=3)
            image = tf.image.resize(image, shape[:2]) / 255.0
            # ImageNet TFRecords number classes from 1.
            return tf.image.random_flip_left_right(image), tf.cast(ex["image/class/label"] - 1, tf.int32)

        ds = tf.data.Dataset.from_tensor_slices(files).shard(size, rank)
        ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=4, num_parallel_calls=tf.data.AUTOTUNE)
        ds = ds.shuffle(1024, seed=rank).map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    else:
        import keras
        ds = keras.utils.image_dataset_from_directory(args.data_dir, image_size=shape[:2], batch_size=None,
                                                      shuffle=True, seed=1)
        ds = ds.shard(size, rank).map(lambda x, y: (x / 255.0, tf.cast(y, tf.int32)))
    return ds.repeat().batch(args.batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def LocalLossLogger(rank):
    import keras

    class Logger(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if logs and "loss" in logs:
                print("# rank %d local loss epoch %d: %r" % (rank, epoch + 1, float(logs["loss"])),
                      file=sys.stderr, flush=True)

    return Logger()


def ThroughputTimer(args, rank, size, untimed, steps_per_epoch):
    import keras
    import numpy as np
    import tensorflow as tf

    import nvgroup_tf.keras as hvd

    class Timer(keras.callbacks.Callback):
        """Times the steps after the first `untimed` of every epoch (rank 0 prints)."""

        def __init__(self):
            super().__init__()
            self.step_times = []
            self.epoch_rates = []
            self._t0 = self._t_last = None
            self._epoch = 0
            self.last_loss = None

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch
            self._t0 = self._t_last = None

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            done = batch + 1
            if done == untimed:
                self._t0 = self._t_last = now
                return
            if done < untimed:
                return
            self.step_times.append(now - self._t_last)
            self._t_last = now
            timed = done - untimed
            if timed % args.log_every == 0 or done == steps_per_epoch:  # same steps on every rank
                loss = (logs or {}).get("loss")
                if loss is not None:  # every rank takes part; rank 0 prints the average
                    loss = float(hvd.allreduce(np.float64(loss), op=hvd.Average).numpy())
                self.last_loss = loss
                if rank != 0:
                    return
                rate = timed * args.batch_size / (now - self._t0)
                print("epoch %d step %4d/%d  loss %s  img/s per rank %8.2f  total %9.2f"
                      % (self._epoch + 1, done, steps_per_epoch,
                         "-" if loss is None else "%.4f" % float(loss), rate, rate * size), flush=True)

        def on_epoch_end(self, epoch, logs=None):
            if self._t0 is not None and self._t_last > self._t0:
                self.epoch_rates.append((steps_per_epoch - untimed) * args.batch_size / (self._t_last - self._t0))

        def report(self):
            if rank != 0 or not self.epoch_rates:
                return
            per_rank = sum(self.epoch_rates) / len(self.epoch_rates)
            times = sorted(self.step_times)
            result = {
                "model": "resnet50", "ranks": size, "batch_size": args.batch_size, "image_size": args.image_size,
                "num_classes": args.num_classes, "steps": args.steps, "epochs": args.epochs,
                "warmup_steps": untimed, "mixed_precision": args.mixed_precision,
                "bucket_cap_mb": args.bucket_cap_mb, "data": "synthetic" if args.data_dir is None else "real",
                "img_per_sec_per_rank": per_rank, "img_per_sec_total": per_rank * size,
                "step_time_ms_mean": 1e3 * sum(times) / len(times),
                "step_time_ms_median": 1e3 * times[len(times) // 2],
                "loss_averaged_over_ranks": self.last_loss,
                "intra_op_threads": args.intra_op_threads, "cores_per_rank": args.cores_per_rank,
                "intra_op_threads_used": tf.config.threading.get_intra_op_parallelism_threads(),
            }
            print("# ResNet-50: %d rank(s) x batch %d, %dx%d images, %d timed steps x %d epoch(s)"
                  % (size, args.batch_size, args.image_size, args.image_size, args.steps, args.epochs))
            print("# img/s per rank %.2f, total %.2f; step time mean %.1f ms, median %.1f ms"
                  % (per_rank, per_rank * size, result["step_time_ms_mean"], result["step_time_ms_median"]))
            print("NVG_RESULT " + json.dumps(result), flush=True)

    return Timer()


if __name__ == "__main__":
    sys.exit(main())
