"""Single-process checks of the Python package (no mpirun)."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_python(code):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_import_is_lazy():
    # nvgroup_tf.runner and nvgroup_tf._engine users must not pay for TensorFlow.
    proc = run_python("import sys, nvgroup_tf, nvgroup_tf.runner\n"
                      "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
                      "print('lazy ok')")
    assert proc.returncode == 0 and "lazy ok" in proc.stdout, proc.stdout + proc.stderr


def test_public_names_resolve_and_match_horovod():
    proc = run_python(
        "import nvgroup_tf as hvd\n"
        "missing = [n for n in hvd.__all__ if getattr(hvd, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == "
        "(0, 1, 2, 3, 4, 5)\n"
        "assert hvd.mpi_ops.allgather is hvd.allgather and not hvd.is_initialized()\n"
        "try:\n    hvd.nonexistent\nexcept AttributeError as e:\n    print('attr ok', e)\n")
    assert proc.returncode == 0 and "attr ok" in proc.stdout, proc.stdout + proc.stderr


def _run_ok(code, marker="done"):
    proc = run_python(code + "\nprint(%r)\n" % marker)
    assert proc.returncode == 0 and marker in proc.stdout, proc.stdout + proc.stderr[-8000:]
    return proc


def test_unregistered_process_set_id_is_a_value_error_at_the_call():
    # Horovod (test_tensorflow_process_sets.py): a ProcessSet whose id was set by
    # hand to an unregistered one makes the collective raise ValueError.
    _run_ok(
        "import tensorflow as tf, nvgroup_tf as hvd\n"
        "hvd.init()\n"
        "fake = hvd.ProcessSet([0])\n"
        "fake.process_set_id = 10\n"
        "for call in (lambda: hvd.allreduce(tf.ones(4), process_set=fake),\n"
        "             lambda: hvd.allgather(tf.ones(4), process_set=fake),\n"
        "             lambda: hvd.DistributedGradientTape(tf.GradientTape(), process_set=fake)):\n"
        "    try:\n"
        "        call()\n"
        "    except ValueError as e:\n"
        "        assert 'process set id 10 is not registered' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('no ValueError')\n")


def test_mpi_ops_basics_and_process_set_str_as_horovod():
    # Horovod's process-set tests call hvd.mpi_ops._basics._get_process_set_ids_and_ranks()
    # and compare str(ProcessSet) with its format.
    _run_ok(
        "import nvgroup_tf as hvd\n"
        "hvd.init()\n"
        "b = hvd.mpi_ops._basics\n"
        "assert b._get_process_set_ids_and_ranks() == {0: [0]}, b._get_process_set_ids_and_ranks()\n"
        "assert b._process_set_size(0) == 1 and b._process_set_rank(0) == 0 and b.size() == 1\n"
        "assert str(hvd.global_process_set) == 'ProcessSet(process_set_id=0, ranks=[0], mpi_comm=None)', "
        "str(hvd.global_process_set)\n"
        "assert str(hvd.ProcessSet([2, 0])) == 'ProcessSet(process_set_id=None, ranks=[0, 2], mpi_comm=None)'\n"
        "hvd.init(process_sets=[])  # init again: no error\n")


TF1_GRAPH_STEP = r"""
import numpy as np, tensorflow as tf, nvgroup_tf as hvd
hvd.init()
rng = np.random.default_rng(7)
w0, x = rng.standard_normal((3, 2)), rng.standard_normal((5, 3))
results = []
for wrap in (False, True):
    with tf.Graph().as_default():
        w = tf.compat.v1.Variable(w0)
        loss = tf.reduce_sum(tf.tanh(tf.constant(x) @ w))
        opt = tf.compat.v1.train.GradientDescentOptimizer(0.5)
        if wrap:
            opt = hvd.DistributedOptimizer(opt, use_locking=False)
            assert isinstance(opt, tf.compat.v1.train.Optimizer), type(opt)
            assert opt.get_name() == "DistributedGradientDescentOptimizer", opt.get_name()
            pairs = opt.compute_gradients(loss, [w])
            assert len(pairs) == 1 and pairs[0][1] is w
        train = opt.minimize(loss, var_list=[w])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train)
            results.append(sess.run(w))
want = w0 - 0.5 * (x.T @ (1.0 - np.tanh(x @ w0) ** 2))   # float64 gradient of the loss
np.testing.assert_allclose(results[0], want, rtol=1e-12)
assert np.array_equal(results[0], results[1]), "one rank: the wrapped step is the plain one"
try:
    hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), backward_passes_per_step=2)
except NotImplementedError as e:
    assert "backward_passes_per_step" in str(e), e
else:
    raise AssertionError("backward_passes_per_step=2 accepted")
"""


def test_distributed_optimizer_wraps_tf1_train_optimizer():
    # Horovod's hvd.DistributedOptimizer takes a tf.compat.v1.train.Optimizer (TF1 graph code).
    _run_ok(TF1_GRAPH_STEP)


def test_keras3_variable_ref_is_the_held_tf_variable_ref():
    _run_ok(
        "import numpy as np, tensorflow as tf, keras, nvgroup_tf as hvd\n"
        "hvd.init()\n"
        "v = keras.Variable(np.ones((2,)))\n"
        "hvd.DistributedGradientTape(tf.GradientTape())  # installs the Keras 3 shims\n"
        "r = v.ref()\n"
        "assert r == v._value.ref() and hash(r) == hash(v._value.ref()) and r.deref() is v._value\n"
        "assert v.ref() in {v._value.ref()} and v.ref() != keras.Variable(np.ones((2,))).ref()\n"
        "back = hvd.refs_to_vars(hvd.vars_to_refs([v]))\n"
        "assert back[0] is v, back\n")


def test_optimizer_lr_argument_as_tf_keras_2():
    _run_ok(
        "import warnings, keras, nvgroup_tf.keras\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    opt = keras.optimizers.SGD(lr=0.25, momentum=0.5)\n"
        "    adam = keras.optimizers.Adam(lr=0.125)\n"
        "assert abs(float(opt.learning_rate.numpy()) - 0.25) == 0 and float(opt.momentum) == 0.5\n"
        "assert float(adam.learning_rate.numpy()) == 0.125\n"
        "assert any('learning_rate' in str(w.message) for w in caught), [str(w.message) for w in caught]\n"
        "assert 'lr' not in opt.get_config()\n")


def test_sync_batch_normalization_accepts_and_ignores_fused():
    _run_ok(
        "import numpy as np, tensorflow as tf, keras, nvgroup_tf as hvd\n"
        "hvd.init()\n"
        "x = tf.constant(np.random.default_rng(3).standard_normal((8, 4)))\n"
        "want = keras.layers.BatchNormalization(dtype='float64')(x, training=True).numpy()\n"
        "for fused in (True, None, False):\n"
        "    layer = hvd.SyncBatchNormalization(fused=fused, dtype='float64')\n"
        "    got = layer(x, training=True).numpy()\n"
        "    assert np.array_equal(got, want), (fused, np.abs(got - want).max())\n")
