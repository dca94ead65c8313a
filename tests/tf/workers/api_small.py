"""Horovod's small TF API, on every rank: topology ops read at run
time, build flags, mpi_threads_supported / is_homogeneous, Horovod's util
helpers, broadcast_global_variables (eager error, graph op, the TF1 hook), the
object helpers in TF1 graph mode, IndexedSlices as Horovod treats them, and
start_timeline / stop_timeline. argv[1]: a directory for timeline files."""
import json
import os
import sys
import warnings

import numpy as np

from common import Checker, hvd, run, tf

FIX = "init"


def before_init(c):
    c.raises(ValueError, hvd.mpi_threads_supported, "mpi_threads_supported before init",
             contains=FIX)
    c.raises(ValueError, hvd.is_homogeneous, "is_homogeneous before init", contains=FIX)
    c.raises(ValueError, lambda: hvd.start_timeline("/tmp/x.json"), "start_timeline before init",
             contains=FIX)
    c.raises(ValueError, hvd.stop_timeline, "stop_timeline before init", contains=FIX)
    c.raises(tf.errors.FailedPreconditionError, lambda: hvd.rank_op().numpy(),
             "rank_op run before init", contains=FIX)

    # A graph built before init reports the engine it runs against.
    @tf.function
    def topology():
        return tf.stack([hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op(),
                         hvd.cross_rank_op(), hvd.cross_size_op()])
    return topology.get_concrete_function()


def check_topology_ops(c, concrete, label):
    want = [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
            hvd.cross_size()]
    c.equal(concrete().numpy(), want, "topology ops traced before init (%s)" % label)
    eager = [hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op(),
             hvd.cross_rank_op(), hvd.cross_size_op()]
    c.equal([int(t.numpy()) for t in eager], want, "topology ops eagerly (%s)" % label)
    c.check(all(t.dtype == tf.int32 and t.shape == [] for t in eager), "topology ops: int32 scalars")
    c.equal(int(hvd.size_op(process_set_id=0).numpy()), hvd.size(), "size_op(process_set_id=0)")
    c.raises(tf.errors.InvalidArgumentError, lambda: hvd.size_op(process_set_id=977).numpy(),
             "size_op of an unknown process set", contains="977")


def check_flags_and_util(c):
    from mpi4py import MPI
    c.equal(hvd.mpi_threads_supported(), MPI.Query_thread() == MPI.THREAD_MULTIPLE,
            "mpi_threads_supported agrees with MPI_Query_thread")
    local_sizes = hvd.allgather_object(hvd.local_size(), name="local_sizes")
    c.equal(hvd.is_homogeneous(), len(set(local_sizes)) == 1, "is_homogeneous")
    c.check(hvd.ccl_built() is False and hvd.ddl_built() is False, "ccl_built/ddl_built are False")

    import nvgroup_tf.util as util
    c.check(hvd._executing_eagerly is util._executing_eagerly, "_executing_eagerly exported")
    c.check(util._executing_eagerly() is True, "_executing_eagerly() eagerly")
    c.check(bool(tf.function(lambda: tf.constant(hvd._executing_eagerly()))().numpy()) is False,
            "_executing_eagerly() inside tf.function")
    with tf.Graph().as_default():
        c.check(util._executing_eagerly() is False, "_executing_eagerly() in a TF1 graph")
    import keras
    tv, kv = tf.Variable(1.0), keras.Variable(2.0)
    refs = hvd.vars_to_refs([tv, [kv]])
    c.check(isinstance(refs, tuple) and len({refs[0], refs[1][0]}) == 2, "vars_to_refs hashable")
    back = hvd.refs_to_vars(refs)
    c.check(back[0] is tv and back[1][0] is kv, "refs_to_vars inverts vars_to_refs")
    c.equal(hvd.handle_average_backwards_compatibility(None, None), hvd.Average,
            "handle_average_backwards_compatibility default")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        c.equal(hvd.handle_average_backwards_compatibility(None, False), hvd.Sum,
                "handle_average_backwards_compatibility(average=False)")
    c.raises(ValueError, lambda: hvd.handle_average_backwards_compatibility(hvd.Sum, True),
             "op and average together")
    c.equal([hvd.check_num_rank_power_of_2(k) for k in (0, 1, 2, 3, 4, 6, 8)],
            [False, True, True, False, True, False, True], "check_num_rank_power_of_2")
    c.check(callable(hvd._make_subgraph(lambda: 1)), "_make_subgraph")
    calls = []
    cached = hvd._cache(lambda x: calls.append(x) or len(calls))
    c.equal([cached(1), cached(1), cached(2)], [1, 1, 2], "_cache memoizes per argument")


