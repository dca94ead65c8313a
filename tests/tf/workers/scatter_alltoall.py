"""Horovod's TF ops beyond allreduce/allgather/broadcast, eager and in tf.function:
small integer dtypes and integer scale factors, reducescatter / grouped
reducescatter (Horovod's uneven split, rows bitwise equal to the allreduce's,
Horovod's gradient), alltoall with uneven and zero splits and its gradient,
grouped_allgather and its gradient, broadcast_ on variables, join, process
sets (static and dynamic, every collective, non-members rejected,
process_set_included_op), and the mismatch of one name used for different
collectives on different ranks (an error on every rank, within seconds)."""
import time

import numpy as np

from common import Checker, hvd, random_array, run, tf


def exact(arrays, op, n):
    s = np.stack([np.asarray(a, dtype=np.int64) for a in arrays]).sum(axis=0)
    return s if op == "sum" else np.sign(s) * (np.abs(s) // n)


def rows_of(dim0, r, n):
    return dim0 // n + (1 if r < dim0 % n else 0)


def start_of(dim0, r, n):
    return sum(rows_of(dim0, k, n) for k in range(r))


def bitwise_same_everywhere(c, t, what):
    """Every rank holds the same bits of `t` (allgather of its bytes)."""
    raw = tf.reshape(tf.io.decode_raw(tf.io.serialize_tensor(t), tf.uint8), [1, -1])
    everyone = hvd.allgather(raw, name="bits/" + what).numpy()
    c.check(all(np.array_equal(everyone[0], row) for row in everyone), "%s differs across ranks" % what)


def main():
    hvd.init()
    c = Checker("extra")
    me, n = hvd.rank(), hvd.size()

    c.section("small integer dtypes and integer scale factors")
    for dtype in (tf.uint8, tf.int8, tf.uint16, tf.int16):
        hi = 255 // n if dtype == tf.uint8 else (127 // n if dtype == tf.int8 else 1000)
        lo = 0 if dtype in (tf.uint8, tf.uint16) else -hi
        arrays = [np.random.default_rng([11, r]).integers(lo, hi + 1, (6, 4)).astype(dtype.as_numpy_dtype)
                  for r in range(n)]
        for op, name in ((hvd.Sum, "sum"), (hvd.Average, "average")):
            got = hvd.allreduce(tf.constant(arrays[me]), op=op, name="ints/%s/%s" % (dtype.name, name))
            c.equal(got.numpy(), exact(arrays, name, n).astype(dtype.as_numpy_dtype),
                    "allreduce %s %s" % (dtype.name, name))
        got = hvd.allreduce(tf.constant(arrays[me]), op=hvd.Max, name="ints/%s/max" % dtype.name)
        c.equal(got.numpy(), np.max(arrays, axis=0), "allreduce %s max" % dtype.name)
        g = hvd.allgather(tf.constant(arrays[me]), name="ints/%s/gather" % dtype.name)
        c.equal(g.numpy(), np.concatenate(arrays), "allgather %s" % dtype.name)
        b = hvd.broadcast(tf.constant(arrays[me]), n - 1, name="ints/%s/bcast" % dtype.name)
        c.equal(b.numpy(), arrays[n - 1], "broadcast %s" % dtype.name)
    for dtype in (tf.int32, tf.int64, tf.int16):
        arrays = [np.random.default_rng([12, r]).integers(-50, 51, (9,)).astype(dtype.as_numpy_dtype)
                  for r in range(n)]
        # Horovod's ScaleBuffer: trunc(x * pre), sum, trunc(sum * post / size for Average).
        pre = [np.trunc(a.astype(np.float64) * 3.0).astype(np.int64) for a in arrays]
        want = np.trunc(np.sum(pre, axis=0).astype(np.float64) * (0.5 / n)).astype(np.int64)
        got = hvd.allreduce(tf.constant(arrays[me]), op=hvd.Average, prescale_factor=3.0, postscale_factor=0.5,
                            name="iscale/%s" % dtype.name)
        c.equal(got.numpy().astype(np.int64), want, "scaled integer average %s" % dtype.name)

    c.section("reducescatter")
    for dtype in (tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int32, tf.int64, tf.int16):
        for dim0 in (1, n + 1, 2 * n - 1, 3 * n):
            for op, opname in ((hvd.Sum, "sum"), (hvd.Average, "average")):
                arrays = [random_array(np.random.default_rng([20, dim0, r]), dtype, (dim0, 3))
                          if dtype != tf.int16 else
                          np.random.default_rng([20, dim0, r]).integers(-99, 100, (dim0, 3)).astype(np.int16)
                          for r in range(n)]
                name = "rs/%s/%d/%s" % (dtype.name, dim0, opname)
                x = tf.constant(arrays[me])
                got = hvd.reducescatter(x, op=op, name=name)
                full = hvd.allreduce(x, op=op, name=name + "/full")
                a, k = start_of(dim0, me, n), rows_of(dim0, me, n)
                c.check(tuple(got.shape) == (k, 3), "%s: shape %s" % (name, got.shape))
                c.check(got.numpy().tobytes() == full.numpy()[a:a + k].tobytes(),
                        "%s: rows differ from the allreduce's" % name)
                if dtype.is_integer:
                    c.equal(got.numpy(), exact(arrays, opname, n)[a:a + k].astype(dtype.as_numpy_dtype), name)
                else:
                    ref = np.sum([tf.cast(v, tf.float64).numpy() for v in arrays], axis=0)
                    mag = np.sum([np.abs(tf.cast(v, tf.float64).numpy()) for v in arrays], axis=0)
                    if opname == "average":
                        ref, mag = ref / n, mag / n
                    c.close(tf.cast(got, tf.float64).numpy(), ref[a:a + k], mag[a:a + k], dtype, name)
                bitwise_same_everywhere(c, full, name)

    @tf.function
    def rs_graph(x, y):
        return hvd.reducescatter(x, op=hvd.Sum, name="rs.graph"), hvd.grouped_reducescatter(
            [x, y], op=hvd.Average, name="grs.graph", prescale_factor=2.0)

    xs = [np.random.default_rng([21, r]).normal(size=(2 * n + 1, 2)) for r in range(n)]
    ys = [np.random.default_rng([22, r]).normal(size=(n, 5)) for r in range(n)]
    for step in range(2):  # the second run comes through the response cache
        single, (g0, g1) = rs_graph(tf.constant(xs[me]), tf.constant(ys[me]))
        a, k = start_of(2 * n + 1, me, n), rows_of(2 * n + 1, me, n)
        sx, sy = np.sum(xs, axis=0), np.sum(ys, axis=0)
        c.close(single.numpy(), sx[a:a + k], np.sum(np.abs(xs), axis=0)[a:a + k], tf.float64, "rs in graph")
        c.close(g0.numpy(), 2 * sx[a:a + k] / n, np.sum(np.abs(xs), axis=0)[a:a + k], tf.float64, "grs[0]")
        c.close(g1.numpy(), 2 * sy[me:me + 1] / n, np.sum(np.abs(ys), axis=0)[me:me + 1], tf.float64, "grs[1]")

    # Gradient (Horovod's): Sum -> size * allgather(grad), Average -> allgather(grad).
    w = [np.random.default_rng([23, r]).normal(size=(rows_of(2 * n + 1, r, n), 2)) for r in range(n)]
    for op, factor in ((hvd.Sum, n), (hvd.Average, 1)):
        x = tf.constant(xs[me])
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = hvd.reducescatter(x, op=op, name="rs.grad.%d" % factor)
            loss = tf.reduce_sum(y * tf.constant(w[me]))
        c.close(tape.gradient(loss, x).numpy(), factor * np.concatenate(w), factor * np.abs(np.concatenate(w)),
                tf.float64, "reducescatter gradient x%d" % factor)
    c.raises(ValueError, lambda: hvd.reducescatter(tf.ones([2]), op=hvd.Max), "reducescatter op=Max")
    c.raises(NotImplementedError, lambda: hvd.reducescatter(tf.ones([2]), op=hvd.Adasum), "reducescatter Adasum")

    c.section("alltoall")

    def splits_of(seed, r):
        s = np.random.default_rng([seed, r]).integers(0, 4, n)
        s[(r + 1) % n] = 0  # a zero split on every rank
        return s

    for i, dtype in enumerate((tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int32, tf.int64, tf.uint8,
                               tf.int8, tf.uint16, tf.int16, tf.bool)):
        seed = 30 + i
        mine = splits_of(seed, me)
        data = [random_array(np.random.default_rng([seed, r]), dtype, (int(splits_of(seed, r).sum()), 3))
                for r in range(n)]
        out, received = hvd.alltoall(tf.constant(data[me]), splits=mine, name="a2a/%s" % dtype.name)
        want_recv = [int(splits_of(seed, r)[me]) for r in range(n)]
        c.equal(received.numpy(), want_recv, "alltoall %s received splits" % dtype.name)
        parts = [data[r][int(splits_of(seed, r)[:me].sum()):][:want_recv[r]] for r in range(n)]
        c.equal(np.asarray(out.numpy()).view(np.uint8) if dtype != tf.bool else out.numpy(),
                np.concatenate(parts).view(np.uint8) if dtype != tf.bool else np.concatenate(parts),
                "alltoall %s rows" % dtype.name)
    even = hvd.alltoall(tf.reshape(tf.range(2 * n * 2) + 100 * me, [2 * n, 2]), name="a2a.even")
    want = np.concatenate([np.arange(2 * n * 2).reshape(2 * n, 2)[2 * me:2 * me + 2] + 100 * r for r in range(n)])
    c.equal(even.numpy(), want, "alltoall without splits")
    c.raises(tf.errors.InvalidArgumentError, lambda: hvd.alltoall(tf.ones([2 * n + 1, 2]), name="a2a.bad"),
             "alltoall without splits, indivisible", contains="divisible")

    @tf.function
    def a2a_graph(x, s):
        return hvd.alltoall(x, splits=s, name="a2a.graph")

    mine = splits_of(40, me)
    xg = tf.constant(np.random.default_rng([40, me]).normal(size=(int(mine.sum()), 2)))
    for step in range(2):
        out, received = a2a_graph(xg, tf.constant(mine, tf.int32))
        c.equal(received.numpy(), [int(splits_of(40, r)[me]) for r in range(n)], "alltoall in graph step %d" % step)
    # Gradient: the rows go back (alltoall with the received splits).
    cw = tf.constant(np.random.default_rng([41, me]).normal(size=(int(received.numpy().sum()), 2)))
    with tf.GradientTape() as tape:
        tape.watch(xg)
        out, received = hvd.alltoall(xg, splits=mine, name="a2a.grad")
        loss = tf.reduce_sum(out * cw)
    back, _ = hvd.alltoall(cw, splits=received, name="a2a.grad.want")
    c.equal(tape.gradient(loss, xg).numpy(), back.numpy(), "alltoall gradient")

    c.section("grouped_allgather, broadcast_")
    parts = [[np.random.default_rng([50, k, r]).normal(size=(r + k + 1, 2)).astype(np.float32) for r in range(n)]
             for k in range(3)]
    x3 = [tf.constant(parts[k][me]) for k in range(3)]
    with tf.GradientTape() as tape:
        for t in x3:
            tape.watch(t)
        gathered = hvd.grouped_allgather(x3, name="gag")
        loss = tf.add_n([tf.reduce_sum(g * float(k + 1)) for k, g in enumerate(gathered)])
    for k in range(3):
        c.equal(gathered[k].numpy(), np.concatenate(parts[k]), "grouped allgather member %d" % k)
    grads = tape.gradient(loss, x3)
    for k in range(3):  # Horovod's allgather gradient: the average over ranks of (k+1) = k+1
        c.equal(grads[k].numpy(), np.full(parts[k][me].shape, float(k + 1), np.float32),
                "grouped allgather gradient %d" % k)
    variables = [tf.Variable(np.random.default_rng([51, k, me]).normal(size=(k + 2,))) for k in range(3)]
    root_values = [np.random.default_rng([51, k, n - 1]).normal(size=(k + 2,)) for k in range(3)]
    returned = hvd.broadcast_(variables, root_rank=n - 1, name="bcast_")
    for k in range(3):
        c.equal(variables[k].numpy(), root_values[k], "broadcast_ variable %d in place" % k)
        c.equal(returned[k].numpy(), root_values[k], "broadcast_ returned value %d" % k)

    c.section("same name, different collectives")
    start = time.monotonic()
    text = c.raises(tf.errors.FailedPreconditionError,
                    lambda: (hvd.allreduce(tf.ones([3]), name="same.name") if me == 0
                             else hvd.allgather(tf.ones([3]), name="same.name")),
                    "one name for allreduce and allgather")
    c.check(time.monotonic() - start < 20, "type mismatch took %.1f s" % (time.monotonic() - start))
    if text is not None:
        c.check("Mismatched collective types for 'same.name'" in text, "type mismatch text: %s" % text)
    c.equal(hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="same.name").numpy(), [n, n], "name usable afterwards")

    c.section("join")
    first, last = n - 1, 0
    if me == first:
        c.equal(int(hvd.join()), last, "join result on the first joiner")
    else:
        for step in range(3):
            v = tf.constant(np.random.default_rng([60, me]).normal(size=(4,)))
            got = hvd.allreduce(v, op=hvd.Average, name="join.avg")
            want = sum(np.random.default_rng([60, r]).normal(size=(4,)) for r in range(n) if r != first) / n
            c.close(got.numpy(), want, np.abs(want) + 1, tf.float64, "average with a joined rank, step %d" % step)
        c.raises(tf.errors.FailedPreconditionError, lambda: hvd.allgather(tf.ones([1]), name="join.gather"),
                 "allgather while a rank joined", contains="have joined")
        if me == last:
            time.sleep(1.0)
        c.equal(int(hvd.join()), last, "join result")

    c.section("process sets")
    evens = hvd.add_process_set([r for r in range(n) if r % 2 == 0])
    odds = hvd.add_process_set(hvd.ProcessSet([r for r in range(n) if r % 2 == 1]))
    mine_set = evens if me % 2 == 0 else odds
    other = odds if mine_set is evens else evens
    c.check(mine_set.included() and not other.included(), "included()")
    c.check(mine_set.rank() == mine_set.ranks.index(me) and mine_set.size() == len(mine_set.ranks), "rank/size")
    c.equal(int(hvd.process_set_included_op(mine_set.process_set_id)), 1, "process_set_included_op member")
    c.equal(int(hvd.process_set_included_op(other.process_set_id)), 0, "process_set_included_op other")
    c.equal(int(hvd.process_set_included_op(99)), -3, "process_set_included_op unknown")
    v = tf.constant(np.random.default_rng([70, me]).normal(size=(3, 2)))
    members = mine_set.ranks
    got = hvd.allreduce(v, op=hvd.Sum, name="ps.sum", process_set=mine_set)
    want = sum(np.random.default_rng([70, r]).normal(size=(3, 2)) for r in members)
    c.close(got.numpy(), want, np.abs(want) + 1, tf.float64, "allreduce in a set")
    g = hvd.allgather(v, name="ps.gather", process_set=mine_set)
    c.equal(g.numpy(), np.concatenate([np.random.default_rng([70, r]).normal(size=(3, 2)) for r in members]),
            "allgather in a set")
    b = hvd.broadcast(v, members[-1], name="ps.bcast", process_set=mine_set)
    c.equal(b.numpy(), np.random.default_rng([70, members[-1]]).normal(size=(3, 2)), "broadcast in a set")
    rs = hvd.reducescatter(v, op=hvd.Sum, name="ps.rs", process_set=mine_set)
    k = len(members)
    a, rows = start_of(3, members.index(me), k), rows_of(3, members.index(me), k)
    c.close(rs.numpy(), want[a:a + rows], np.abs(want[a:a + rows]) + 1, tf.float64, "reducescatter in a set")
    with tf.GradientTape() as tape:
        tape.watch(v)
        loss = tf.reduce_sum(hvd.allreduce(v, op=hvd.Sum, name="ps.grad", process_set=mine_set))
    c.equal(tape.gradient(loss, v).numpy(), np.full((3, 2), float(k)), "allreduce gradient stays in the set")
    # DistributedGradientTape over the set: the average of the members' gradients only.
    w = tf.Variable(np.random.default_rng([71, 0]).normal(size=(3, 2)))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * v)
    dist = hvd.DistributedGradientTape(tape, process_set=mine_set)
    want_avg = sum(np.random.default_rng([70, r]).normal(size=(3, 2)) for r in members) / k
    c.close(dist.gradient(loss, [w])[0].numpy(), want_avg, np.abs(want_avg) + 1, tf.float64,
            "DistributedGradientTape(process_set=) averages over the set")
    c.raises(TypeError, lambda: hvd.DistributedGradientTape(tf.GradientTape(), process_set=[0, 1]),
             "process_set that is not a ProcessSet", contains="ProcessSet")
    if n > 1:
        c.raises(tf.errors.InvalidArgumentError,
                 lambda: hvd.allreduce(v, name="ps.outsider", process_set=other), "collective on a foreign set",
                 contains="is not a member of process set")
    c.raises(ValueError, lambda: hvd.add_process_set([0] if me == 0 else [0, me]), "sets that disagree",
             contains="same ranks")
    c.check(hvd.remove_process_set(odds) and hvd.remove_process_set(evens), "remove_process_set")
    c.check(evens.process_set_id is None, "removed set unregistered")
    c.raises(ValueError, lambda: hvd.allreduce(v, process_set=evens), "collective on a removed set",
             contains="not registered")

    # Static registration through init(process_sets=...).
    hvd.shutdown()
    first_half = hvd.ProcessSet(range((n + 1) // 2))
    hvd.init(process_sets=[first_half])
    c.check(first_half.process_set_id == 1, "static set id %s" % first_half.process_set_id)
    if first_half.included():
        got = hvd.allreduce(tf.constant([float(me + 1)]), op=hvd.Sum, name="static", process_set=first_half)
        c.equal(got.numpy(), [float(sum(r + 1 for r in first_half.ranks))], "allreduce in a static set")
    c.equal(hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="static.all").numpy(), [float(n)], "global set")
    c.finish()


run(main)
