"""GradientReducer's bucket choice: size-based by default, Horovod's groups /
num_groups when given (single process, no collectives)."""
import pytest

tf = pytest.importorskip("tensorflow")

from nvgroup_tf.gradient_reducer import GradientReducer, ReduceOptions, resolve_bucket_cap_bytes  # noqa: E402

MiB = 1 << 20


class _Var:
    def __init__(self, path):
        self.path = path


def test_cap_argument_else_the_agreed_value(monkeypatch):
    assert resolve_bucket_cap_bytes(123) == 123  # the argument wins
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="bucket_cap_bytes"):
            resolve_bucket_cap_bytes(bad)
    # Without the argument: NVGROUP_BUCKET_CAP_MB as the ranks agreed it at
    # init (tests/keras: check_bucket_cap_is_the_agreed_value), never the
    # environment now; before init there is no agreed value.
    monkeypatch.setenv("NVGROUP_BUCKET_CAP_MB", "2.5")
    with pytest.raises(ValueError, match="not been initialized"):
        resolve_bucket_cap_bytes(None)
    with pytest.raises(ValueError, match="not been initialized"):
        GradientReducer(ReduceOptions()).cap_bytes  # built before init: read when first needed


def test_size_buckets_first_small():
    r = GradientReducer(ReduceOptions(bucket_cap_bytes=4 * MiB))
    sizes = [MiB // 2, MiB // 2, MiB // 2, 3 * MiB, MiB]
    assert r._buckets(sizes, ["float32"] * 5, list("abcde")) == [[0, 1], [2, 3], [4]]


def test_num_groups_and_groups():
    r = GradientReducer(ReduceOptions(num_groups=2))
    assert r._buckets([4] * 5, ["float32"] * 5, list("abcde")) == [[0, 1], [2, 3, 4]]
    r = GradientReducer(ReduceOptions(groups=[[_Var("a"), _Var("d")], [_Var("b")]], bucket_cap_bytes=0))
    # explicit groups (split by dtype), the rest bucketed by size (cap 0: alone)
    assert r._buckets([4] * 5, ["float32", "float32", "float32", "float16", "float32"], list("abcde")) == [
        [0], [1], [2], [3], [4]]
    r = GradientReducer(ReduceOptions(groups=[[_Var("a"), _Var("c")]], bucket_cap_bytes=MiB))
    assert r._buckets([4] * 4, ["float32"] * 4, list("abcd")) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="more than one group"):
        GradientReducer(ReduceOptions(groups=[[_Var("a")], [_Var("a")]]))


REDUCE_ALONE = r"""
import numpy as np, tensorflow as tf
import nvgroup_tf as hvd
from nvgroup_tf import gradient_reducer, op_library
from nvgroup_tf.gradient_reducer import GradientReducer, ReduceOptions
hvd.init()
assert hvd.size() == 1
rng = np.random.default_rng(5)
values = [rng.standard_normal(s).astype(np.float32) for s in [(3, 4), (7,), (2, 2, 2)]]
variables = [tf.Variable(v) for v in values]
grads = [tf.constant(rng.standard_normal(v.shape).astype(np.float32)) for v in values]
for alone in (False, True):
    gradient_reducer.set_reduce_alone_for_testing(alone)
    reducer = GradientReducer(ReduceOptions(bucket_cap_bytes=0))
    fn = tf.function(lambda gs: reducer.reduce(gs, variables))
    graph = fn.get_concrete_function([tf.TensorSpec(g.shape, g.dtype) for g in grads]).graph
    collectives = [op.type for op in graph.get_operations() if op.type.startswith("Nvgroup")]
    op_library.set_bucket_delay_for_testing(1.0)
    before = op_library.delayed_buckets_for_testing()
    out = fn(grads)
    delayed = op_library.delayed_buckets_for_testing() - before
    op_library.set_bucket_delay_for_testing(0)
    for g, o in zip(grads, out):
        assert np.array_equal(g.numpy(), o.numpy()), "reduced gradient differs from the rank's own"
    print("ALONE", alone, len(collectives), delayed)
"""


def test_one_rank_reduces_through_the_engine_only_when_asked(tmp_path):
    """A job of one rank keeps its gradients (Horovod's behaviour); the
    benchmarks' switch sends them through the engine's buckets (and the
    simulated link) with the same results."""
    import os
    import subprocess
    import sys
    script = tmp_path / "alone.py"
    script.write_text(REDUCE_ALONE)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
               TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line.split() for line in out.stdout.splitlines() if line.startswith("ALONE")]
    assert lines[0] == ["ALONE", "False", "0", "0"], lines
    # the engine may fuse the three into one bucket of its own: at least one was delayed
    assert lines[1][:2] == ["ALONE", "True"] and int(lines[1][2]) > 0 and int(lines[1][3]) >= 1, lines
