"""Horovod's collectives beyond allreduce/allgather/broadcast, under XLA
(tf.function(jit_compile=True); XLA CPU here, XLA GPU through the kit), in one
launch per rank count. The sections (command-line arguments):

    collectives  reducescatter (every dtype it takes, Sum/Average, scale
                 factors, Horovod's uneven split, fewer rows than ranks),
                 grouped reducescatter (mixed dtypes, one custom call),
                 alltoall (uneven and zero splits given as constants, as a
                 compile-time-constant argument or variable, the even
                 split, every dtype), grouped allgather, broadcast_ on variables, the
                 16-bit integer dtypes of the first four collectives, and
                 every lowered collective inside process sets: compiled by
                 XLA (the HLO holds our custom call), bit for bit equal to
                 the same collective without XLA, both checked against a
                 float64 / exact integer reference, identical on every rank.
    gradients    reducescatter and grouped reducescatter gradients
                 (Horovod's: the allgather of the upstream gradient, times
                 the set size for Sum, times the scale factors) and the
                 alltoall gradient (the rows go back) under XLA: bit for bit
                 the non-XLA gradient, and the float64 reference.
    errors       cross-rank mismatches of the new collectives inside an XLA
                 program (shape, op, dtype, member, trailing dimension) raise
                 FailedPreconditionError naming the tensor on every rank
                 within seconds; invalid alltoall splits on one rank raise
                 InvalidArgumentError on every rank at compile time; splits
                 that are not a compile-time constant, a collective on a
                 process set this rank is not in, and join (not lowered)
                 raise a clear error; the engine keeps working afterwards.

Several sections may be given; each rank prints "... N checks, 0 failures".
"""
import sys
import time

import numpy as np

from common import ALL_DTYPES, FLOAT_DTYPES, Checker, hvd, random_array, reference, run, tf, to_numpy
from xla import MAX_SECONDS, Digest, calls_per_collective, check_value, hlo_of, same_bytes

SMALL_INTS = [tf.uint8, tf.int8, tf.uint16, tf.int16]
# Every dtype reducescatter takes (ops/nvgroup_negotiated_output_ops.cc).
RS_DTYPES = SMALL_INTS + [tf.int32, tf.int64] + FLOAT_DTYPES
EVERY_DTYPE = ALL_DTYPES + [tf.uint16, tf.int16]
CUSTOM_CALL = 'custom_call_target="nvgroup_collective'



def data(rng, dtype, shape):
    """Random values; small integers stay small enough that a sum over 4 ranks
    cannot wrap (the reference is exact integer arithmetic)."""
    bounds = {tf.uint8: (0, 60), tf.int8: (-30, 30), tf.uint16: (0, 16000), tf.int16: (-8000, 8000)}
    if dtype in bounds:
        lo, hi = bounds[dtype]
        return rng.integers(lo, hi + 1, size=shape).astype(dtype.as_numpy_dtype)
    return random_array(rng, dtype, shape)


def rows_of(dim0, k, size):
    """Horovod's reducescatter split: ranks below dim0 % size get one more row."""
    return dim0 // size + (1 if k < dim0 % size else 0)


def start_of(dim0, k, size):
    return sum(rows_of(dim0, j, size) for j in range(k))


def xla_and_tf(fn):
    """fn(suffix) -> (the XLA-compiled function, the same without XLA)."""
    return tf.function(fn(".xla"), jit_compile=True), tf.function(fn(".tf"), jit_compile=False)


ON_GPU = bool(tf.config.list_physical_devices("GPU"))


def run_both(c, what, f_xla, f_tf, *args):
    """(XLA result, non-XLA result). On a GPU, a reduction the CUDA engine does
    not implement (8/16-bit integers, types.h) fails both ways alike: then the
    XLA error must be the non-XLA one's class, and None is returned."""
    try:
        want = f_tf(*args)
    except tf.errors.UnimplementedError as e:
        if not ON_GPU:
            raise
        c.raises(tf.errors.UnimplementedError, lambda: f_xla(*args), what + " (unimplemented on CUDA)")
        print("%s %s: unimplemented on CUDA without and with XLA: %s" % (c.prefix, what, e.message[:120]))
        return None
    return f_xla(*args), want