def check_broadcast_global_variables(c):
    n, me = hvd.size(), hvd.rank()
    root = n - 1
    msg = c.raises(RuntimeError, lambda: hvd.broadcast_global_variables(root),
                   "broadcast_global_variables eagerly", contains="does not support eager execution")
    c.check(msg is None or "broadcast_variables" in msg, "eager error names broadcast_variables")

    values = {r: [np.random.default_rng([31, r, i]).normal(size=s) for i, s in
                  enumerate([(3, 4), (5,), ()])] for r in range(n)}
    graph = tf.Graph()
    with graph.as_default():
        variables = [tf.compat.v1.Variable(v, name="gv%d" % i) for i, v in enumerate(values[me])]
        ints = tf.compat.v1.Variable(np.arange(6, dtype=np.int32) * (me + 1), name="gint")
        op = hvd.broadcast_global_variables(root)
        c.check(isinstance(op, tf.Operation), "broadcast_global_variables returns an op in a graph")
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(op)
            for i, v in enumerate(variables):
                c.equal(sess.run(v), values[root][i], "graph broadcast_global_variables %d" % i)
            c.equal(sess.run(ints), np.arange(6) * (root + 1), "graph broadcast_global_variables int")

    # The TF1 SessionRunHook.
    graph = tf.Graph()
    with graph.as_default():
        v = tf.compat.v1.Variable(values[me][0], name="hooked")
        hook = hvd.BroadcastGlobalVariablesHook(root)
        hook.begin()
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            hook.after_create_session(sess, None)
            c.equal(sess.run(v), values[root][0], "BroadcastGlobalVariablesHook")


def check_objects_in_graphs(c):
    n, me = hvd.size(), hvd.rank()
    obj = {"rank": me, "data": list(range(me * 3 + 1)), "text": "r%d" % me}
    graph = tf.Graph()
    with graph.as_default():
        c.raises(ValueError, lambda: hvd.broadcast_object(obj, 0), "broadcast_object in a graph "
                 "without a session", contains="session")
        with tf.compat.v1.Session(graph=graph) as sess:
            got = hvd.broadcast_object(obj, root_rank=n - 1)
            c.equal(str(got), str({"rank": n - 1, "data": list(range((n - 1) * 3 + 1)),
                                   "text": "r%d" % (n - 1)}), "graph broadcast_object")
            got = hvd.allgather_object(obj, session=sess)
            c.equal(str(got), str([{"rank": r, "data": list(range(r * 3 + 1)), "text": "r%d" % r}
                                   for r in range(n)]), "graph allgather_object")
            fn = hvd.broadcast_object_fn(root_rank=0, session=sess)
            ops_before = len(graph.get_operations())
            for k in range(3):
                got = fn({"k": k, "rank": me, "pad": "x" * (me * 100 + k)})
                c.equal(str(got), str({"k": k, "rank": 0, "pad": "x" * k}),
                        "graph broadcast_object_fn call %d" % k)
            c.equal(len(graph.get_operations()), ops_before, "broadcast_object_fn reuses its ops")
    fn = hvd.broadcast_object_fn(root_rank=n - 1)
    c.equal(fn(("eager", me)), ("eager", n - 1), "eager broadcast_object_fn")
    # Default names are the type's (Horovod): two differently typed objects.
    c.equal(hvd.broadcast_object([me], root_rank=0), [0], "broadcast_object of a list")


