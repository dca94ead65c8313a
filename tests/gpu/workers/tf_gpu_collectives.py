"""TF GPU suite, one launch: every collective x dtype x (eager, tf.function) on
GPU tensors with random data, checked on every rank against float64 (floats)
or exact (integers) references built from every rank's seed; outputs on the
GPU; every result bitwise equal across ranks. Also: gradients through
tf.GradientTape on the GPU, mismatches raising on every rank, the event pool,
allgather's output allocated while TF's stream runs ahead (the allgather race),
and chains of collectives whose inputs TF produces on the GPU just before.

    tf_gpu_collectives.py [CHECK ...]    (default: all; e.g. `race pool` for the
                                          adapter-defect checks alone)
"""
import sys

import numpy as np
from mpi4py import MPI  # noqa: F401  (initializes MPI first; init() accepts that)

from gpu_common import (ALL_DTYPES, FLOAT_DTYPES, GPU, REDUCE_DTYPES, Checker, Digests, check_reduced,
                        event_stats, hvd, init_on_gpu, magnitude, on_gpu, per_rank, random_array, reference, run,
                        shape_for, tf, to_numpy)

OPS = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}
MODES = ("eager", "function")


def call(mode, fn, *args):
    with tf.device(GPU):
        if mode == "eager":
            return fn(*args)
        return tf.function(fn)(*args)


def gpu_tensor(a, dtype):
    with tf.device(GPU):
        t = tf.constant(a, dtype=dtype)
    assert on_gpu(t), t.device
    return t


def check_result(c, d, got, what, dtype):
    """Placement and dtype; `d` (None for results that differ by rank) takes
    the bits for the cross-rank comparison."""
    c.check(on_gpu(got), "%s: output on %s, not the GPU" % (what, got.device))
    c.equal(got.dtype, dtype, "%s: dtype" % what)
    if d is not None:
        d.add(what, got)


def check_allreduce(c, d):
    case = 0
    for mode in MODES:
        for op_name, op in OPS.items():
            for dtype in REDUCE_DTYPES:
                for ndims in (0, 1, 3):
                    case += 1
                    shape = shape_for(case, ndims)
                    arrays, mine = per_rank(case, lambda g: random_array(g, dtype, shape, op_name))
                    name = "ar.%s.%s.%s.%d" % (mode, op_name, dtype.name, ndims)
                    got = call(mode, lambda t: hvd.allreduce(t, op=op, name=name), gpu_tensor(mine, dtype))
                    what = "allreduce %s %s %s shape %s" % (mode, op_name, dtype.name, shape)
                    check_result(c, d, got, what, dtype)
                    check_reduced(c, got, arrays, op_name, dtype, what)
        # Several pipeline chunks and fusion buffers' worth, and the scale factors.
        arrays, mine = per_rank(900 + case, lambda g: random_array(g, tf.float32, (3, 1 << 20)))
        got = call(mode, lambda t: hvd.allreduce(t, op=hvd.Sum, name="ar.large." + mode),
                   gpu_tensor(mine, tf.float32))
        check_result(c, d, got, "allreduce 12 MiB " + mode, tf.float32)
        check_reduced(c, got, arrays, "sum", tf.float32, "allreduce 12 MiB " + mode)
        for dtype in FLOAT_DTYPES:
            arrays, mine = per_rank(950 + case, lambda g: random_array(g, dtype, (33,)))
            got = call(mode, lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0,
                                                     name="ar.scaled.%s.%s" % (mode, dtype.name)),
                       gpu_tensor(mine, dtype))
            what = "allreduce scaled %s %s" % (mode, dtype.name)
            check_result(c, d, got, what, dtype)
            want = reference(arrays, "sum", dtype) * 1.5
            c.close(to_numpy(got), want, magnitude(arrays, "sum", 1) * 1.5 * 4, dtype, what)