def compare(c, got_xla, got_tf, want, inputs, dtype, op, what):
    """XLA result bitwise the non-XLA one, and close to (integers: equal to) the reference."""
    a, b = to_numpy(got_xla), to_numpy(got_tf)
    same_bytes(c, a, b, what)
    check_value(c, a, want, inputs, dtype, op, what)
    return a


def gathered(t, name, process_set):
    """Every member's `t` (first dimensions may differ), eagerly: for results that
    differ by rank, what must be bitwise the same on every rank."""
    return to_numpy(hvd.allgather(t, name=name + ".gathered", process_set=process_set))


def check_reducescatter(c, digest, members, my_index, process_set=None, tag="rs", dtypes=RS_DTYPES):
    """Reducescatter over `members` (ranks; this rank is members[my_index])."""
    k = len(members)
    for dtype in dtypes:
        for op_name, op in (("sum", hvd.Sum), ("average", hvd.Average)):
            scales = [(1.0, 1.0)]
            if op_name == "sum" and (dtype.is_floating or dtype == tf.int32):
                scales.append((0.5, 3.0) if dtype.is_floating else (2.0, 1.0))
            for pre, post in scales:
                dim0 = 2 * k + 1  # uneven: the first rank gets one more row
                inputs = [data(np.random.default_rng([11, r, len(op_name)]), dtype, (dim0, 3)) for r in members]
                name = "%s.%s.%s.%g.%g" % (tag, dtype.name, op_name, pre, post)
                f_xla, f_tf = xla_and_tf(lambda suffix: lambda t: hvd.reducescatter(
                    t, op=op, prescale_factor=pre, postscale_factor=post, name=name + suffix,
                    process_set=process_set))
                x = tf.constant(inputs[my_index])
                both = run_both(c, name, f_xla, f_tf, x)
                if both is None:
                    continue
                got_xla, got_tf = both
                a, rows = start_of(dim0, my_index, k), rows_of(dim0, my_index, k)
                if dtype.is_integer and (pre, post) != (1.0, 1.0):
                    # Horovod's ScaleBuffer: trunc(x * pre), sum, trunc(sum * post).
                    scaled = [np.trunc(i.astype(np.float64) * pre).astype(np.int64) for i in inputs]
                    want = np.trunc(np.sum(scaled, axis=0).astype(np.float64) * post).astype(np.int64)
                else:
                    want = reference(inputs, op_name, dtype)
                    if dtype.is_floating:
                        want = want * pre * post
                mine = [i[a:a + rows] for i in inputs]
                c.check(tuple(got_xla.shape) == (rows, 3), "%s: XLA result shape %s, want %s" % (
                    name, got_xla.shape, (rows, 3)))
                compare(c, got_xla, got_tf, want[a:a + rows], mine, dtype, op_name, name)
                # The members' rows together are bitwise the allreduce's (same op and scales).
                full = to_numpy(hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post,
                                              name=name + ".allreduce", process_set=process_set))
                rows_everywhere = gathered(got_xla, name, process_set)
                same_bytes(c, rows_everywhere, full, name + ": the members' rows vs the allreduce")
                digest.add(rows_everywhere)
    # Fewer rows than ranks: some ranks get none.
    dim0 = k - 1 if k > 1 else 1
    inputs = [data(np.random.default_rng([12, r]), tf.float32, (dim0, 2)) for r in members]
    f_xla, f_tf = xla_and_tf(lambda suffix: lambda t: hvd.reducescatter(
        t, op=hvd.Sum, name=tag + ".few" + suffix, process_set=process_set))
    x = tf.constant(inputs[my_index])
    a, rows = start_of(dim0, my_index, k), rows_of(dim0, my_index, k)
    got = f_xla(x)
    c.check(tuple(got.shape) == (rows, 2), "%s.few: shape %s, want %s" % (tag, got.shape, (rows, 2)))
    compare(c, got, f_tf(x), reference(inputs, "sum", tf.float32)[a:a + rows],
            [i[a:a + rows] for i in inputs], tf.float32, "sum", tag + ".few rows")
    digest.add(gathered(got, tag + ".few", process_set))


