"""Argument checks of the public collectives, before anything reaches TensorFlow
or the engine.

The engine re-checks everything it receives (cc/engine/request_validation.cc,
ValidateRequest), but some mistakes never reach it intact: TensorFlow turns
root_rank=True into 1 and an int64 attribute into a truncated C int, Python
treats op=1.0 or op=True as Sum, and an unhashable op raises "unhashable
type". These checks reject such values on the calling rank with an error that
names the argument. Property-based tests: tests/reliability (hypothesis).
"""
import math
import numbers

_UNSET = object()


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and \
        type(value).__name__ != "bool_"


def check_arguments(function, name=_UNSET, op=_UNSET, root_rank=_UNSET, size=None,
                    prescale_factor=_UNSET, postscale_factor=_UNSET):
    """Raises TypeError/ValueError naming the first bad argument of `function`."""
    if name is not _UNSET and name is not None:
        if not isinstance(name, str):
            raise TypeError("%s: name must be a str or None, not %s" % (function, type(name).__name__))
        if not name:
            raise ValueError("%s: name must not be empty (pass None for an automatic name)" % function)
        if "\x00" in name:
            raise ValueError("%s: name must not contain NUL characters: %r" % (function, name))
    if op is not _UNSET and op is not None and not _is_int(op):
        raise TypeError("%s: op must be one of nvgroup_tf.Average, Sum, Min, Max, Product, not %r (%s)"
                        % (function, op, type(op).__name__))
    if root_rank is not _UNSET:
        if not _is_int(root_rank):
            raise TypeError("%s: root_rank must be an int, not %r (%s)"
                            % (function, root_rank, type(root_rank).__name__))
        if size is not None and not 0 <= root_rank < size:
            raise ValueError("%s: root_rank %d is out of range [0, %d)" % (function, root_rank, size))
    for label, factor in (("prescale_factor", prescale_factor), ("postscale_factor", postscale_factor)):
        if factor is _UNSET:
            continue
        if not isinstance(factor, numbers.Real) or isinstance(factor, bool) or type(factor).__name__ == "bool_":
            raise TypeError("%s: %s must be a real number, not %r (%s)"
                            % (function, label, factor, type(factor).__name__))
        # The factors travel as float32 op attributes (ops/nvgroup_ops.cc).
        if not math.isfinite(factor) or abs(factor) > 3.4028234663852886e38:
            raise ValueError("%s: %s must be finite and representable as float32, not %r"
                             % (function, label, factor))