def check_grouped(c, d):
    case = 2000
    for mode in MODES:
        for op_name in ("sum", "average", "max"):
            for dtype in REDUCE_DTYPES:
                case += 1
                shapes = [shape_for(case * 10 + i, i % 4) for i in range(7)]
                arrays = [per_rank(case * 10 + i, lambda g: random_array(g, dtype, s, op_name))
                          for i, s in enumerate(shapes)]
                name = "gar.%s.%s.%s" % (mode, op_name, dtype.name)
                got = call(mode, lambda *ts: hvd.grouped_allreduce(list(ts), op=OPS[op_name], name=name),
                           *[gpu_tensor(mine, dtype) for _, mine in arrays])
                for i, (all_ranks, _) in enumerate(arrays):
                    what = "grouped %s %s %s [%d] shape %s" % (mode, op_name, dtype.name, i, shapes[i])
                    check_result(c, d, got[i], what, dtype)
                    check_reduced(c, got[i], all_ranks, op_name, dtype, what)


def check_allgather(c, d):
    case = 3000
    for mode in MODES:
        for dtype in ALL_DTYPES:
            for trailing in ((), (3,), (2, 5)):
                case += 1
                # Uneven first dimensions, one rank with none when there are several.
                rows = [(r * 3 + case) % 4 + 1 for r in range(hvd.size())]
                if hvd.size() > 1:
                    rows[1] = 0
                arrays = [random_array(np.random.default_rng([case, r]), dtype, (rows[r],) + trailing)
                          for r in range(hvd.size())]
                name = "ag.%s.%s.%d" % (mode, dtype.name, len(trailing))
                got = call(mode, lambda t: hvd.allgather(t, name=name), gpu_tensor(arrays[hvd.rank()], dtype))
                what = "allgather %s %s rows %s x %s" % (mode, dtype.name, rows, trailing)
                check_result(c, d, got, what, dtype)
                want = np.concatenate(arrays, axis=0)
                c.equal(got.numpy() if dtype not in (tf.bfloat16,) else got.numpy().view(np.uint16),
                        want if dtype not in (tf.bfloat16,) else want.view(np.uint16), what)


def check_broadcast(c, d):
    case = 4000
    for mode in MODES:
        for dtype in ALL_DTYPES:
            for root in range(hvd.size()):
                case += 1
                arrays = [random_array(np.random.default_rng([case, r]), dtype, (4, 3)) for r in range(hvd.size())]
                name = "bc.%s.%s.%d" % (mode, dtype.name, root)
                got = call(mode, lambda t: hvd.broadcast(t, root, name=name), gpu_tensor(arrays[hvd.rank()], dtype))
                what = "broadcast %s %s root %d" % (mode, dtype.name, root)
                check_result(c, d, got, what, dtype)
                want = arrays[root]
                c.equal(got.numpy() if dtype != tf.bfloat16 else got.numpy().view(np.uint16),
                        want if dtype != tf.bfloat16 else want.view(np.uint16), what)