def check_indexed_slices(c):
    n, me = hvd.size(), hvd.rank()
    rows = [r + 2 for r in range(n)]
    for dtype in (tf.int32, tf.int64, tf.float32, tf.float64):
        vals = [np.random.default_rng([41, r]).integers(-1000, 1000, size=(rows[r], 3))
                .astype(dtype.as_numpy_dtype) for r in range(n)]
        idx = [np.random.default_rng([42, r]).integers(0, 20, size=rows[r]) for r in range(n)]
        sl = tf.IndexedSlices(tf.constant(vals[me]), tf.constant(idx[me]), tf.constant([20, 3]))
        everything = np.concatenate(vals)
        summed = hvd.allreduce(sl, op=hvd.Sum, name="slices.sum.%s" % dtype.name)
        c.equal(summed.values.numpy(), everything, "Sum of %s slices" % dtype.name)
        c.check(summed.values.dtype == dtype, "Sum keeps %s" % dtype.name)
        averaged = hvd.allreduce(sl, name="slices.avg.%s" % dtype.name)
        want = everything / np.asarray(n, dtype.as_numpy_dtype) if dtype.is_floating \
            else everything.astype(np.float64) / n
        c.check(averaged.values.dtype == tf.as_dtype(want.dtype),
                "Average of %s slices has dtype %s (got %s)" % (dtype.name, want.dtype,
                                                                averaged.values.dtype.name))
        c.equal(averaged.values.numpy(), want, "Average of %s slices" % dtype.name)
        c.equal(averaged.indices.numpy(), np.concatenate(idx), "indices of %s slices" % dtype.name)
        grouped = hvd.grouped_allreduce([sl, tf.constant(vals[me][0])], op=hvd.Average,
                                        name="slices.grouped.%s" % dtype.name)
        c.equal(grouped[0].values.numpy(), want, "grouped Average of %s slices" % dtype.name)
    sl = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 1]), tf.constant([4, 3]))
    for kwargs in ({"prescale_factor": 2.0}, {"postscale_factor": 0.5},
                   {"prescale_factor": 2.0, "postscale_factor": 0.5}):
        c.raises(NotImplementedError, lambda: hvd.allreduce(sl, name="slices.scaled", **kwargs),
                 "scaled slices %s" % kwargs, contains="not supported with tf.IndexedSlices")
        c.raises(NotImplementedError,
                 lambda: hvd.grouped_allreduce([sl], name="slices.gscaled", **kwargs),
                 "grouped scaled slices %s" % kwargs, contains="not supported with tf.IndexedSlices")
    for op in (hvd.Min, hvd.Max, hvd.Product):
        c.raises(NotImplementedError, lambda: hvd.allreduce(sl, op=op, name="slices.minmax"),
                 "slices with op %d" % op, contains="Only Sum and Average")
    c.raises(NotImplementedError, lambda: hvd.allreduce(sl, op=hvd.Adasum), "Adasum slices")
    # Nothing was left half-submitted: the next collective completes.
    got = hvd.allreduce(tf.constant([float(me)]), op=hvd.Sum, name="after.slices")
    c.equal(got.numpy(), [n * (n - 1) / 2.0], "allreduce after the slice errors")


def check_process_set_helpers(c):
    """Object and variable helpers, and size_op, over the process set of ranks
    {0, n-1} (rank 1 stays out when n = 3; with 2 ranks it is the global set)."""
    n, me = hvd.size(), hvd.rank()
    members = sorted({0, n - 1})
    # Every rank is the global set, which add_process_set refuses to register twice.
    ps = hvd.global_process_set if len(members) == n else hvd.add_process_set(members)
    c.equal(int(hvd.size_op(process_set_id=ps.process_set_id).numpy()), len(members),
            "size_op of a process set (every rank)")
    if me in members:
        obj = ("ps", me, list(range(me + 1)))
        c.equal(str(hvd.broadcast_object(obj, root_rank=n - 1, process_set=ps)),
                str(("ps", n - 1, list(range(n)))), "broadcast_object in a process set")
        c.equal(str(hvd.allgather_object(obj, process_set=ps)),
                str([("ps", r, list(range(r + 1))) for r in members]),
                "allgather_object in a process set")
        for inplace in (False, True):
            v = tf.Variable(np.random.default_rng([33, me, inplace]).normal(size=(2, 3)))
            hvd.broadcast_variables([v], root_rank=n - 1, process_set=ps, inplace=inplace)
            c.equal(v.numpy(), np.random.default_rng([33, n - 1, inplace]).normal(size=(2, 3)),
                    "broadcast_variables in a process set (inplace=%s)" % inplace)
    if ps is not hvd.global_process_set:
        hvd.remove_process_set(ps)
    import nvgroup_tf.keras as hvdk
    c.check(hvdk.ProcessSet is hvd.ProcessSet and hvdk.global_process_set is hvd.global_process_set,
            "process sets in the Keras namespace")
    table = np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3)
    got = hvdk.reducescatter(table * (me + 1), name="keras_reducescatter_value")
    c.equal(got.numpy(), table[2 * me:2 * me + 2] * (n + 1) / 2.0, "keras reducescatter(value)")
    v = tf.Variable(np.full([3], float(me)))
    hvd.broadcast_variables([v], 0, inplace=True)
    c.equal(v.numpy(), np.zeros(3), "broadcast_variables(inplace=True)")