def check_grouped_reducescatter(c, digest, members, my_index, process_set=None, tag="grs"):
    k = len(members)
    dtypes = [tf.float32, tf.float64, tf.int32, tf.bfloat16, tf.int16]
    shapes = [(3 * k + 2, 2), (k, 5), (2 * k - 1, 1, 2), (k + 1,), (1, 3)]
    per_rank = [[data(np.random.default_rng([13, r, i]), d, s) for i, (d, s) in enumerate(zip(dtypes, shapes))]
                for r in members]
    for op_name, op in (("sum", hvd.Sum), ("average", hvd.Average)):
        name = "%s.%s" % (tag, op_name)

        def fn(suffix):
            return lambda ts: hvd.grouped_reducescatter(ts, op=op, name=name + suffix, process_set=process_set)
        f_xla, f_tf = xla_and_tf(fn)
        xs = [tf.constant(a) for a in per_rank[my_index]]
        both = run_both(c, name, f_xla, f_tf, xs)
        if both is None:
            continue
        got_xla, got_tf = both
        for i, d in enumerate(dtypes):
            dim0 = shapes[i][0]
            a, rows = start_of(dim0, my_index, k), rows_of(dim0, my_index, k)
            inputs = [p[i] for p in per_rank]
            compare(c, got_xla[i], got_tf[i], reference(inputs, op_name, d)[a:a + rows],
                    [x[a:a + rows] for x in inputs], d, op_name, "%s[%d] %s" % (name, i, d.name))
            digest.add(gathered(got_xla[i], "%s[%d]" % (name, i), process_set))
    text = hlo_of(tf.function(fn(".hlo"), jit_compile=True), [tf.constant(a) for a in per_rank[my_index]])
    c.check(text.count(CUSTOM_CALL) == calls_per_collective(), "a grouped reducescatter must lower to one custom call:\n%s" % text[:2000])


def splits_of(sender, k):
    """Rows rank `sender` (index in the set) sends to each of the k ranks: uneven, with zeros."""
    return [(sender + 2 * j) % 3 for j in range(k)]


def check_alltoall(c, digest, members, my_index, process_set=None, tag="a2a", dtypes=EVERY_DTYPE):
    k = len(members)
    for dtype in dtypes:
        splits = [splits_of(s, k) for s in range(k)]
        inputs = [data(np.random.default_rng([14, r]), dtype, (sum(splits[i]), 2)) for i, r in enumerate(members)]
        name = "%s.%s" % (tag, dtype.name)
        mine = splits[my_index]
        f_xla, f_tf = xla_and_tf(lambda suffix: lambda t: hvd.alltoall(t, splits=mine, name=name + suffix,
                                                                       process_set=process_set))
        x = tf.constant(inputs[my_index])
        (out_xla, recv_xla), (out_tf, recv_tf) = f_xla(x), f_tf(x)
        want_recv = [splits[s][my_index] for s in range(k)]
        want = np.concatenate([inputs[s][sum(splits[s][:my_index]):sum(splits[s][:my_index + 1])]
                               for s in range(k)])
        c.equal(recv_xla.numpy(), want_recv, name + " received splits (XLA)")
        c.equal(recv_tf.numpy(), want_recv, name + " received splits (TF)")
        same_bytes(c, to_numpy(out_xla), to_numpy(out_tf), name)
        c.equal(to_numpy(out_xla), to_numpy(tf.constant(want)), name + " vs the rows sent here")
        digest.add(gathered(out_xla, name, process_set))
    # Splits as an argument of the compiled function: a compile-time constant
    # of each compilation (TF compiles once per value).
    f = tf.function(lambda t, s: hvd.alltoall(t, splits=s, name=tag + ".arg", process_set=process_set),
                    jit_compile=True)
    for shift in (0, 1):
        splits = [[(s + j + shift) % 2 + 1 for j in range(k)] for s in range(k)]
        inputs = [data(np.random.default_rng([15, shift, r]), tf.float32, (sum(splits[i]), 3))
                  for i, r in enumerate(members)]
        out, recv = f(tf.constant(inputs[my_index]), tf.constant(splits[my_index]))
        want = np.concatenate([inputs[s][sum(splits[s][:my_index]):sum(splits[s][:my_index + 1])]
                               for s in range(k)])
        c.equal(recv.numpy(), [splits[s][my_index] for s in range(k)], "%s.arg %d received" % (tag, shift))
        c.equal(out.numpy(), want, "%s.arg %d rows" % (tag, shift))
        digest.add(gathered(out, "%s.arg.%d" % (tag, shift), process_set))
    # Splits read from a variable: TF compiles once per value of the variable.
    # Not on a GPU: TF keeps an int32 variable in host memory, and an XLA GPU
    # cluster cannot read a variable of another device (TF's known issue
    # "tf.Variable on a different device", whatever op reads it).
    var = tf.Variable([1] * k)
    f = tf.function(lambda t: hvd.alltoall(t, splits=var.read_value(), name=tag + ".var", process_set=process_set),
                    jit_compile=True)
    for shift in (() if ON_GPU else (0, 1)):
        splits = [[(s * j + shift) % 3 for j in range(k)] for s in range(k)]
        var.assign(splits[my_index])
        inputs = [data(np.random.default_rng([24, shift, r]), tf.int64, (sum(splits[i]), 2))
                  for i, r in enumerate(members)]
        out, recv = f(tf.constant(inputs[my_index]))
        want = np.concatenate([inputs[s][sum(splits[s][:my_index]):sum(splits[s][:my_index + 1])]
                               for s in range(k)])
        c.equal(recv.numpy(), [splits[s][my_index] for s in range(k)], "%s.var %d received" % (tag, shift))
        c.equal(out.numpy(), want, "%s.var %d rows" % (tag, shift))
        digest.add(gathered(out, "%s.var.%d" % (tag, shift), process_set))
    # No splits: dimension 0 split evenly.
    inputs = [data(np.random.default_rng([16, r]), tf.int32, (2 * k, 2)) for r in members]
    f_xla, f_tf = xla_and_tf(lambda suffix: lambda t: hvd.alltoall(t, name=tag + ".even" + suffix,
                                                                   process_set=process_set))
    x = tf.constant(inputs[my_index])
    want = np.concatenate([inputs[s][2 * my_index:2 * my_index + 2] for s in range(k)])
    got = f_xla(x).numpy()
    same_bytes(c, got, f_tf(x).numpy(), tag + ".even")
    c.equal(got, want, tag + ".even vs the rows sent here")
    digest.add(gathered(tf.constant(got), tag + ".even", process_set))
    text = hlo_of(tf.function(lambda t: hvd.alltoall(t, splits=splits_of(my_index, k), name=tag + ".hlo",
                                                     process_set=process_set), jit_compile=True),
                  tf.zeros([sum(splits_of(my_index, k)), 2]))
    c.check(text.count(CUSTOM_CALL) == calls_per_collective() and tag + ".hlo" in text, "alltoall HLO lacks the custom call:\n%s"
            % text[:2000])


