"""Every collective, dtype and rank 0-3 on random data, checked on every rank
against a float64 (floats) or exact (integers) reference built from every
rank's seed. Also: topology vs mpi4py, Average vs Sum, scale factors, grouped
allreduce, uneven allgather, broadcast from each root, gradients, tf.function,
200 tensors submitted in a different order on each rank, compression,
IndexedSlices, variables and objects."""
import random
import threading
import warnings

import numpy as np
from mpi4py import MPI  # first: mpi4py initializes MPI, init() must accept that

from common import (ALL_DTYPES, FLOAT_DTYPES, REDUCE_DTYPES, Checker, check_reduced, hvd, magnitude,
                    per_rank, random_array, reference, run, shape_for, tf, to_numpy)

OPS = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max,
       "product": hvd.Product}


def check_topology(c):
    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    c.equal(hvd.rank(), world.rank, "rank vs mpi4py")
    c.equal(hvd.size(), world.size, "size vs mpi4py")
    c.equal(hvd.local_rank(), local.rank, "local_rank vs mpi4py")
    c.equal(hvd.local_size(), local.size, "local_size vs mpi4py")
    c.equal(hvd.cross_rank(), 0, "cross_rank on one node")
    c.equal(hvd.cross_size(), 1, "cross_size on one node")
    c.check(hvd.is_initialized(), "is_initialized after init")
    hvd.init()  # idempotent
    c.equal(hvd.size(), world.size, "size after a second init()")


def check_allreduce_matrix(c):
    case = 0
    for op_name, op in OPS.items():
        for dtype in REDUCE_DTYPES:
            for ndims in range(4):
                case += 1
                shape = shape_for(case, ndims)
                arrays, mine = per_rank(case, lambda g: random_array(g, dtype, shape, op_name))
                got = hvd.allreduce(tf.constant(mine, dtype=dtype), op=op,
                                    name="matrix.%s.%s.%d" % (op_name, dtype.name, ndims))
                c.equal(got.dtype, dtype, "allreduce %s %s dtype" % (op_name, dtype.name))
                check_reduced(c, got, arrays, op_name, dtype,
                             "allreduce %s %s shape %s" % (op_name, dtype.name, shape))
    # Empty tensor and a large one (several fusion/pipeline chunks' worth).
    empty = hvd.allreduce(tf.zeros([0, 3]), op=hvd.Sum, name="empty")
    c.equal(empty.shape.as_list(), [0, 3], "allreduce of an empty tensor keeps its shape")
    arrays, mine = per_rank(999, lambda g: random_array(g, tf.float32, (3, 1 << 20)))
    got = hvd.allreduce(tf.constant(mine), op=hvd.Sum, name="large")
    check_reduced(c, got, arrays, "sum", tf.float32, "allreduce 12 MiB float32")


