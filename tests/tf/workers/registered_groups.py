"""Grouped allreduce kernels and their registered groups (ops/adapter.h, Note
[Grouped kernels launch a registered group]), 2-4 ranks, every element of
every result checked on every rank against the float64 / exact reference:
  1. a tf.function's grouped allreduce of mixed dtypes and shapes, many steps
     with fresh data: one registration, then launches only (the kernel
     counters), each step bitwise equal to the same tensors allreduced one by
     one in the same process;
  2. a second trace of the function (other shapes, same names): its kernel
     cannot register the names the first kernel holds and submits by name,
     right; the first trace keeps launching afterwards;
  3. ranks taking different ways in one step: on rank 0 another function's
     kernel registered the names first, so rank 0 submits by name while the
     others launch;
  4. eager calls (TF's kernel cache keeps the kernel) and a shape change:
     registered again;
  5. shutdown() and init(): the kernel registers again and is right;
  6. a shape change while a launch of the old shapes is in flight (rank 0
     calls the kernel from a second thread meanwhile): that call is refused,
     and once the old launch finished the new shapes register and launch.
With OUT_DIR TAG given, writes the results of part 1 to OUT_DIR/TAG_rankR.npz
(the test compares the registered run with NVGROUP_TF_REGISTERED_GROUPS=0).
Usage: registered_groups.py [OUT_DIR TAG]"""
import os
import sys
import threading
import time

import numpy as np

from common import Checker, check_reduced, hvd, per_rank, random_array, run, tf
from nvgroup_tf import op_library

# (shape, dtype, op) per member.
MEMBERS = [((7,), tf.float32, "sum"), ((33, 3), tf.float32, "sum"), ((1,), tf.float64, "sum"),
           ((100,), tf.int32, "sum"), ((2, 2, 2), tf.float16, "sum"), ((0,), tf.float32, "sum"),
           ((257,), tf.float32, "sum"), ((16,), tf.int64, "sum")]
STEPS = 12
REGISTERED = os.environ.get("NVGROUP_TF_REGISTERED_GROUPS", "1") == "1"


def stats_delta(before):
    now = op_library.grouped_submission_stats()
    return {k: now[k] - before[k] for k in now}


def check_stats(c, got, want, what):
    c.check(got == want, "%s: kernel counters %s, want %s" % (what, got, want))


def step_data(seed, members):
    arrays = [per_rank(seed * 100 + i, lambda g, s=s, d=d, o=o: random_array(g, d, s, o))
              for i, (s, d, o) in enumerate(members)]
    return [a for a, _ in arrays], [tf.constant(mine, dtype=d) for (_, mine), (_, d, _) in zip(arrays, members)]


def check_step(c, what, outs, per_member, members):
    c.equal(len(outs), len(members), what + ": one output per member")
    for i, (out, arrays, (shape, dtype, op)) in enumerate(zip(outs, per_member, members)):
        c.equal(tuple(out.shape), shape, "%s member %d shape" % (what, i))
        check_reduced(c, out, arrays, op, dtype, "%s member %d" % (what, i))