def check_first_four(c, digest, members, my_index, process_set=None, tag="ps", dtypes=EVERY_DTYPE):
    """allreduce, grouped allreduce, allgather, grouped allgather, broadcast over `members`."""
    for dtype in [d for d in (tf.float32, tf.int64, tf.uint16, tf.int16, tf.int8) if d in dtypes]:
        inputs = [data(np.random.default_rng([17, r]), dtype, (4, 3)) for r in members]
        x = tf.constant(inputs[my_index])
        name = "%s.ar.%s" % (tag, dtype.name)
        f_xla, f_tf = xla_and_tf(lambda suffix: lambda t: hvd.allreduce(t, op=hvd.Sum, name=name + suffix,
                                                                        process_set=process_set))
        both = run_both(c, name, f_xla, f_tf, x)
        if both is None:
            continue
        digest.add(compare(c, both[0], both[1], reference(inputs, "sum", dtype), inputs, dtype, "sum", name))
        name = "%s.gar.%s" % (tag, dtype.name)
        f_xla, f_tf = xla_and_tf(lambda suffix: lambda t: hvd.grouped_allreduce(
            [t, t[:1]], op=hvd.Sum, name=name + suffix, process_set=process_set))
        g_xla, g_tf = run_both(c, name, f_xla, f_tf, x)  # not None: the plain allreduce of this dtype ran
        digest.add(compare(c, g_xla[0], g_tf[0], reference(inputs, "sum", dtype), inputs, dtype, "sum", name))
        digest.add(compare(c, g_xla[1], g_tf[1], reference([i[:1] for i in inputs], "sum", dtype),
                           [i[:1] for i in inputs], dtype, "sum", name + "[1]"))
    for dtype in dtypes:
        inputs = [data(np.random.default_rng([18, r]), dtype, (i + 1, 2)) for i, r in enumerate(members)]
        x = tf.constant(inputs[my_index])
        name = "%s.ag.%s" % (tag, dtype.name)
        f_xla, f_tf = xla_and_tf(lambda suffix: lambda t: hvd.allgather(t, name=name + suffix,
                                                                        process_set=process_set))
        got = to_numpy(f_xla(x))
        same_bytes(c, got, to_numpy(f_tf(x)), name)
        c.equal(got, to_numpy(tf.constant(np.concatenate(inputs))), name + " vs concatenation")
        digest.add(got)
        name = "%s.gag.%s" % (tag, dtype.name)
        f_xla, f_tf = xla_and_tf(lambda suffix: lambda t: hvd.grouped_allgather(
            [t, t[:1]], name=name + suffix, process_set=process_set))
        g_xla, g_tf = f_xla(x), f_tf(x)
        for j, want in enumerate((np.concatenate(inputs), np.concatenate([i[:1] for i in inputs]))):
            same_bytes(c, to_numpy(g_xla[j]), to_numpy(g_tf[j]), "%s[%d]" % (name, j))
            c.equal(to_numpy(g_xla[j]), to_numpy(tf.constant(want)), "%s[%d] vs concatenation" % (name, j))
            digest.add(to_numpy(g_xla[j]))
        root = members[-1]  # a rank of the global set, as Horovod's root_rank
        name = "%s.bc.%s" % (tag, dtype.name)
        f_xla, f_tf = xla_and_tf(lambda suffix: lambda t: hvd.broadcast(t, root, name=name + suffix,
                                                                        process_set=process_set))
        x = tf.constant(inputs[my_index][:1])
        got = to_numpy(f_xla(x))
        same_bytes(c, got, to_numpy(f_tf(x)), name)
        c.equal(got, to_numpy(tf.constant(inputs[-1][:1])), name + " vs the root's tensor")
        digest.add(got)