def check_new_collectives(c, d):
    """reducescatter, alltoall, grouped allgather and the rest beyond allreduce, where this build has them."""
    if hasattr(hvd, "reducescatter"):
        for mode in MODES:
            for dtype in (tf.float32, tf.int32):
                arrays, mine = per_rank(5000, lambda g: random_array(g, dtype, (2 * hvd.size() + 1, 3)))
                got = call(mode, lambda t: hvd.reducescatter(t, op=hvd.Sum, name="rs.%s.%s" % (mode, dtype.name)),
                           gpu_tensor(mine, dtype))
                full = reference(arrays, "sum", dtype)
                n, size = full.shape[0], hvd.size()
                # Horovod's split: the first n % size ranks get one row more.
                starts = [r * (n // size) + min(r, n % size) for r in range(size + 1)]
                what = "reducescatter %s %s" % (mode, dtype.name)
                check_result(c, None, got, what, dtype)  # this rank's rows
                want = full[starts[hvd.rank()]:starts[hvd.rank() + 1]]
                if dtype.is_integer:
                    c.equal(got.numpy().astype(np.int64), want, what)
                else:
                    c.close(got.numpy(), want, magnitude(arrays, "sum", 1)[starts[hvd.rank()]:starts[hvd.rank() + 1]],
                          dtype, what)
    if hasattr(hvd, "grouped_allgather"):
        for mode in MODES:
            size = hvd.size()
            per = [[random_array(np.random.default_rng([5200, i, r]), tf.float32, (r + i + 1, 3)) for r in range(size)]
                   for i in range(3)]
            got = call(mode, lambda *ts: hvd.grouped_allgather(list(ts), name="gag." + mode),
                       *[gpu_tensor(p[hvd.rank()], tf.float32) for p in per])
            for i in range(3):
                what = "grouped_allgather %s [%d]" % (mode, i)
                check_result(c, d, got[i], what, tf.float32)
                c.equal(got[i].numpy(), np.concatenate(per[i]), what)
    if hasattr(hvd, "alltoall"):
        for mode in MODES:
            size = hvd.size()
            splits = [(hvd.rank() + q) % 3 for q in range(size)]
            arrays = [random_array(np.random.default_rng([5100, r]), tf.float32,
                                   (sum((r + q) % 3 for q in range(size)), 2)) for r in range(size)]
            got = call(mode, lambda t: hvd.alltoall(t, splits=splits, name="a2a." + mode),
                       gpu_tensor(arrays[hvd.rank()], tf.float32))
            if isinstance(got, (tuple, list)):
                got = got[0]
            parts = []
            for src in range(size):
                src_splits = [(src + q) % 3 for q in range(size)]
                offset = sum(src_splits[:hvd.rank()])
                parts.append(arrays[src][offset:offset + src_splits[hvd.rank()]])
            what = "alltoall " + mode
            check_result(c, None, got, what, tf.float32)  # this rank's parts
            c.equal(got.numpy(), np.concatenate(parts), what)


def check_gradients(c, d):
    size = hvd.size()
    for mode in MODES:
        ws = [np.random.default_rng([6000, r]).standard_normal((5, 3)) for r in range(size)]
        xs = [np.random.default_rng([6001, r]).standard_normal((5, 3)) for r in range(size)]
        for op_name, op in (("sum", hvd.Sum), ("average", hvd.Average)):
            def grad_allreduce(x, w):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    loss = tf.reduce_sum(hvd.allreduce(x, op=op, name="g.ar.%s.%s" % (mode, op_name)) * w)
                return tape.gradient(loss, x)
            got = call(mode, grad_allreduce, gpu_tensor(xs[hvd.rank()], tf.float64),
                       gpu_tensor(ws[hvd.rank()], tf.float64))
            want = np.sum(ws, axis=0) / (size if op_name == "average" else 1)
            what = "gradient of allreduce %s %s" % (op_name, mode)
            check_result(c, d, got, what, tf.float64)
            c.close(got.numpy(), want, np.sum(np.abs(ws), axis=0), tf.float64, what)

        rows = [r + 1 for r in range(size)]
        gx = [np.random.default_rng([6002, r]).standard_normal((rows[r], 4)) for r in range(size)]
        gw = [np.random.default_rng([6003, r]).standard_normal((sum(rows), 4)) for r in range(size)]

        def grad_allgather(x, w):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(hvd.allgather(x, name="g.ag." + mode) * w)
            return tape.gradient(loss, x)
        got = call(mode, grad_allgather, gpu_tensor(gx[hvd.rank()], tf.float64),
                   gpu_tensor(gw[hvd.rank()], tf.float64))
        start = sum(rows[:hvd.rank()])
        # Horovod's gradient (nvgroup_tf/mpi_ops.py): the incoming gradients
        # averaged over ranks, this rank's rows.
        want = np.mean(gw, axis=0)[start:start + rows[hvd.rank()]]
        what = "gradient of allgather " + mode
        check_result(c, None, got, what, tf.float64)  # this rank's rows
        c.close(got.numpy(), want, np.sum(np.abs(gw), axis=0)[start:start + rows[hvd.rank()]], tf.float64, what)

        def grad_broadcast(x, w):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(hvd.broadcast(x, 0, name="g.bc." + mode) * w)
            return tape.gradient(loss, x)
        got = call(mode, grad_broadcast, gpu_tensor(xs[hvd.rank()], tf.float64),
                   gpu_tensor(ws[hvd.rank()], tf.float64))
        # Horovod's gradient: the average over ranks on the root, zero elsewhere.
        want = np.mean(ws, axis=0) if hvd.rank() == 0 else np.zeros((5, 3))
        what = "gradient of broadcast " + mode
        check_result(c, None, got, what, tf.float64)  # zero off the root
        c.close(got.numpy(), want, np.sum(np.abs(ws), axis=0), tf.float64, what)


def check_mismatches(c):
    """A disagreement is an error on every rank, and the engine carries on."""
    if hvd.size() < 2:
        return
    r = hvd.rank()
    with tf.device(GPU):
        x = tf.ones([3 + r, 2])
        c.raises(tf.errors.OpError, lambda: hvd.allreduce(x, name="mm.shape").numpy(),
                 "allreduce with a different shape per rank", contains="mm.shape")
        y = tf.ones([4], dtype=tf.float32 if r == 0 else tf.float64)
        c.raises(tf.errors.OpError, lambda: hvd.allreduce(y, name="mm.dtype").numpy(),
                 "allreduce with a different dtype per rank", contains="mm.dtype")
        z = tf.ones([2, 3 + r])
        c.raises(tf.errors.OpError, lambda: hvd.allgather(z, name="mm.ag").numpy(),
                 "allgather with different trailing dimensions", contains="mm.ag")
        c.raises(tf.errors.OpError, lambda: hvd.broadcast(tf.ones([2]), r % 2, name="mm.root").numpy(),
                 "broadcast with a different root per rank", contains="mm.root")
        after = hvd.allreduce(tf.fill([5], float(r + 1)), op=hvd.Sum, name="mm.after")
    c.equal(after.numpy(), np.full([5], hvd.size() * (hvd.size() + 1) / 2, np.float32),
            "a collective after the mismatches")


def check_run_ahead(c, d):
    """Chains where each collective's input is produced on the GPU by the op
    just before it, and its output consumed by the next GPU op, inside one
    tf.function: TF enqueues the whole chain ahead of the device, so any
    missing readiness or completion wait shows up as a wrong value."""
    size = hvd.size()
    steps = 40
    big = 1 << 20  # 4 MiB of float32 per tensor: kernels that take a while
    base = [np.random.default_rng([7000, r]).standard_normal(big).astype(np.float32) for r in range(size)]

    @tf.function
    def chain(x):
        outs = []
        for k in range(steps):
            x = x * 0.5 + float(k)                                # produced just before the collective
            x = hvd.allreduce(x, op=hvd.Average, name="chain.%d" % k)
            outs.append(x[:4])
        return x, tf.stack(outs)

    with tf.device(GPU):
        got, heads = chain(tf.constant(base[hvd.rank()]))
    want = np.mean(np.stack(base).astype(np.float64), axis=0)
    want_heads = []
    for k in range(steps):
        want = want * 0.5 + k
        want_heads.append(want[:4])
    err = np.max(np.abs(got.numpy() - want)) / max(1.0, np.max(np.abs(want)))
    c.check(err < 1e-5, "chain of %d allreduces: relative error %.3g" % (steps, err))
    herr = np.max(np.abs(heads.numpy() - np.stack(want_heads)))
    c.check(herr < 1e-3 * steps, "chain of %d allreduces, every step's head: error %.3g" % (steps, herr))
    d.add("chain", got)


def check_allgather_race(c, d):
    """Allgather's output is allocated on the engine thread, after negotiation.
    The race, made likely: rank 0's allgather starts at once (the old code
    recorded readiness here), while rank 1 reaches its allgather only ~40 ms
    later (its input comes through a sleeping py_function), so rank 0's
    negotiation, and with it the output allocation, happens while TF has
    queued a long chain of kernels on its stream whose temporaries have the
    output's size: each temporary TF frees is handed out again at once, while
    the kernels that use it are still queued. Unless readiness is recorded
    after the allocation, the engine writes the output before those kernels
    run: they then read the engine's data (the chain comes out wrong) or
    overwrite the output (the allgather comes out wrong). Integer-valued
    float32 data and integer steps keep both references exact. On one H200
    this check also passed with the op library from before the fix
    (benchmarks/results/tf_gpu_h200_f3a5304/race.log): it checks the results, it does not prove the
    ordering, which rests on the argument in ops/adapter.h."""
    import time
    size = hvd.size()
    rows, cols = 2048, 4096          # 32 MiB of float32 per rank
    per = [np.random.default_rng([8000, r]).integers(-1000, 1000, (rows, cols)).astype(np.float32)
           for r in range(size)]
    gathered_shape = (rows * size, cols)
    seed = np.random.default_rng([8001, hvd.rank()]).integers(-1000, 1000, gathered_shape).astype(np.float32)
    steps = 1500                     # ~128 MiB of traffic per kernel: tens of ms of queued work
    delay = 0.04 if hvd.rank() == 1 else 0.0

    def sleep_then(t, seconds):
        time.sleep(seconds)
        return t

    def race(x, y):
        if delay:
            x = tf.py_function(lambda t: sleep_then(t, delay), [x], tf.float32)
            x.set_shape((rows, cols))
        g = hvd.allgather(x, name="race")   # no dependency on the chain below
        # The chain starts after the allgather has started (a 2 ms gate), and
        # behind GPU work that is quick to launch and slow to run (sorts of
        # the whole tensor), so TF's stream is still far behind its host side
        # when rank 0's output is allocated. 0 * (a finite value) adds nothing.
        blocker = tf.reshape(y, [-1])
        for _ in range(3):
            blocker = tf.sort(blocker)
        y = y + 0.0 * blocker[0] + tf.py_function(lambda: sleep_then(tf.constant(0.0), 0.002), [], tf.float32)
        for k in range(steps):           # temporaries of g's size, each freed at once
            y = y + float(k % 3 + 1)
        return g, y

    # Grappler would fold the chain of adds; the check needs every kernel.
    saved = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    try:
        race_fn = tf.function(race)
        with tf.device(GPU):
            x0, y0 = tf.constant(per[hvd.rank()]), tf.constant(seed)
            race_fn.get_concrete_function(x0, y0)
    finally:
        tf.config.optimizer.set_experimental_options(saved)
    want_g = np.concatenate(per, axis=0)
    want_y = seed + np.float32(sum(k % 3 + 1 for k in range(steps)))
    trials, bad_g, bad_y = 5, 0, 0
    for trial in range(trials):
        with tf.device(GPU):
            g, y = race_fn(x0, y0)
        bad_g += int(not np.array_equal(g.numpy(), want_g))
        bad_y += int(not np.array_equal(y.numpy(), want_y))
        if trial == 0:
            d.add("race allgather", g)
    c.check(bad_g == 0, "allgather output overwritten while TF ran ahead: %d of %d trials wrong" % (bad_g, trials))
    c.check(bad_y == 0, "TF's kernels saw the allgather's writes: %d of %d trials wrong" % (bad_y, trials))


def check_event_pool(c):
    created0, recorded0 = event_stats()
    n = 300
    with tf.device(GPU):
        x = tf.ones([64])
        for i in range(n):
            x = hvd.allreduce(x, op=hvd.Average, name="pool.%d" % (i % 7))
    x.numpy()
    created, recorded = event_stats()
    c.check(recorded - recorded0 >= n, "readiness records: %d for %d ops" % (recorded - recorded0, n))
    c.check(created - created0 <= 4, "%d cudaEvents created for %d sequential ops (a pool reuses them)"
            % (created - created0, n))
    c.check(created <= 64, "%d cudaEvents created in all (the pool holds the most ops ever in flight)" % created)


def main():
    init_on_gpu()
    c = Checker("tf_gpu_collectives")
    d = Digests()
    checks = (("allreduce", lambda: check_allreduce(c, d)),
              ("grouped", lambda: check_grouped(c, d)),
              ("allgather", lambda: check_allgather(c, d)),
              ("broadcast", lambda: check_broadcast(c, d)),
              ("new", lambda: check_new_collectives(c, d)),
              ("gradients", lambda: check_gradients(c, d)),
              ("mismatches", lambda: check_mismatches(c)),
              ("chain", lambda: check_run_ahead(c, d)),
              ("race", lambda: check_allgather_race(c, d)),
              ("pool", lambda: check_event_pool(c)))
    wanted = sys.argv[1:] or [name for name, _ in checks]
    for name, fn in checks:
        if name in wanted:
            c.section(name)
            fn()
    d.compare(c)
    c.finish()
    print("[rank %d] PASSED" % hvd.rank(), flush=True)


if __name__ == "__main__":
    run(main)