def main():
    hvd.init()
    c = Checker("registered_groups")
    me = hvd.rank()
    out_dir, tag = (sys.argv[1], sys.argv[2]) if len(sys.argv) > 2 else (None, None)

    @tf.function
    def grouped(xs):
        return hvd.grouped_allreduce(xs, op=hvd.Sum, name="reg.grouped")

    c.section("1. steps of one traced function")
    before = op_library.grouped_submission_stats()
    saved = {}
    for step in range(STEPS):
        per_member, xs = step_data(100 + step, MEMBERS)
        outs = grouped(xs)
        check_step(c, "step %d" % step, outs, per_member, MEMBERS)
        alone = [hvd.allreduce(x, op=hvd.Sum, name="reg.alone.%d" % i) for i, x in enumerate(xs)]
        for i, (a, b) in enumerate(zip(outs, alone)):
            c.check(a.numpy().tobytes() == b.numpy().tobytes(),
                    "step %d member %d: grouped and one by one differ bitwise" % (step, i))
        for i, out in enumerate(outs):
            saved["step%d_member%d" % (step, i)] = out.numpy()
    d = stats_delta(before)
    if REGISTERED:
        check_stats(c, d, {"registrations": 1, "launches": STEPS, "by_name": 0},
                "one registration, then every step a launch")
    else:
        check_stats(c, d, {"registrations": 0, "launches": 0, "by_name": STEPS},
                "NVGROUP_TF_REGISTERED_GROUPS=0: every step by name")
    if out_dir is not None:
        np.savez("%s/%s_rank%d.npz" % (out_dir, tag, me), **saved)

    c.section("2. a second trace holds the same names")
    other = [((5,), tf.float32, "sum"), ((9, 2), tf.float32, "sum"), ((3,), tf.float64, "sum"),
             ((10,), tf.int32, "sum"), ((2,), tf.float16, "sum"), ((1,), tf.float32, "sum"),
             ((4,), tf.float32, "sum"), ((2,), tf.int64, "sum")]
    before = op_library.grouped_submission_stats()
    for step in range(3):
        per_member, xs = step_data(300 + step, other)
        check_step(c, "second trace step %d" % step, grouped(xs), per_member, other)
        per_member, xs = step_data(400 + step, MEMBERS)
        check_step(c, "first trace after the second, step %d" % step, grouped(xs), per_member, MEMBERS)
    d = stats_delta(before)
    if REGISTERED:
        check_stats(c, d, {"registrations": 0, "launches": 3, "by_name": 3},
                "the second trace by name (the first holds the names), the first launching")

    c.section("3. ranks taking different ways")

    @tf.function
    def grouped_elsewhere(xs):
        return hvd.grouped_allreduce(xs, op=hvd.Sum, name="reg.mixed")

    @tf.function
    def grouped_mixed(xs):
        return hvd.grouped_allreduce(xs, op=hvd.Sum, name="reg.mixed")

    per_member, xs = step_data(500, MEMBERS)
    # Rank 0's names go to grouped_elsewhere's kernel; the others' to grouped_mixed's.
    first = grouped_elsewhere(xs) if me == 0 else grouped_mixed(xs)
    check_step(c, "mixed, first step", first, per_member, MEMBERS)
    before = op_library.grouped_submission_stats()
    for step in range(3):
        per_member, xs = step_data(600 + step, MEMBERS)
        check_step(c, "mixed step %d" % step, grouped_mixed(xs), per_member, MEMBERS)
    d = stats_delta(before)
    if REGISTERED:
        want = {"registrations": 0, "launches": 0, "by_name": 3} if me == 0 else \
            {"registrations": 0, "launches": 3, "by_name": 0}
        check_stats(c, d, want, "rank 0 by name, the others launching")

    c.section("4. eager calls and a shape change")
    before = op_library.grouped_submission_stats()
    for members in (MEMBERS[:3], MEMBERS[:3], [((4, 4),) + MEMBERS[0][1:]] + MEMBERS[1:3]):
        per_member, xs = step_data(700 + len(saved), members)
        check_step(c, "eager %s" % [m[0] for m in members], hvd.grouped_allreduce(xs, op=hvd.Sum, name="reg.eager"),
                   per_member, members)
    d = stats_delta(before)
    if REGISTERED:
        check_stats(c, d, {"registrations": 2, "launches": 3, "by_name": 0},
                "eager: registered, launched again, registered again for the new shape")

    c.section("5. shutdown and init")
    hvd.shutdown()
    hvd.init()
    before = op_library.grouped_submission_stats()
    for step in range(2):
        per_member, xs = step_data(800 + step, MEMBERS)
        check_step(c, "after init, step %d" % step, grouped(xs), per_member, MEMBERS)
    d = stats_delta(before)
    if REGISTERED:
        check_stats(c, d, {"registrations": 1, "launches": 2, "by_name": 0}, "registered again after init()")
    c.section("6. a shape change while the old shapes' launch is in flight")
    # Rank 0 runs the eager kernel with the old shapes in a second thread (in
    # flight until the other ranks submit them) and meanwhile calls it with new
    # shapes: refused, the names are in flight (and the refusal fails the next
    # call of those names on the other ranks). The old registration can only be
    # dropped after its launch, at a later step; then the new shapes register.
    name = "reg.flight"
    old_members, new_members = MEMBERS[:3], [((6, 5),) + MEMBERS[0][1:]] + MEMBERS[1:3]
    old_per_member, old_xs = step_data(900, old_members)
    before = op_library.grouped_submission_stats()

    def expect_refused(text, what):
        _, new_xs = step_data(901, new_members)
        try:
            hvd.grouped_allreduce(new_xs, op=hvd.Sum, name=name)
            c.check(False, "%s did not fail" % what)
        except Exception as e:  # noqa: BLE001 (the message is checked)
            c.check(text in str(e), "%s: %s" % (what, e))

    result = {}
    if me == 0:
        def old_step():
            try:
                result["out"] = hvd.grouped_allreduce(old_xs, op=hvd.Sum, name=name)
            except Exception as e:  # noqa: BLE001 (reported below)
                result["error"] = e

        thread = threading.Thread(target=old_step)
        thread.start()
        deadline = time.monotonic() + 30
        # The launch is counted under the kernel's lock, which the call below
        # then takes only after the launch was pushed.
        while stats_delta(before)["launches"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        expect_refused("in flight", "the overlapping call, refused as its names are in flight")
    hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="reg.flight.sync")  # after rank 0's refusal
    if me == 0:
        thread.join(60)
        c.check("out" in result, "the launch in flight: %s" % result.get("error", "did not finish"))
        if "out" in result:
            check_step(c, "the launch in flight", result["out"], old_per_member, old_members)
    else:
        check_step(c, "old shapes", hvd.grouped_allreduce(old_xs, op=hvd.Sum, name=name), old_per_member,
                   old_members)
        # Rank 0's refusal counts as its next call of these names (Note [Refused
        # duplicates], cc/engine/coordinator.h): this one fails here too.
        expect_refused("duplicate name", "the call matched with rank 0's refused one")
    for step in range(3):
        per_member, xs = step_data(910 + step, new_members)
        check_step(c, "new shapes step %d" % step, hvd.grouped_allreduce(xs, op=hvd.Sum, name=name), per_member,
                   new_members)
    d = stats_delta(before)
    if REGISTERED:
        want = {"registrations": 2, "launches": 4, "by_name": 1} if me == 0 else \
            {"registrations": 2, "launches": 5, "by_name": 0}
        check_stats(c, d, want, "the new shapes registered once the old launch finished")

    c.finish()


if __name__ == "__main__":
    run(main)