def check_broadcast_in_place(c, digest, members, my_index, process_set=None, tag="bc_"):
    for root_index in range(len(members)):
        root = members[root_index]
        # On a GPU TF keeps an int32 variable in host memory, which an XLA GPU
        # cluster cannot read (TF's "tf.Variable on a different device"): the
        # integer variable is int64 there.
        integer = tf.int64 if ON_GPU else tf.int32
        values = [[data(np.random.default_rng([19, r, j]), d, s) for j, (d, s) in
                   enumerate(((tf.float32, (3, 2)), (integer, (4,)), (tf.float64, (1, 2, 2))))]
                  for r in members]
        got = {}
        for mode in ("xla", "tf"):
            variables = [tf.Variable(v) for v in values[my_index]]
            name = "%s.%d.%s" % (tag, root, mode)
            step = tf.function(lambda: hvd.broadcast_(variables, root, name=name, process_set=process_set),
                               jit_compile=mode == "xla")
            returned = step()
            got[mode] = [v.numpy() for v in variables]
            for j, want in enumerate(values[root_index]):
                c.equal(got[mode][j], want, "%s variable %d in place" % (name, j))
                c.equal(returned[j].numpy(), want, "%s returned value %d" % (name, j))
        for j in range(len(got["xla"])):
            same_bytes(c, got["xla"][j], got["tf"][j], "%s.%d variable %d" % (tag, root, j))
            digest.add(got["xla"][j])


