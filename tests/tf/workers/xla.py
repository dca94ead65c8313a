"""The collectives under XLA (tf.function(jit_compile=True), XLA CPU here, XLA
GPU through the kit), in one launch per rank count:

    xla.py collectives   every lowered collective (allreduce per dtype and op with
                         scale factors, grouped allreduce of mixed dtypes, allgather
                         with rank-dependent first dimensions, broadcast per dtype
                         and root, gradients) compiled by XLA -- the HLO holds our
                         custom call -- and bit for bit equal to the same collective
                         without XLA, both checked against a float64 / exact integer
                         reference, identical on every rank; the calls of one
                         program chained into one order, the same on every rank.
    xla.py errors        cross-rank mismatches inside an XLA program raise
                         FailedPreconditionError naming the tensor on every rank
                         within seconds; the engine keeps working afterwards.
    xla.py fit           Keras fit with jit_compile=True and a DistributedOptimizer
                         (Keras keeps jit_compile True; default buckets and one
                         collective per gradient) and a DistributedGradientTape step
                         under tf.function(jit_compile=True): ranks end bitwise
                         equal and match one process fitting the concatenated
                         batches; fit with mixed precision and with
                         backward_passes_per_step=2 under XLA: ranks bitwise equal.
    xla.py dead VICTIM   rank VICTIM is SIGKILLed while the others wait inside an
                         XLA program: they raise UnavailableError naming it.

Several sections may be given; each rank prints "... N checks, 0 failures".
"""
import hashlib
import os
import re
import signal
import sys
import time

import numpy as np

from common import (ALL_DTYPES, REDUCE_DTYPES, Checker, hvd, random_array,
                    reference, run, tf, to_numpy)

OPS = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max,
       "product": hvd.Product}
MAX_SECONDS = 20.0  # "within seconds" for a mismatch error


def hlo_of(fn, *args, stage="hlo"):
    """The HLO text of `fn` at `stage`: "hlo" as lowered, "optimized_hlo" as
    XLA compiled it (after its passes: what runs)."""
    return fn.experimental_get_compiler_ir(*args)(stage=stage)


def operand_names(text):
    """The operand names of an HLO operand list, printed with shapes
    ("f32[3]{0} %a, u8[1]{0} %b") or without ("%a, %b")."""
    return re.findall(r"%([\w.\-]+)", text)


def collective_chain(text):
    """The nvgroup collectives of HLO `text` in the order their ordering
    operands chain them (ops/xla_ops.h, "Order"): each single call or start
    returns an order token u8[1] as its last result and takes, as its last
    operand, the previous call's token (a get-tuple-element of its last
    element), the first one an empty u8[0] constant; a done (Note [Start and
    done]) is not in the chain but must take its own start's results. None
    unless all form one chain and every start has exactly one done. Works on
    the HLO as lowered and as optimized (operands printed without shapes)."""
    calls, dones, tokens, empty_constants, results, starts = {}, [], {}, set(), {}, []
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", line)
        if not m:
            continue
        name, rest = m.groups()
        if re.match(r"u8\[0\]\S* constant\(", rest):
            empty_constants.add(name)
        gte = re.match(r"(\S+) get-tuple-element\(.*?%([\w.\-]+)\), index=(\d+)", rest)
        if gte:
            tokens[name] = (gte.group(2), int(gte.group(3)), gte.group(1))
        call = re.match(r"(.*?) custom-call\((.*?)\), custom_call_target=\"(nvgroup_collective\w*)\"", rest)
        if call:
            shape, operands, target = call.groups()
            names = operand_names(operands)
            if target == "nvgroup_collective_done":
                dones.append(names)
                continue
            calls[name] = names[-1] if names else None
            results[name] = shape.count("[")  # elements of the result tuple
            if target == "nvgroup_collective_start":
                starts.append(name)
    done_of = [{tokens.get(o, (o,))[0] for o in operands} & set(starts) for operands in dones]
    if any(len(d) != 1 for d in done_of) or sorted(next(iter(d)) for d in done_of) != sorted(starts):
        return None
    after = {}  # previous call -> next call
    first = []
    for name, operand in calls.items():
        if operand is None:
            return None
        if operand in empty_constants:
            first.append(name)
            continue
        if operand not in tokens:
            return None
        source, index, shape = tokens[operand]
        if source not in calls or index != results[source] - 1 or not shape.startswith("u8[1]"):
            return None  # not the previous call's order token
        if source in after:
            return None  # two calls after the same one: not a chain
        after[source] = name
    if len(first) != 1:
        return None
    order = first
    while order[-1] in after:
        order.append(after[order[-1]])
    return order if len(order) == len(calls) else None