def _events(path):
    with open(path) as f:
        return json.load(f)


def check_timeline(c, out_dir):
    me = hvd.rank()
    c.raises(ValueError, lambda: hvd.start_timeline(""), "start_timeline('')")
    first = os.path.join(out_dir, "first_rank%d.json" % me)
    hvd.start_timeline(first)
    for i in range(3):
        hvd.allreduce(tf.constant([1.0, 2.0]), op=hvd.Sum, name="timeline.a%d" % i)
    hvd.stop_timeline()
    hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="timeline.after_stop")
    second = os.path.join(out_dir, "second_rank%d.json" % me)
    hvd.start_timeline(second, mark_cycles=True)
    hvd.allgather(tf.constant([[1.0]]), name="timeline.b")
    hvd.start_timeline(second + ".again")  # replaces the open one (closed, valid)
    hvd.broadcast(tf.constant([3.0]), 0, name="timeline.c")
    hvd.stop_timeline()
    hvd.stop_timeline()  # no timeline open: fine
    bad = os.path.join(out_dir, "no_such_dir", "t.json")
    if me == 0:
        c.raises(tf.errors.InvalidArgumentError, lambda: hvd.start_timeline(bad),
                 "start_timeline into a missing directory (rank 0)", contains="no_such_dir")
    else:
        hvd.start_timeline(bad)  # other ranks write nothing
    if me != 0:
        c.check(not any(os.path.exists(p) for p in (first, second, second + ".again")),
                "rank %d writes no timeline" % me)
        return
    names = lambda events: {e["args"]["name"] for e in events if e.get("ph") == "M"}  # noqa: E731
    ev1 = _events(first)
    has = lambda events, user_name: any(user_name in row for row in names(events))  # noqa: E731
    c.check(all(has(ev1, "timeline.a%d" % i) for i in range(3)),
            "first timeline has the three allreduces: %s" % names(ev1))
    c.check(not has(ev1, "timeline.after_stop"), "nothing after stop")
    c.check(not any(e.get("name") == "CYCLE_START" for e in ev1), "no cycle marks by default")
    ev2 = _events(second)
    c.check(len(names(ev2)) == 1 and has(ev2, "timeline.b"), "second timeline: %s" % names(ev2))
    c.check(any(e.get("name") == "CYCLE_START" and e.get("ph") == "i" for e in ev2),
            "mark_cycles=True marks cycles")
    phases = {e["name"] for e in ev2 if e.get("ph") in ("B", "E")}
    c.check({"NEGOTIATE", "ALLGATHER"} <= phases, "second timeline phases %s" % phases)
    ev3 = _events(second + ".again")
    c.check(len(names(ev3)) == 1 and has(ev3, "timeline.c"), "third timeline: %s" % names(ev3))


def main():
    c = Checker("api_small")
    concrete = before_init(c)
    hvd.init()
    check_topology_ops(c, concrete, "COMM_WORLD")
    check_flags_and_util(c)
    check_broadcast_global_variables(c)
    check_objects_in_graphs(c)
    check_indexed_slices(c)
    check_process_set_helpers(c)
    check_timeline(c, sys.argv[1])
    # Re-init over a sub-communicator: the same traced graph reads the new values.
    from mpi4py import MPI
    me = MPI.COMM_WORLD.rank
    sub = MPI.COMM_WORLD.Split(me % 2, me)
    hvd.shutdown()
    hvd.init(sub)
    check_topology_ops(c, concrete, "sub-communicator")
    c.equal(hvd.size(), sub.size, "sub-communicator size")
    hvd.shutdown()
    c.finish()


if __name__ == "__main__":
    run(main)