def section_collectives(c, digest):
    me, n = hvd.rank(), hvd.size()
    everyone = list(range(n))
    c.section("reducescatter: every dtype, Sum/Average, scale factors, uneven split")
    check_reducescatter(c, digest, everyone, me)
    probe = tf.function(lambda t: hvd.reducescatter(t, op=hvd.Sum, name="rs.hlo.probe"), jit_compile=True)
    text = hlo_of(probe, tf.ones([2 * n + 1, 2]))
    c.check(text.count(CUSTOM_CALL) == calls_per_collective() and "rs.hlo.probe" in text,
            "reducescatter HLO lacks the nvgroup custom call:\n%s" % text[:2000])
    if tf.config.list_physical_devices("GPU"):  # through the GPU kit: XLA GPU, the CUDA handler
        c.check("GPU" in probe(tf.ones([2 * n + 1, 2])).device, "the XLA program did not run on the GPU")
    c.section("grouped reducescatter: mixed dtypes and shapes, one custom call")
    check_grouped_reducescatter(c, digest, everyone, me)
    c.section("alltoall: uneven and zero splits, splits as an argument, even split, every dtype")
    check_alltoall(c, digest, everyone, me)
    c.section("allreduce / grouped allreduce / (grouped) allgather / broadcast: 16-bit integers and more")
    check_first_four(c, digest, everyone, me, tag="all")
    c.section("broadcast_ (in place) under XLA")
    check_broadcast_in_place(c, digest, everyone, me)

    if n == 1:  # no second set to run beside the first
        return
    c.section("every lowered collective inside process sets (evens and odds)")
    evens = hvd.add_process_set([r for r in range(n) if r % 2 == 0])
    odds = hvd.add_process_set([r for r in range(n) if r % 2 == 1])
    mine = evens if me % 2 == 0 else odds
    members, index = mine.ranks, mine.ranks.index(me)
    some = [tf.float32, tf.bfloat16, tf.int16, tf.uint8, tf.bool]  # the dtype sweep ran above
    check_first_four(c, digest, members, index, mine, tag="ps", dtypes=some)
    check_reducescatter(c, digest, members, index, mine, tag="ps.rs", dtypes=some[:-1])
    check_grouped_reducescatter(c, digest, members, index, mine, tag="ps.grs")
    check_alltoall(c, digest, members, index, mine, tag="ps.a2a", dtypes=some)
    check_broadcast_in_place(c, digest, members, index, mine, tag="ps.bc_")
    # Digests differ between the sets' members by design; compare within each set only.
    c.check(hvd.remove_process_set(odds) and hvd.remove_process_set(evens), "remove_process_set")


def section_gradients(c, digest):
    me, n = hvd.rank(), hvd.size()
    c.section("reducescatter gradients under XLA: Horovod's (allgather of the gradient, scaled)")
    for dtype in (tf.float32, tf.float64):
        for op_name, op, pre, post in (("sum", hvd.Sum, 1.0, 1.0), ("average", hvd.Average, 1.0, 1.0),
                                       ("sum", hvd.Sum, 0.5, 4.0), ("average", hvd.Average, 2.0, 0.25)):
            dim0 = 2 * n + 1
            xs = [data(np.random.default_rng([20, r]), dtype, (dim0, 3)) for r in range(n)]
            cws = [data(np.random.default_rng([21, r]), dtype, (rows_of(dim0, r, n), 3)) for r in range(n)]
            name = "g.rs.%s.%s.%g.%g" % (dtype.name, op_name, pre, post)

            def fn(suffix):
                def grad(x, cw):
                    with tf.GradientTape() as tape:
                        tape.watch(x)
                        y = hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post,
                                              name=name + suffix)
                        loss = tf.reduce_sum(y * cw)
                    return tape.gradient(loss, x)
                return grad
            f_xla, f_tf = xla_and_tf(fn)
            x, cw = tf.constant(xs[me]), tf.constant(cws[me])
            g_xla, g_tf = f_xla(x, cw).numpy(), f_tf(x, cw).numpy()
            same_bytes(c, g_xla, g_tf, name + " gradient")
            scale = pre * post * (n if op_name == "sum" else 1)
            want = np.concatenate(cws).astype(np.float64) * scale
            c.close(g_xla, want, np.abs(want), dtype, name + " gradient vs reference")
            digest.add(g_xla)
    c.section("grouped reducescatter gradient under XLA")
    shapes = [(2 * n + 1, 2), (n, 3)]
    xs = [[data(np.random.default_rng([22, r, i]), tf.float32, s) for i, s in enumerate(shapes)] for r in range(n)]
    cws = [[data(np.random.default_rng([23, r, i]), tf.float32, (rows_of(s[0], r, n),) + s[1:])
            for i, s in enumerate(shapes)] for r in range(n)]

    def fn(suffix):
        def grad(a, b, ca, cb):
            with tf.GradientTape() as tape:
                tape.watch([a, b])
                ya, yb = hvd.grouped_reducescatter([a, b], op=hvd.Sum, name="g.grs" + suffix)
                loss = tf.reduce_sum(ya * ca) + tf.reduce_sum(yb * cb)
            return tape.gradient(loss, [a, b])
        return grad
    f_xla, f_tf = xla_and_tf(fn)
    args = [tf.constant(v) for v in xs[me] + cws[me]]
    got_xla, got_tf = f_xla(*args), f_tf(*args)
    for i in range(2):
        same_bytes(c, got_xla[i].numpy(), got_tf[i].numpy(), "grouped gradient %d" % i)
        want = np.concatenate([cw[i] for cw in cws]).astype(np.float64) * n
        c.close(got_xla[i].numpy(), want, np.abs(want), tf.float32, "grouped gradient %d vs reference" % i)
        digest.add(got_xla[i].numpy())
    c.section("alltoall gradient under XLA")
    check_alltoall_gradient(c, digest)


