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
