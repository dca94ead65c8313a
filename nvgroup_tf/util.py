"""Horovod's small TensorFlow helpers (horovod.tensorflow.util), which user code imports.

  * _executing_eagerly(): True outside graphs (False inside tf.function and TF1 graphs).
  * _make_subgraph(f): tf.function(f).
  * _cache(f): memoizes f(*args) per (args, executing eagerly).
  * vars_to_refs / refs_to_vars: hashable stand-ins for variables (a list
    becomes a tuple, recursively) and back. tf.Variable gives its own .ref();
    Keras 3 variables are neither hashable nor have .ref(), so they get an
    identity-keyed reference with the same .deref().
  * handle_average_backwards_compatibility(op, average), check_num_rank_power_of_2(n):
    Horovod's helpers of the same names (exported by horovod.tensorflow).
"""
import warnings

from tensorflow.python.eager import context


def _executing_eagerly():
    """True if eager execution is enabled here (not inside a graph or tf.function)."""
    return context.executing_eagerly()


def _make_subgraph(f):
    import tensorflow as tf
    return tf.function(f)


def _cache(f):
    cache = {}

    def wrapper(*args):
        key = (args, _executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]

    return wrapper


class _IdentityRef:
    """Hashable reference to an object that is not hashable itself (Keras 3 variables)."""

    __slots__ = ("_obj",)

    def __init__(self, obj):
        self._obj = obj

    def deref(self):
        return self._obj

    def __hash__(self):
        return id(self._obj)

    def __eq__(self, other):
        return isinstance(other, _IdentityRef) and other._obj is self._obj

    def __repr__(self):
        return "<ref to %r>" % (getattr(self._obj, "path", None) or getattr(self._obj, "name", self._obj),)


def _ref(var):
    # A Keras 3 variable's own ref() (nvgroup_tf/keras/compat.py) names the
    # tf.Variable it holds; here the Keras variable itself comes back from refs_to_vars.
    if type(var).__module__.startswith("keras."):
        return _IdentityRef(var)
    ref = getattr(var, "ref", None)
    return ref() if callable(ref) else _IdentityRef(var)


def vars_to_refs(vars):  # noqa: A002 -- Horovod's argument name
    if isinstance(vars, list):
        return tuple(vars_to_refs(v) for v in vars)
    return _ref(vars)


def refs_to_vars(refs):
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()


def handle_average_backwards_compatibility(op, average):
    """The reduce op from `op` and the deprecated `average` (Horovod's rules):
    both given -> ValueError; only average -> Average or Sum (DeprecationWarning);
    neither -> Average."""
    from nvgroup_tf.mpi_ops import Average, Sum
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=2)
        return Average if average else Sum
    return Average


def check_num_rank_power_of_2(num_rank):
    """True when num_rank is a positive power of two."""
    return num_rank > 0 and (num_rank & (num_rank - 1)) == 0