def check_alltoall_gradient(c, digest):
    """Horovod's alltoall gradient (the rows go back, alltoall with the received
    splits): under XLA those splits are a constant of the compiled program."""
    me, n = hvd.rank(), hvd.size()
    splits = [[(s + j) % 2 + 1 for j in range(n)] for s in range(n)]
    xs = [data(np.random.default_rng([25, r]), tf.float64, (sum(splits[r]), 2)) for r in range(n)]
    rows_here = sum(splits[s][me] for s in range(n))
    cws = [data(np.random.default_rng([26, r]), tf.float64, (sum(splits[s][r] for s in range(n)), 2))
           for r in range(n)]

    def fn(suffix):
        def grad(x, cw):
            with tf.GradientTape() as tape:
                tape.watch(x)
                out, _ = hvd.alltoall(x * x, splits=splits[me], name="g.a2a" + suffix)
                loss = tf.reduce_sum(out * cw)
            return tape.gradient(loss, x)
        return grad
    f_xla, f_tf = xla_and_tf(fn)
    x, cw = tf.constant(xs[me]), tf.constant(cws[me])
    c.check(cws[me].shape[0] == rows_here, "alltoall gradient: test setup")
    g_xla, g_tf = f_xla(x, cw).numpy(), f_tf(x, cw).numpy()
    same_bytes(c, g_xla, g_tf, "alltoall gradient")
    # Rows this rank sent to rank j come back from j's upstream gradient, at j's
    # offset for this rank: d/dx sum(alltoall(x*x) * cw) = 2x * (those rows).
    back = np.concatenate([cws[j][sum(splits[s][j] for s in range(me)):][:splits[me][j]] for j in range(n)])
    want = 2 * xs[me] * back
    c.close(g_xla, want, np.abs(want), tf.float64, "alltoall gradient vs reference")
    digest.add(gathered(tf.constant(g_xla), "g.a2a", None))


def expect_error(c, error, what, name, fn, contains=None):
    """`fn` raises `error` naming `name` (and `contains`) within MAX_SECONDS,
    and the engine works afterwards."""
    start = time.monotonic()
    message = c.raises(error, fn, what)
    elapsed = time.monotonic() - start
    c.check(elapsed < MAX_SECONDS, "%s: took %.1f s to fail" % (what, elapsed))
    if message is not None:
        for part in (name, contains):
            if part is not None:
                c.check(part in message, "%s: message does not name %r: %s" % (what, part, message[:2000]))
    ok = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="after." + what)
    c.equal(ok.numpy(), [float(hvd.size())], "allreduce after " + what)


