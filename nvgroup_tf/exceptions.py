"""Errors raised by nvgroup_tf's Python layer.

Errors of the collectives themselves come from the op kernels as TensorFlow
exceptions (ops/adapter.cc, ToTfStatus): a cross-rank mismatch is a
tf.errors.FailedPreconditionError on every rank, a shut-down engine
tf.errors.AbortedError, a lost peer tf.errors.UnavailableError, an MPI/system
failure tf.errors.InternalError. The C entry points used by init/rank/...
(ops/c_api.cc) return the same status codes; `raise_for_status` maps them the
same way, so both paths raise the same types.
"""
import tensorflow as tf

NOT_INITIALIZED_MESSAGE = "nvgroup_tf has not been initialized; call nvgroup_tf.init() first."


class NvgroupInternalError(RuntimeError):
    """An internal failure of the engine (MPI or system call) outside an op."""


# The name Horovod users catch (e.g. around elastic training loops).
HorovodInternalError = NvgroupInternalError

# Engine status codes (cc/include/nvgroup/status.h, StatusCode) -> TF exception.
_CODE_TO_TF_ERROR = {
    1: tf.errors.InvalidArgumentError,
    2: tf.errors.FailedPreconditionError,
    3: tf.errors.AbortedError,
    4: tf.errors.UnavailableError,
    5: tf.errors.DeadlineExceededError,
    6: tf.errors.InternalError,
    7: tf.errors.UnimplementedError,
}


def raise_for_status(code, message, what):
    """Raises the exception for engine status `code` (0 = OK: returns)."""
    if code == 0:
        return
    error_type = _CODE_TO_TF_ERROR.get(code)
    text = "%s failed: %s" % (what, message)
    if error_type is None:
        raise NvgroupInternalError("%s (unknown status code %d)" % (text, code))
    raise error_type(None, None, text)