def collective_calls(text):
    """How many custom calls one collective lowered to: 1 (one call) or 2 (a
    start and its done) per collective, as NVGROUP_XLA_START_DONE chose."""
    return text.count("custom_call_target=\"nvgroup_collective")


def calls_per_collective():
    """2 where the collectives lower to a start and a done, else 1:
    NVGROUP_XLA_START_DONE=1 always, 0 never, auto (the default) on a GPU."""
    setting = os.environ.get("NVGROUP_XLA_START_DONE", "auto")
    if setting == "auto":
        return 2 if tf.config.list_physical_devices("GPU") else 1
    return 2 if setting == "1" else 1


class Digest:
    """Every result's bytes, so ranks can compare all of them at the end."""

    def __init__(self):
        self.h = hashlib.sha256()

    def add(self, array):
        self.h.update(np.ascontiguousarray(array).tobytes())


def same_bytes(c, got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    c.check(got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(),
            "%s: XLA result differs from the non-XLA result (%s vs %s)" % (what, got.ravel()[:4],
                                                                           want.ravel()[:4]))


def check_value(c, got, want, inputs, dtype, op, what):
    if dtype.is_integer or op in ("min", "max"):
        c.equal(got, np.asarray(want).astype(np.asarray(got).dtype), what)
    else:
        magnitude = np.sum([np.abs(tf.cast(a, tf.float64).numpy()) for a in inputs], axis=0)
        if op == "product":
            magnitude = np.abs(want)
        c.close(got, want, magnitude, dtype, what)


def section_collectives(c, digest):
    me, n = hvd.rank(), hvd.size()
    shape = (5, 7)

    c.section("allreduce: every dtype and op, XLA vs non-XLA vs reference")
    for dtype in REDUCE_DTYPES:
        for op_name, op in OPS.items():
            scales = [(1.0, 1.0)]
            if dtype.is_floating and op_name in ("sum", "average"):
                scales.append((0.5, 3.0))
            for pre, post in scales:
                inputs = [random_array(np.random.default_rng(1000 * r + len(op_name)), dtype, shape, op_name)
                          for r in range(n)]
                x = tf.constant(inputs[me])
                tag = "ar.%s.%s.%g.%g" % (dtype.name, op_name, pre, post)

                def f(t, tag=tag, op=op, pre=pre, post=post, suffix=""):
                    return hvd.allreduce(t, op=op, prescale_factor=pre, postscale_factor=post,
                                         name=tag + suffix)
                xla = tf.function(lambda t: f(t, suffix=".xla"), jit_compile=True)
                plain = tf.function(lambda t: f(t, suffix=".tf"), jit_compile=False)
                got_xla, got_tf = to_numpy(xla(x)), to_numpy(plain(x))
                same_bytes(c, got_xla, got_tf, tag)
                want = reference(inputs, op_name, dtype)
                if dtype.is_floating:
                    want = want * pre * post if op_name in ("sum", "average") else want
                check_value(c, got_xla, want, inputs, dtype, op_name, tag)
                digest.add(got_xla)

    c.section("the HLO holds the custom call (XLA compiled it, no fallback)")
    probe = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, name="hlo.probe"), jit_compile=True)
    text = hlo_of(probe, tf.ones([3]))
    if tf.config.list_physical_devices("GPU"):  # through the GPU kit: XLA GPU, the CUDA handler
        c.check("GPU" in probe(tf.ones([3])).device, "the XLA program did not run on the GPU")
    c.check("custom-call" in text and "nvgroup_collective" in text and "hlo.probe" in text,
            "allreduce HLO lacks the nvgroup custom call:\n%s" % text[:2000])

    c.section("one order of the collective calls on every rank: each takes the previous one's output")

    def several(t):  # independent collectives: only the ordering operands order them
        return (hvd.allreduce(t, op=hvd.Sum, name="order.ar"), hvd.allgather(t, name="order.ag"),
                hvd.grouped_allreduce([t, 2 * t], op=hvd.Sum, name="order.gar"),
                hvd.broadcast(t, 0, name="order.bc"))
    several_xla = tf.function(several, jit_compile=True)
    text = hlo_of(several_xla, tf.ones([3]))
    chain = collective_chain(text)
    c.check(chain is not None and len(chain) == 4, "the collective calls do not form one chain:\n%s" % text[:4000])
    # XLA's passes must keep the chain (a zero-element token was folded into a constant by them)
    optimized = hlo_of(several_xla, tf.ones([3]), stage="optimized_hlo")
    c.check(collective_chain(optimized) is not None and len(collective_chain(optimized)) == 4,
            "the compiled program's collective calls do not form one chain:\n%s" % optimized[:4000])
    order = [n for n in ("order.ag", "order.ar", "order.bc", "order.gar") if "op_name=\"%s\"" % n in text]
    c.check(len(order) == 4, "the probe's collectives are missing from the HLO")
    names = hvd.allgather_object([re.sub(r"\.\d+$", "", x) for x in chain or []])
    c.check(all(n == names[0] for n in names), "ranks chain their calls in different orders: %s" % names)
    got = several_xla(tf.ones([3]))
    c.equal(got[0].numpy(), np.full(3, float(n)), "chained allreduce")
    c.equal(got[2][1].numpy(), np.full(3, 2.0 * n), "chained grouped allreduce")
    # Rank-dependent HLO (the allgather gradient slices at this rank's offset)
    # with independent collectives: still one chain, in the same order everywhere.
    def rank_dependent(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(hvd.allreduce(t * t, op=hvd.Sum, name="order.g.ar")) + \
                tf.reduce_sum(hvd.allgather(t, name="order.g.ag") ** 2)
        return tape.gradient(loss, t)
    rank_dependent_xla = tf.function(rank_dependent, jit_compile=True)
    for stage in ("hlo", "optimized_hlo"):
        text = hlo_of(rank_dependent_xla, tf.ones([2, 2]), stage=stage)
        chain = collective_chain(text)
        c.check(chain is not None and len(chain) >= 4, "gradient program (%s): no single chain:\n%s" % (stage, text[:4000]))
        names = hvd.allgather_object([re.sub(r"\.\d+$", "", x) for x in chain or []])
        c.check(all(n == names[0] for n in names), "gradient program (%s): ranks chain differently: %s" % (stage, names))

    c.section("grouped allreduce: mixed dtypes and shapes in one call")
    shapes = [(3,), (4, 5), (1,), (2, 3, 2)]
    dtypes = [tf.float32, tf.float64, tf.int32, tf.bfloat16]
    per_rank = [[random_array(np.random.default_rng(50 + 10 * r + i), d, s) for i, (d, s) in
                 enumerate(zip(dtypes, shapes))] for r in range(n)]
    xs = [tf.constant(a) for a in per_rank[me]]

    def grouped(ts, suffix):
        return hvd.grouped_allreduce(ts, op=hvd.Sum, name="grouped" + suffix)
    got_xla = tf.function(lambda ts: grouped(ts, ".xla"), jit_compile=True)(xs)
    got_tf = tf.function(lambda ts: grouped(ts, ".tf"))(xs)
    for i, d in enumerate(dtypes):
        a, b = to_numpy(got_xla[i]), to_numpy(got_tf[i])
        same_bytes(c, a, b, "grouped[%d]" % i)
        check_value(c, a, reference([p[i] for p in per_rank], "sum", d), [p[i] for p in per_rank], d, "sum",
                    "grouped[%d] %s" % (i, d.name))
        digest.add(a)
    text = hlo_of(tf.function(lambda ts: grouped(ts, ".hlo"), jit_compile=True), xs)
    c.check(collective_calls(text) == calls_per_collective(),
            "a grouped allreduce must lower to one custom call (or one start and its done):\n%s" % text[:2000])

    c.section("grouped allreduce steps: one registration, then launches")
    # Note [Calls launch registered groups] (ops/xla_ops.h): the call site
    # registers its members at the first call and launches them afterwards;
    # on the host only the start of the pair does, on a GPU every call.
    from nvgroup_tf import op_library
    stepped = tf.function(lambda ts: grouped(ts, ".steps"), jit_compile=True)
    registers = calls_per_collective() == 2 or bool(tf.config.list_physical_devices("GPU"))
    before = op_library.grouped_submission_stats()
    steps = 5
    for step in range(steps):
        step_inputs = [[random_array(np.random.default_rng([70, step, r, i]), d, s) for i, (d, s) in
                        enumerate(zip(dtypes, shapes))] for r in range(n)]
        got = stepped([tf.constant(a) for a in step_inputs[me]])
        for i, d in enumerate(dtypes):
            a = to_numpy(got[i])
            check_value(c, a, reference([p[i] for p in step_inputs], "sum", d), [p[i] for p in step_inputs], d,
                        "sum", "grouped step %d [%d] %s" % (step, i, d.name))
            digest.add(a)
    after = op_library.grouped_submission_stats()
    delta = {k: after[k] - before[k] for k in after}
    want = {"registrations": 1, "launches": steps, "by_name": 0} if registers else \
        {"registrations": 0, "launches": 0, "by_name": 0}
    c.check(delta == want, "grouped steps under XLA: submissions %s, want %s" % (delta, want))

    c.section("allgather: rank-dependent first dimensions, every dtype")
    for dtype in ALL_DTYPES:
        rows = [r + 1 for r in range(n)]
        inputs = [random_array(np.random.default_rng(300 + r), dtype, (rows[r], 3)) for r in range(n)]
        x = tf.constant(inputs[me])
        tag = "ag." + dtype.name
        got_xla = tf.function(lambda t: hvd.allgather(t, name=tag + ".xla"), jit_compile=True)(x)
        got_tf = tf.function(lambda t: hvd.allgather(t, name=tag + ".tf"))(x)
        a, b = got_xla.numpy(), got_tf.numpy()
        same_bytes(c, a, b, tag)
        c.equal(a, np.concatenate(inputs), tag + " vs concatenation")
        digest.add(a)

    c.section("broadcast: every dtype, every root")
    for dtype in ALL_DTYPES:
        for root in range(n):
            inputs = [random_array(np.random.default_rng(500 + r), dtype, (4, 2)) for r in range(n)]
            x = tf.constant(inputs[me])
            tag = "bc.%s.%d" % (dtype.name, root)
            got_xla = tf.function(lambda t: hvd.broadcast(t, root, name=tag + ".xla"), jit_compile=True)(x)
            got_tf = tf.function(lambda t: hvd.broadcast(t, root, name=tag + ".tf"))(x)
            same_bytes(c, got_xla.numpy(), got_tf.numpy(), tag)
            c.equal(got_xla.numpy(), inputs[root], tag + " vs root's tensor")
            digest.add(got_xla.numpy())

    c.section("gradients through the lowered collectives")
    w_np = [random_array(np.random.default_rng(700 + r), tf.float32, (4, 3)) for r in range(n)]
    w = tf.constant(w_np[me])

    def grads(t, suffix):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = hvd.allreduce(t * t, op=hvd.Sum, name="g.ar" + suffix)
            z = hvd.allgather(t, name="g.ag" + suffix)
            loss = tf.reduce_sum(y) + tf.reduce_sum(z * z)
        return tape.gradient(loss, t)
    g_xla = tf.function(lambda t: grads(t, ".xla"), jit_compile=True)(w).numpy()
    g_tf = tf.function(lambda t: grads(t, ".tf"))(w).numpy()
    # Not bitwise: the collectives' results are the same bits under XLA, but XLA fuses the sum of
    # the two gradient contributions differently from TF (1 ulp apart at n = 3).
    c.close(g_xla, g_tf.astype(np.float64), np.abs(g_tf.astype(np.float64)), tf.float32, "gradient XLA vs TF")
    # d/dt [sum(allreduce_sum(t*t)) + sum(allgather(t)**2)] = 2t*n (allreduce's gradient is the
    # same allreduce) + this rank's rows of the average over ranks of 2*allgather(t) (Horovod's
    # allgather gradient), i.e. 2t.
    want = 2.0 * (n + 1) * w_np[me].astype(np.float64)
    c.close(g_xla, want, np.abs(want), tf.float32, "gradient vs 2*(n+1)*t")

    c.section("the same compiled program run many times (response cache), every result checked")
    step = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, name="loop"), jit_compile=True)
    for i in range(20):
        inputs = [random_array(np.random.default_rng(900 + 31 * i + r), tf.float64, (33,)) for r in range(n)]
        got = step(tf.constant(inputs[me])).numpy()
        c.close(got, reference(inputs, "sum", tf.float64), np.sum(np.abs(inputs), axis=0), tf.float64,
                "loop step %d" % i)
        digest.add(got)