def section_errors(c, digest):
    me, n = hvd.rank(), hvd.size()
    odd = me == 0

    def xla(fn):
        return tf.function(fn, jit_compile=True)

    FP = tf.errors.FailedPreconditionError
    expect_error(c, FP, "XLA reducescatter shape mismatch", "xrs.shape", lambda: xla(
        lambda t: hvd.reducescatter(t, op=hvd.Sum, name="xrs.shape"))(tf.ones([n + (1 if odd else 2), 3])))
    expect_error(c, FP, "XLA reducescatter op mismatch", "xrs.op", lambda: xla(
        lambda t: hvd.reducescatter(t, op=hvd.Average if odd else hvd.Sum, name="xrs.op"))(tf.ones([n, 2])))
    expect_error(c, FP, "XLA reducescatter dtype mismatch", "xrs.dtype", lambda: xla(
        lambda t: hvd.reducescatter(t, op=hvd.Sum, name="xrs.dtype"))(
            tf.ones([n, 2], tf.float64 if odd else tf.float32)))
    expect_error(c, FP, "XLA grouped reducescatter member mismatch", "xrs.grouped", lambda: xla(
        lambda a, b: hvd.grouped_reducescatter([a, b], op=hvd.Sum, name="xrs.grouped"))(
            tf.ones([n, 2]), tf.ones([n, 3] if odd else [n, 4])))
    expect_error(c, FP, "XLA alltoall trailing-dimension mismatch", "xa2a.tail", lambda: xla(
        lambda t: hvd.alltoall(t, splits=[1] * n, name="xa2a.tail"))(tf.ones([n, 2] if odd else [n, 3])))
    expect_error(c, FP, "XLA grouped allgather member mismatch", "xgag", lambda: xla(
        lambda a, b: hvd.grouped_allgather([a, b], name="xgag"))(tf.ones([2, 2]), tf.ones([1, 3] if odd else [1, 4])))
    # Invalid splits on one rank: every rank's compilation fails (the splits are
    # agreed at compile time), the bad rank naming its splits.
    bad = [n + 1] + [0] * (n - 1) if odd else [1] * n
    expect_error(c, tf.errors.InvalidArgumentError, "XLA alltoall invalid splits on rank 0", "xa2a.bad",
                 lambda: xla(lambda t: hvd.alltoall(t, splits=bad, name="xa2a.bad"))(tf.ones([n, 2])),
                 contains="sum to" if odd else "splits of rank 0")
    # Splits that cannot be a compile-time constant (from a stateful random op;
    # arguments and variables can, check_alltoall): TF's own compile error names
    # the input; no collective has started.
    expect_error(c, tf.errors.InvalidArgumentError, "XLA alltoall with run-time splits", "NvgroupAlltoall",
                 lambda: xla(lambda t: hvd.alltoall(t, splits=tf.random.uniform([n], 1, 2, dtype=tf.int32),
                                                    name="xa2a.random"))(tf.ones([n, 2])),
                 contains="must be a compile-time constant")
    if n > 1:
        solo = hvd.add_process_set([0])
        if me != 0:
            for what, fn in (("reducescatter", lambda t: hvd.reducescatter(t, name="xps.rs", process_set=solo)),
                             ("allreduce", lambda t: hvd.allreduce(t, name="xps.ar", process_set=solo)),
                             ("alltoall", lambda t: hvd.alltoall(t, splits=[2], name="xps.a2a", process_set=solo))):
                start = time.monotonic()
                c.raises(tf.errors.InvalidArgumentError, lambda: xla(fn)(tf.ones([2, 2])),
                         "XLA %s on a process set without this rank" % what,
                         contains="is not a member of process set %d" % solo.process_set_id)
                c.check(time.monotonic() - start < MAX_SECONDS, "XLA %s on a foreign set: too slow" % what)
        c.check(hvd.remove_process_set(solo), "remove_process_set")
    # join is not lowered: TF names the op it has no XLA kernel for.
    start = time.monotonic()
    c.raises(Exception, lambda: xla(lambda: hvd.join())(), "join under XLA", contains="NvgroupJoin")
    c.check(time.monotonic() - start < MAX_SECONDS, "join under XLA: too slow to fail")
    ok = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="after.join")
    c.equal(ok.numpy(), [float(n)], "allreduce after join under XLA")
    digest.add(np.zeros(1))


def main():
    tf.get_logger().setLevel("ERROR")  # every check compiles functions of its own: no retracing warnings
    # GPU: full fp32 matmuls, so tolerances mean the same as on CPU.
    tf.config.experimental.enable_tensor_float_32_execution(False)
    hvd.init()
    c = Checker("xla_scatter_alltoall")
    digest = Digest()
    sections = {"collectives": section_collectives, "gradients": section_gradients, "errors": section_errors}
    for name in sys.argv[1:]:
        sections[name](c, digest)
    mine = digest.h.hexdigest()
    every = hvd.allgather_object(mine)
    # Inside process sets the results differ between the sets by design: compare
    # digests only between ranks of the same parity (the same set) when
    # "collectives" ran, else across all ranks.
    me = hvd.rank()
    peers = [d for r, d in enumerate(every) if "collectives" not in sys.argv[1:] or r % 2 == me % 2]
    c.check(all(d == mine for d in peers), "results differ across ranks: digests %s" % every)
    c.finish()
    hvd.shutdown()


if __name__ == "__main__":
    run(main)
