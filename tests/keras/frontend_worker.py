"""Multi-rank checks of the Keras/TF front end (issue 9 and the optimizer/tape
parts of issue 10). Run under mpirun by test_frontend.py:
`frontend_worker.py check1 check2 ...`; same protocol as keras_worker.py (each
check prints "[rank r] ok name" or "[rank r] FAIL name: why"; exit 1 if any
failed). Helpers (data, reference fit, bitwise cross-rank comparison) come from
keras_worker.py, which also initializes nvgroup_tf.
"""
import os
import sys
import tempfile
import traceback

import numpy as np
import tensorflow as tf
import keras

from keras_worker import (B, LR, RANK, SIZE, STEPS, assert_close, assert_same_on_all_ranks,  # noqa: F401
                          dense_model, global_data, rank_slice, reference_fit)
import nvgroup_tf as hvd_core
import nvgroup_tf.keras as hvd


def expect_error(fn, exc_types, needle):
    try:
        fn()
    except exc_types as e:
        assert needle in str(e), "error %r does not mention %r" % (str(e), needle)
        return e
    raise AssertionError("expected %s mentioning %r" % (exc_types, needle))


# ---------------------------------------------------------------- item 1: lazy builds


class SubclassedNet(keras.Model):
    def __init__(self):
        super().__init__()
        self.d1 = keras.layers.Dense(8, activation="tanh")
        self.d2 = keras.layers.Dense(3)

    def call(self, x):
        return self.d2(self.d1(x))


def check_broadcast_callback_lazily_built_models():
    x, y = global_data(seed=501)
    for kind in ("subclassed", "sequential_without_input"):
        keras.utils.set_random_seed(300 + RANK)   # different initial weights per rank
        if kind == "subclassed":
            model = SubclassedNet()
        else:
            model = keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
        assert not model.variables, "test setup: %s should not be built before fit" % kind
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
        cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
        model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
        assert getattr(cb, "broadcast_done", True)
        assert_same_on_all_ranks(model.get_weights(), "%s weights after broadcast + fit" % kind)
        assert_same_on_all_ranks([v.numpy() for v in model.optimizer.variables], "%s Adam state" % kind)
    # Nothing to broadcast: an error on every rank, not a silent success.
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.layers.Dense(3)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    model.build((None, 6))
    model.optimizer.build(model.trainable_variables)
    local = list(model.variables) + list(model.optimizer.variables)
    cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=local)
    expect_error(lambda: model.fit(rank_slice(x), rank_slice(y), batch_size=B, epochs=1, verbose=0,
                                   callbacks=[cb]), RuntimeError, "nothing was broadcast")


# ---------------------------------------------------------------- item 3: names inside tf.function


def check_auto_names_survive_uneven_retrace():
    """An unnamed allgather in a tf.function retraced on rank 0 only (its last
    batch is smaller), then an unnamed allreduce in another function: with
    per-trace counters the names drift apart across ranks and the job hangs."""
    rng = np.random.default_rng(600)
    rows = [4, 3] if RANK == 0 else [4, 4]   # rank 0: uneven last batch -> second trace
    data = [rng.standard_normal((n, 2)) + RANK for n in rows]

    @tf.function
    def gather(x):
        return hvd_core.allgather(x)

    @tf.function
    def total(x):
        with tf.name_scope("scoped"):
            return hvd_core.allreduce(x, op=hvd_core.Sum) + hvd_core.allreduce(2.0 * x, op=hvd_core.Sum)

    for step, x in enumerate(data):
        got = gather(tf.constant(x)).numpy()
        per_rank = hvd.allgather_object(x)
        np.testing.assert_array_equal(got, np.concatenate(per_rank), err_msg="allgather step %d" % step)
    v = np.arange(5, dtype=np.float64) * (RANK + 1)
    got = total(tf.constant(v)).numpy()
    expected = 3.0 * np.arange(5, dtype=np.float64) * sum(r + 1 for r in range(SIZE))
    np.testing.assert_array_equal(got, expected)
    names = [op.get_attr("tensor_name").decode() for op in
             total.get_concrete_function(tf.constant(v)).graph.get_operations() if op.type == "NvgroupAllreduce"]
    assert sorted(names) == ["NvgroupAllreduce.graph:total/scoped/NvgroupAllreduce",
                             "NvgroupAllreduce.graph:total/scoped/NvgroupAllreduce_1"], names


# ---------------------------------------------------------------------------- main


def main(names):
    failed = 0
    for name in names:
        fn = globals()["check_" + name]
        try:
            fn()
            print("[rank %d] ok %s" % (RANK, name), flush=True)
        except Exception:
            failed += 1
            print("[rank %d] FAIL %s:\n%s" % (RANK, name, traceback.format_exc()), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