def expect_mismatch(c, what, name, fn):
    start = time.monotonic()
    message = c.raises(tf.errors.FailedPreconditionError, fn, what)
    elapsed = time.monotonic() - start
    c.check(elapsed < MAX_SECONDS, "%s: took %.1f s to fail" % (what, elapsed))
    if message is not None:
        c.check(name in message, "%s: message does not name %r: %s" % (what, name, message))
    ok = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="after." + name)
    c.equal(ok.numpy(), [float(hvd.size())], "allreduce after " + what)


def section_errors(c, digest):
    me = hvd.rank()
    odd = me == 0

    def xla(fn):
        return tf.function(fn, jit_compile=True)

    shape = [2, 3] if odd else [3, 3]
    expect_mismatch(c, "XLA allreduce shape mismatch", "xmm.shape",
                    lambda: xla(lambda t: hvd.allreduce(t, op=hvd.Sum, name="xmm.shape"))(tf.ones(shape)))
    expect_mismatch(c, "XLA allreduce op mismatch", "xmm.op", lambda: xla(
        lambda t: hvd.allreduce(t, op=hvd.Max if odd else hvd.Sum, name="xmm.op"))(tf.ones([4])))
    expect_mismatch(c, "XLA allreduce dtype mismatch", "xmm.dtype", lambda: xla(
        lambda t: hvd.allreduce(t, op=hvd.Sum, name="xmm.dtype"))(
            tf.ones([4], tf.float64 if odd else tf.float32)))
    expect_mismatch(c, "XLA broadcast root mismatch", "xmm.root", lambda: xla(
        lambda t: hvd.broadcast(t, 1 if odd else 0, name="xmm.root"))(tf.ones([4])))
    expect_mismatch(c, "XLA grouped allreduce member mismatch", "xmm.grouped", lambda: xla(
        lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Sum, name="xmm.grouped"))(
            tf.ones([3]), tf.ones([2] if odd else [3])))
    # Allgather's trailing dimensions are checked by the compile-time exchange's
    # peer, the run-time negotiation.
    expect_mismatch(c, "XLA allgather trailing-dimension mismatch", "xmm.gather", lambda: xla(
        lambda t: hvd.allgather(t, name="xmm.gather"))(tf.ones([2, 4] if odd else [2, 3])))

    digest.add(np.zeros(1))


