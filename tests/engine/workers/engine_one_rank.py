"""The engine on one rank: nothing to agree with and nothing to
reduce, so no cycle runs an MPI agreement allreduce (stats
`agreement_allreduces` stays 0 while cycles run) and a fused bucket is the
members' scaled copies input -> output with no registered buffer. Checked:
grouped buckets repeated from their cached plan and lone tensors, every dtype
the engine reduces, every op, prescale/postscale, in place and not; results
bitwise equal to round(round(x * prescale) * postscale) where numpy rounds as
the engine does (float32/float64/integers), else within the dtype's rounding."""
import random

import numpy as np
from mpi4py import MPI  # noqa: F401 (finalizes MPI at exit, as mpirun expects)

from engine_common import E, FLOATS, NP_DTYPES, check, check_close, finish, rank_data, reference

E.init()
check(E.size() == 1, "one rank")

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8", "int8"]


def expected(x, dtype, pre, post):
    if dtype in ("float32", "float64"):
        t = np.dtype(NP_DTYPES[dtype]).type
        y = x * t(pre) if pre != 1.0 else x.copy()
        return y * t(post) if post != 1.0 else y
    return None  # compared through the float64 reference


def make_specs(seed, count):
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        dtype = rng.choice(DTYPES)
        op = rng.choice(["sum", "average", "min", "max", "product"])
        shape = [rng.choice([1, 3, 16, 33, 1000])] + ([rng.choice([1, 2, 5])] if rng.random() < 0.5 else [])
        pre = post = 1.0
        if dtype in FLOATS and rng.random() < 0.5:
            pre, post = rng.choice([1.0, 0.5, -2.0]), rng.choice([1.0, 0.25, 3.0])
        specs.append(dict(name="one/%d/%s" % (i, dtype), seed=seed * 1000 + i, dtype=dtype, op=op, shape=shape,
                          pre=pre, post=post, inplace=rng.random() < 0.4))
    return specs


def run(specs, grouped, step):
    xs, ins, outs, items = [], [], [], []  # ins: the submitted arrays, alive until done
    for s in specs:
        x = rank_data(s["seed"] + step, 0, s["shape"], s["dtype"], s["op"])
        out = x if s["inplace"] else np.zeros_like(x)
        xs.append(x.copy())
        ins.append(x)
        outs.append(out)
        items.append((s["name"], x.ctypes.data, out.ctypes.data, s["shape"], s["dtype"], s["op"], s["pre"], s["post"]))
    if grouped:
        E.wait_all(E.grouped_allreduce_async(items))
    else:
        E.wait_all([E.allreduce_async(*it) for it in items])
    for s, x, out in zip(specs, xs, outs):
        want = expected(x, s["dtype"], s["pre"], s["post"])
        if want is not None:
            check(np.array_equal(out.view(np.uint8), want.view(np.uint8)),
                  "%s: not bitwise round(round(x*pre)*post) (%d elements differ)" % (s["name"], int(np.sum(out != want))))
        elif s["dtype"] not in FLOATS:
            check(np.array_equal(out, x), "%s: integer result is not the input" % s["name"])
        else:
            check_close(s["name"], out, reference(s["seed"] + step, 1, s["shape"], s["dtype"], s["op"], s["pre"],
                                                  s["post"]), s["dtype"], abs(s["pre"] * s["post"]))


group = make_specs(1, 60)
lone = make_specs(2, 20)
for s in lone:
    s["name"] = "lone/" + s["name"]
run(group, True, 0)  # negotiated; the plan is made
run(lone, False, 0)
before = E.stats()
steps = 4
for step in range(1, steps + 1):
    run(group, True, step)
    run(lone, False, step)
after = E.stats()
d = {k: after[k] - before[k] for k in after}
check(d["cycles"] >= 2 * steps, "cycles ran (%r)" % d["cycles"])
check(d["agreement_allreduces"] == 0, "no agreement allreduce on one rank (%r ran)" % d["agreement_allreduces"])
check(d["plan_launches"] >= steps, "the group ran from its plan (%r launches)" % d["plan_launches"])
check(d["negotiation_rounds"] == 0, "steady state without negotiation (%r rounds)" % d["negotiation_rounds"])
# wait_all counts a handle listed twice once (it must not wait forever for a
# second completion), and returns one result per listed id.
x = np.arange(8, dtype=np.float32)
y = np.zeros_like(x)
h = E.allreduce_async("dup", x.ctypes.data, y.ctypes.data, [8], "float32")
check(len(E.wait_all([h, h])) == 2 and np.array_equal(x, y), "wait_all with a duplicate handle")
E.shutdown()
finish()