def check_average_and_scales(c):
    n = hvd.size()
    for dtype in FLOAT_DTYPES:
        arrays, mine = per_rank(2000, lambda g: random_array(g, dtype, (7, 5)))
        x = tf.constant(mine, dtype=dtype)
        total = to_numpy(hvd.allreduce(x, op=hvd.Sum, name="avg_vs_sum.sum.%s" % dtype.name))
        mean = to_numpy(hvd.allreduce(x, op=hvd.Average, name="avg_vs_sum.avg.%s" % dtype.name))
        default = to_numpy(hvd.allreduce(x, name="avg_vs_sum.default.%s" % dtype.name))
        mag = magnitude(arrays, "sum", n)
        c.close(mean, total / n, mag / n, dtype, "Average vs Sum / size (%s)" % dtype.name)
        c.equal(default, mean, "default op is Average (%s)" % dtype.name)
        for pre, post in ((0.5, 1.0), (1.0, 0.25), (2.0, 1.0 / 3.0)):
            got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=pre, postscale_factor=post,
                                name="scales.%s.%g.%g" % (dtype.name, pre, post))
            want = reference(arrays, "sum", dtype) * np.float64(np.float32(pre)) * \
                np.float64(np.float32(post))
            c.close(to_numpy(got), want, mag * pre * post, dtype,
                    "prescale %g postscale %g (%s)" % (pre, post, dtype.name))
        got = hvd.allreduce(x, op=hvd.Average, postscale_factor=3.0,
                            name="scales.avg.%s" % dtype.name)
        c.close(to_numpy(got), reference(arrays, "sum", dtype) * 3.0 / n, mag * 3.0 / n, dtype,
                "Average with postscale 3 (%s)" % dtype.name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with_average = hvd.allreduce(tf.constant([float(hvd.rank())]), average=False,
                                     name="deprecated.average")
    c.check(any(w.category is DeprecationWarning for w in caught), "average= warns deprecated")
    c.equal(with_average.numpy(), [sum(range(n))], "average=False means Sum")


def check_grouped(c):
    dtypes = [tf.float32, tf.int64, tf.float16, tf.float64, tf.int32, tf.bfloat16]
    for op_name in ("sum", "average", "max"):
        data = [per_rank(3000 + i, lambda g, d=d, i=i: random_array(g, d, (i + 1, 3)))
                for i, d in enumerate(dtypes)]
        outs = hvd.grouped_allreduce(
            [tf.constant(mine, dtype=d) for (_, mine), d in zip(data, dtypes)],
            op=OPS[op_name], name="grouped." + op_name)
        c.equal(len(outs), len(dtypes), "grouped_allreduce returns one tensor per input")
        for (arrays, _), d, out in zip(data, dtypes, outs):
            check_reduced(c, out, arrays, op_name, d, "grouped %s %s" % (op_name, d.name))
    c.equal(hvd.grouped_allreduce([], name="grouped.empty"), [], "grouped_allreduce([])")


def check_simulated_link_counts_buckets(c):
    """The simulated link (op_library.set_bucket_delay_for_testing) delays each
    bucket once and counts it; the benchmarks divide by that count."""
    from nvgroup_tf import op_library
    data = [per_rank(3100 + i, lambda g, i=i: random_array(g, tf.float32, (i + 2, 5))) for i in range(3)]
    op_library.set_bucket_delay_for_testing(50)
    try:
        before = op_library.delayed_buckets_for_testing()
        outs = hvd.grouped_allreduce([tf.constant(mine) for _, mine in data], op=hvd.Sum, name="link.grouped")
        for (arrays, _), out in zip(data, outs):
            check_reduced(c, out, arrays, "sum", tf.float32, "grouped sum under the simulated link")
        c.equal(op_library.delayed_buckets_for_testing() - before, 1, "one grouped allreduce: one delayed bucket")
        before = op_library.delayed_buckets_for_testing()
        for k, (arrays, mine) in enumerate(data[:2]):
            out = hvd.allreduce(tf.constant(mine), op=hvd.Sum, name="link.single%d" % k)
            check_reduced(c, out, arrays, "sum", tf.float32, "allreduce under the simulated link")
        c.equal(op_library.delayed_buckets_for_testing() - before, 2, "two allreduces one after the other: two")
    finally:
        op_library.set_bucket_delay_for_testing(0)
    before = op_library.delayed_buckets_for_testing()
    hvd.allreduce(tf.constant(data[0][1]), op=hvd.Sum, name="link.off")
    c.equal(op_library.delayed_buckets_for_testing() - before, 0, "no delay: nothing counted")


def check_allgather(c):
    n = hvd.size()
    for case, dtype in enumerate(ALL_DTYPES):
        for ndims in (1, 2, 3):
            tail = shape_for(4000 + case * 10 + ndims, ndims - 1)
            # Rank r contributes 2r rows: rank 0 none, first dims all differ.
            arrays = [random_array(np.random.default_rng([4000 + case, ndims, r]), dtype,
                                   (2 * r,) + tail) for r in range(n)]
            got = hvd.allgather(tf.constant(arrays[hvd.rank()], dtype=dtype),
                                name="gather.%s.%d" % (dtype.name, ndims))
            want = np.concatenate(arrays, axis=0)
            c.equal(to_numpy(got), to_numpy(tf.constant(want, dtype=dtype)),
                    "allgather %s rows %s tail %s" % (dtype.name, [2 * r for r in range(n)], tail))
    c.raises((tf.errors.InvalidArgumentError, ValueError),
             lambda: hvd.allgather(tf.constant(1.0), name="gather.scalar"),
             "allgather of a scalar", contains="rank")


def check_broadcast(c):
    n = hvd.size()
    for root in range(n):
        for case, dtype in enumerate(ALL_DTYPES):
            for ndims in range(4):
                shape = shape_for(5000 + case * 10 + ndims, ndims)
                arrays = [random_array(np.random.default_rng([5000 + case, ndims, r, root]), dtype,
                                       shape) for r in range(n)]
                got = hvd.broadcast(tf.constant(arrays[hvd.rank()], dtype=dtype), root,
                                    name="bcast.%d.%s.%d" % (root, dtype.name, ndims))
                c.equal(to_numpy(got), to_numpy(tf.constant(arrays[root], dtype=dtype)),
                        "broadcast root %d %s shape %s" % (root, dtype.name, shape))


def check_gradients(c, use_function):
    n, me = hvd.size(), hvd.rank()
    tag = "fn" if use_function else "eager"
    weights = [np.random.default_rng([6000, r]).normal(size=(4, 3)) for r in range(n)]
    w_sum = np.sum(weights, axis=0)
    w = tf.constant(weights[me])
    x = tf.constant(np.random.default_rng([6001, me]).normal(size=(4, 3)))
    maybe = tf.function if use_function else (lambda f: f)

    for op, pre, post, factor in ((hvd.Sum, 1.0, 1.0, 1.0), (hvd.Average, 1.0, 1.0, 1.0 / n),
                                  (hvd.Sum, 0.5, 4.0, 2.0)):
        @maybe
        def grad_allreduce(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post,
                                  name="grad.allreduce.%s.%d.%g" % (tag, op, pre))
                loss = tf.reduce_sum(y * w)
            return tape.gradient(loss, x)
        c.close(grad_allreduce(x).numpy(), w_sum * factor, np.abs(w_sum) + 1, tf.float64,
                "%s gradient of allreduce op %d pre %g post %g" % (tag, op, pre, post))

    @maybe
    def grad_grouped(a, b):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            ya, yb = hvd.grouped_allreduce([a, b], op=hvd.Sum, name="grad.grouped." + tag)
            loss = tf.reduce_sum(ya * w) + 2.0 * tf.reduce_sum(yb * w)
        return tape.gradient(loss, [a, b])
    ga, gb = grad_grouped(x, x * 2.0)
    c.close(ga.numpy(), w_sum, np.abs(w_sum) + 1, tf.float64, tag + " gradient of grouped[0]")
    c.close(gb.numpy(), 2 * w_sum, np.abs(w_sum) + 1, tf.float64, tag + " gradient of grouped[1]")

    rows = [r + 1 for r in range(n)]
    gw = [np.random.default_rng([6002, r]).normal(size=(sum(rows), 3)) for r in range(n)]
    gw_sum = np.sum(gw, axis=0)
    xg = tf.constant(np.random.default_rng([6003, me]).normal(size=(rows[me], 3)))

    @maybe
    def grad_allgather(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = hvd.allgather(x, name="grad.allgather." + tag)
            loss = tf.reduce_sum(y * tf.constant(gw[me]))
        return tape.gradient(loss, x)
    start = sum(rows[:me])
    gw_avg = gw_sum / n  # Horovod's allgather gradient averages over ranks
    c.close(grad_allgather(xg).numpy(), gw_avg[start:start + rows[me]], np.abs(gw_avg[start:start + rows[me]]) + 1,
            tf.float64, tag + " gradient of allgather = my rows of the averaged gradient (Horovod)")

    for root in range(n):
        @maybe
        def grad_broadcast(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = hvd.broadcast(x, root, name="grad.broadcast.%s.%d" % (tag, root))
                loss = tf.reduce_sum(y * w)
            return tape.gradient(loss, x)
        want = w_sum / n if me == root else np.zeros_like(w_sum)  # Horovod: averaged at the root
        c.close(grad_broadcast(x).numpy(), want, np.abs(w_sum) + 1, tf.float64,
                "%s gradient of broadcast from root %d" % (tag, root))


def check_in_tf_function(c):
    n = hvd.size()
    arrays, mine = per_rank(7000, lambda g: random_array(g, tf.float32, (6, 2)))
    rows = [np.random.default_rng([7001, r]).normal(size=(r + 2, 2)).astype(np.float32)
            for r in range(n)]

    @tf.function
    def step(x, y):
        s = hvd.allreduce(x, op=hvd.Sum, name="fn.sum")
        g = hvd.allgather(y, name="fn.gather")
        b = hvd.broadcast(x, n - 1, name="fn.bcast")
        grouped = hvd.grouped_allreduce([x, 2.0 * x], op=hvd.Max, name="fn.grouped")
        auto = hvd.allreduce(x, op=hvd.Min)  # unnamed: a name drawn at trace time
        return s, g, b, grouped, auto

    for repeat in range(3):  # the traced graph reruns with the same names
        s, g, b, grouped, auto = step(tf.constant(mine), tf.constant(rows[hvd.rank()]))
        what = "tf.function run %d: " % repeat
        check_reduced(c, s, arrays, "sum", tf.float32, what + "allreduce")
        c.equal(g.numpy(), np.concatenate(rows), what + "allgather")
        c.equal(b.numpy(), arrays[n - 1], what + "broadcast")
        check_reduced(c, grouped[0], arrays, "max", tf.float32, what + "grouped[0]")
        check_reduced(c, grouped[1], [2 * a for a in arrays], "max", tf.float32, what + "grouped[1]")
        check_reduced(c, auto, arrays, "min", tf.float32, what + "unnamed allreduce")
    c.check(step.experimental_get_tracing_count() == 1, "tf.function traced once")


def check_random_order(c):
    """200 named tensors, submitted in a different random order on every rank;
    the engine matches them by name."""
    count = 200
    data = [per_rank(8000 + i, lambda g, i=i: random_array(g, tf.float32, (i % 7 + 1, 3)))
            for i in range(count)]
    order = list(range(count))
    random.Random(hvd.rank() * 7919 + 1).shuffle(order)

    @tf.function
    def independent(xs):  # no data dependencies: the executor runs all at once
        outs = [None] * count
        for i in order:  # graph built in this rank's order
            outs[i] = hvd.allreduce(xs[i], op=hvd.Sum, name="order.fn.%d" % i)
        return outs

    outs = independent([tf.constant(mine) for _, mine in data])
    for i, (arrays, _) in enumerate(data):
        check_reduced(c, outs[i], arrays, "sum", tf.float32, "tf.function random order tensor %d" % i)

    results = [None] * count
    started = []

    def one(i):
        results[i] = hvd.allreduce(tf.constant(data[i][1]), op=hvd.Sum, name="order.thread.%d" % i)

    for i in order:  # eager, one thread per tensor, started in this rank's order
        t = threading.Thread(target=one, args=(i,))
        t.start()
        started.append(t)
    for t in started:
        t.join(timeout=120)
    c.check(not any(t.is_alive() for t in started), "threaded random-order allreduces finished")
    for i, (arrays, _) in enumerate(data):
        if results[i] is None:
            c.check(False, "threaded tensor %d has no result" % i)
        else:
            check_reduced(c, results[i], arrays, "sum", tf.float32, "threaded random order %d" % i)


def check_compression_sparse_objects(c):
    n, me = hvd.size(), hvd.rank()
    arrays, mine = per_rank(9000, lambda g: random_array(g, tf.float32, (50,)))
    got = hvd.allreduce(tf.constant(mine), op=hvd.Sum, compression=hvd.Compression.fp16,
                        name="fp16")
    c.equal(got.dtype, tf.float32, "fp16 compression returns the input dtype")
    halves = [tf.cast(tf.cast(a, tf.float16), tf.float64).numpy() for a in arrays]
    c.close(got.numpy(), np.sum(halves, axis=0), magnitude(arrays, "sum", n), tf.float16,
            "fp16-compressed allreduce")
    ints = hvd.allreduce(tf.constant([me + 1], tf.int32), op=hvd.Sum,
                         compression=hvd.Compression.fp16, name="fp16.int")
    c.equal(ints.numpy(), [n * (n + 1) // 2], "fp16 compression leaves ints alone")

    # IndexedSlices: values and indices gathered from every rank.
    values = [np.random.default_rng([9001, r]).normal(size=(r + 1, 4)) for r in range(n)]
    indices = [np.arange(r + 1, dtype=np.int64) * (r + 1) for r in range(n)]
    for op, scale in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / n)):
        sl = hvd.allreduce(tf.IndexedSlices(tf.constant(values[me]), tf.constant(indices[me]),
                                            tf.constant([64, 4], tf.int64)),
                           op=op, name="sparse.%d" % op)
        c.check(isinstance(sl, tf.IndexedSlices), "allreduce of IndexedSlices returns slices")
        c.close(sl.values.numpy(), np.concatenate(values) * scale, np.abs(np.concatenate(values)),
                tf.float64, "IndexedSlices values op %d" % op)
        c.equal(sl.indices.numpy(), np.concatenate(indices), "IndexedSlices indices op %d" % op)

    v = tf.Variable(np.random.default_rng([9002, me]).normal(size=(3, 2)))
    root_value = np.random.default_rng([9002, 1 % n]).normal(size=(3, 2))
    hvd.broadcast_variables([v], root_rank=1 % n)
    c.equal(v.numpy(), root_value, "broadcast_variables")
    obj = {"rank": me, "list": list(range(me + 2))}
    c.equal(str(hvd.broadcast_object(obj, root_rank=n - 1)),
            str({"rank": n - 1, "list": list(range(n + 1))}), "broadcast_object")
    c.equal(str(hvd.allgather_object(obj)),
            str([{"rank": r, "list": list(range(r + 2))} for r in range(n)]), "allgather_object")

    c.raises(NotImplementedError, lambda: hvd.allreduce(tf.ones([2]), op=hvd.Adasum),
             "Adasum", contains="Adasum")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        c.raises(ValueError, lambda: hvd.allreduce(tf.ones([2]), op=hvd.Sum, average=True),
                 "op and average together")
    # uint8 reduces, wrapping modulo 256 like TF's own uint8 add.
    n, r = hvd.size(), hvd.rank()
    got = hvd.allreduce(tf.constant([200, 7 * r + 1], tf.uint8), op=hvd.Sum, name="u8").numpy()
    c.equal(got.astype(np.int64), np.array([(200 * n) % 256, sum(7 * k + 1 for k in range(n)) % 256]),
            "allreduce of uint8 sums modulo 256")
    c.raises((TypeError, tf.errors.InvalidArgumentError, tf.errors.UnimplementedError),
             lambda: hvd.allreduce(tf.constant([True, False]), op=hvd.Sum, name="b8"),
             "allreduce of bool (not reducible)")
    c.check(hvd.mpi_ops.allreduce is hvd.allreduce, "hvd.mpi_ops.allreduce alias")


def main():
    hvd.init()
    c = Checker("collectives")
    c.section("check_topology")
    check_topology(c)
    c.section("check_allreduce_matrix")
    check_allreduce_matrix(c)
    c.section("check_average_and_scales")
    check_average_and_scales(c)
    c.section("check_grouped")
    check_grouped(c)
    c.section("check_simulated_link_counts_buckets")
    check_simulated_link_counts_buckets(c)
    c.section("check_allgather")
    check_allgather(c)
    c.section("check_broadcast")
    check_broadcast(c)
    c.section("check_gradients, use_function=False")
    check_gradients(c, use_function=False)
    c.section("check_gradients, use_function=True")
    check_gradients(c, use_function=True)
    c.section("check_in_tf_function")
    check_in_tf_function(c)
    c.section("check_random_order")
    check_random_order(c)
    c.section("check_compression_sparse_objects")
    check_compression_sparse_objects(c)
    c.finish()


if __name__ == "__main__":
    run(main)