def section_fit(c, digest):
    import keras
    import nvgroup_tf.keras as hvdk
    me, n = hvd.rank(), hvd.size()
    B, STEPS, LR = 4, 5, 0.05
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((STEPS * n * B, 6)).astype(np.float32)
    y = rng.standard_normal((STEPS * n * B, 3)).astype(np.float32)

    def rank_rows(a):
        return np.concatenate([a[(s * n + me) * B:(s * n + me + 1) * B] for s in range(STEPS)])

    def model_fn():
        keras.utils.set_random_seed(7)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                 keras.layers.Dense(3)])

    for cap in (None, 0):  # default buckets (one grouped allreduce), one collective per gradient
        model = model_fn()
        init = model.get_weights()
        opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(LR), bucket_cap_bytes=cap)
        model.compile(optimizer=opt, loss="mse", jit_compile=True)
        c.check(model.jit_compile is True, "Keras turned jit_compile off for a distributed optimizer")
        model.fit(rank_rows(x), rank_rows(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
        got = model.get_weights()
        gathered = hvd.allgather_object([w.tobytes() for w in got])
        c.check(all(g == gathered[0] for g in gathered), "cap %s: weights differ across ranks" % cap)
        ref = model_fn()
        ref.set_weights(init)
        ref.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", jit_compile=True)
        ref.fit(x, y, batch_size=n * B, epochs=1, shuffle=False, verbose=0)
        for i, (a, e) in enumerate(zip(got, ref.get_weights())):
            ok = np.allclose(a, e, rtol=2e-5, atol=1e-6)
            c.check(ok, "cap %s weight %d: max |diff| %g vs the single-process fit" % (
                cap, i, np.max(np.abs(a - e))))
        c.check(any(not np.array_equal(a, b) for a, b in zip(got, init)), "cap %s: fit changed nothing" % cap)
        for w in got:
            digest.add(w)

    def reference_weights(init):
        ref = model_fn()
        ref.set_weights(init)
        ref.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", jit_compile=True)
        ref.fit(x, y, batch_size=n * B, epochs=1, shuffle=False, verbose=0)
        return ref.get_weights()

    def agree(weights, init, what):
        gathered = hvd.allgather_object([w.tobytes() for w in weights])
        c.check(all(g == gathered[0] for g in gathered), "%s: weights differ across ranks" % what)
        c.check(any(not np.array_equal(a, b) for a, b in zip(weights, init)), "%s: nothing changed" % what)
        for w in weights:
            digest.add(w)

    c.section("DistributedGradientTape step under tf.function(jit_compile=True)")
    model = model_fn()
    init = model.get_weights()
    opt = keras.optimizers.SGD(LR)
    xr, yr = rank_rows(x), rank_rows(y)

    @tf.function(jit_compile=True)
    def tape_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        tape = hvdk.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for s in range(STEPS):
        tape_step(xr[s * B:(s + 1) * B], yr[s * B:(s + 1) * B])
    got = model.get_weights()
    agree(got, init, "tape")

    c.section("done after: with several buckets each done takes every other bucket's gradients")
    # ops/xla_ops.h Note [Start and done], "Done after": one bucket per gradient
    # (bucket_cap_bytes=0), so each bucket's done must take its start's result,
    # its input, and the other buckets' gradients; a single call takes its input
    # and the ordering operand only.
    one_per_gradient_model = model_fn()

    @tf.function(jit_compile=True)
    def per_gradient_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(one_per_gradient_model(xb) - yb))
        tape = hvdk.DistributedGradientTape(tape, bucket_cap_bytes=0)
        return tape.gradient(loss, one_per_gradient_model.trainable_variables)

    text = hlo_of(per_gradient_step, xr[:B], yr[:B])
    variables = len(one_per_gradient_model.trainable_variables)
    calls = [m.group(1) for m in re.finditer(r"custom-call\((.*?)\), custom_call_target=\"nvgroup_collective"
                                              r"(?:_done)?\"", text)]
    pair = calls_per_collective() == 2
    operands = sorted(len(re.findall(r"%?[\w.\-]+(?:, |$)", ops)) for ops in calls)
    if n == 1:
        # One rank: the gradients are returned as they are (as Horovod's), so
        # the program holds no collective at all.
        c.check("nvgroup_collective" not in text, "one rank: the step still holds an nvgroup collective:\n%s"
                % text[:6000])
    elif pair:
        dones = [m.group(1) for m in re.finditer(r"custom-call\((.*?)\), custom_call_target=\"nvgroup_collective_done\"",
                                                 text)]
        counts = sorted(len(re.findall(r"%?[\w.\-]+(?:, |$)", ops)) for ops in dones)
        c.check(counts == [2 + variables - 1] * variables,
                "done operands %s, want %d per done (result, input, the other %d gradients):\n%s"
                % (counts, 2 + variables - 1, variables - 1, text[:6000]))
    else:
        c.check(operands == [2] * variables, "single-call operands %s, want 2 each (input, order)" % operands)
    reduced = per_gradient_step(xr[:B], yr[:B])
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(one_per_gradient_model(xr[:B]) - yr[:B]))
    local = tape.gradient(loss, one_per_gradient_model.trainable_variables)
    mine = [to_numpy(g).astype(np.float64) for g in local]
    everyone = hvd.allgather_object(mine)
    for i, g in enumerate(reduced):
        expected = sum(e[i] for e in everyone) / n
        c.check(np.allclose(to_numpy(g), expected, rtol=1e-5, atol=1e-6),
                "done-after gradient %d: max |diff| %g vs the float64 average of the ranks' gradients"
                % (i, np.max(np.abs(to_numpy(g) - expected))))
    for i, (a, e) in enumerate(zip(got, reference_weights(init))):
        c.check(np.allclose(a, e, rtol=2e-5, atol=1e-6), "tape weight %d: max |diff| %g vs the single-process fit"
                % (i, np.max(np.abs(a - e))))

    c.section("fit with jit_compile=True: mixed precision (loss scaling) and backward_passes_per_step=2")
    for what, policy, passes in (("mixed_float16", "mixed_float16", 1), ("backward_passes_per_step=2", None, 2)):
        if policy:
            keras.mixed_precision.set_global_policy(policy)
        try:
            model = model_fn()
            init = model.get_weights()
            model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(LR),
                                                              backward_passes_per_step=passes),
                          loss="mse", jit_compile=True)
            c.check(model.jit_compile is True, "%s: jit_compile turned off" % what)
            model.fit(rank_rows(x), rank_rows(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
            weights = model.get_weights()
            c.check(all(np.all(np.isfinite(np.asarray(w, np.float64))) for w in weights), what + ": non-finite")
            agree(weights, init, what)
        finally:
            keras.mixed_precision.set_global_policy("float32")


def say(line):
    """Prints, and with XLA_RECORD_DIR also appends to a per-rank file: mpirun
    may drop output in flight when it aborts the job after a death."""
    print(line, flush=True)
    record = os.environ.get("XLA_RECORD_DIR")
    if record:
        with open(os.path.join(record, "rank%d.txt" % hvd.rank()), "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


def section_dead(c, victim):
    me = hvd.rank()
    step = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, name="dead.step"), jit_compile=True)
    x = tf.constant(np.random.default_rng(me).standard_normal(64))
    step(x)  # compiled and run once on every rank
    hvd.allreduce(tf.ones([1]), op=hvd.Sum, name="dead.sync")
    if me == victim:
        say("rank %d: KILL %.6f" % (me, time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        for _ in range(1000):
            step(x)
        c.check(False, "XLA program kept running without rank %d" % victim)
    except (tf.errors.UnavailableError, tf.errors.InternalError) as e:
        # Eagerly called functions: TF re-raises an op's UnavailableError as InternalError
        # ("originally returned UnavailableError, and was replaced by InternalError ..."); the
        # engine's error and its text are what must arrive.
        if isinstance(e, tf.errors.InternalError) and "originally returned UnavailableError" not in e.message:
            raise
        elapsed = time.monotonic() - start
        say("rank %d: CAUGHT UnavailableError after %.2f s: %s" % (me, elapsed, e.message.splitlines()[0]))
        c.check("rank %d" % victim in e.message, "the error does not name rank %d: %s" % (victim, e.message))
    except Exception as e:  # noqa: BLE001
        c.check(False, "raised %s instead of UnavailableError: %s" % (type(e).__name__, e))
    c.finish()
    sys.stdout.flush()
    os._exit(3 if not c.failures else 1)  # as a training script would: non-zero


def main():
    # GPU: full fp32 matmuls, so the fit check's tolerance means the same as on CPU.
    tf.config.experimental.enable_tensor_float_32_execution(False)
    hvd.init()
    args = sys.argv[1:]
    c = Checker("xla")
    digest = Digest()
    if args[0] == "dead":
        section_dead(c, int(args[1]))
    for name in args:
        {"collectives": section_collectives, "errors": section_errors, "fit": section_fit}[name](c, digest)
    mine = digest.h.hexdigest()
    every = hvd.allgather_object(mine)
    c.check(all(d == mine for d in every), "results differ across ranks: digests %s" % every)
    c.finish()
    hvd.shutdown()


if __name__ == "__main__":
    run(main)
