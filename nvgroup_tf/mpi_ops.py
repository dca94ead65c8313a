"""The collectives: allreduce, grouped_allreduce, allgather, broadcast (Horovod API).

Each function checks init, resolves the name the engine matches across ranks,
and calls the op from ops/nvgroup_ops.cc. Gradients are registered for every op.

Note [Collective names]. The engine matches a collective across ranks by name,
so names must be identical on all ranks and unique among collectives in flight.
  * name=... given: the engine name is "<OpType>_<name>" (e.g.
    "NvgroupAllreduce_grad/dense/kernel"). Use this whenever ranks may issue
    collectives in different orders (threads, independent graph branches) and
    for tensors reduced every step (a stable name lets the engine's response
    cache skip negotiation).
  * name=None: "<OpType>.auto<k>", where k counts this process's unnamed calls
    of that op type. In eager mode every call draws a new k; inside tf.function
    k is drawn when the function is traced and the traced graph reuses it on
    every run. Deterministic as long as every rank makes the same sequence of
    unnamed calls and traces -- the normal data-parallel program.
  * gradients: "<forward name>/grad" (allgather's sizes: "/grad_sizes").
  * grouped_allreduce: tensor i is "<name>[i]" (ops/adapter.h).
"""
import collections
import threading
import warnings

import tensorflow as tf

from nvgroup_tf import basics
from nvgroup_tf._validation import check_arguments
from nvgroup_tf.compression import Compression
from nvgroup_tf.exceptions import NOT_INITIALIZED_MESSAGE

# Horovod's values, so code comparing op constants keeps working.
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

_REDUCE_OP_ATTR = {Average: "average", Sum: "sum", Min: "min", Max: "max", Product: "product"}

_name_lock = threading.Lock()
_auto_counts = collections.Counter()


def _check_initialized():
    if not basics.is_initialized():
        raise ValueError(NOT_INITIALIZED_MESSAGE)


def _engine_name(op_type, name):
    """See Note [Collective names]."""
    if name is not None:
        return "%s_%s" % (op_type, name)
    with _name_lock:
        k = _auto_counts[op_type]
        _auto_counts[op_type] += 1
    return "%s.auto%d" % (op_type, k)


def _node_name(engine_name):
    """A valid TF node name for graphs (eager ignores it)."""
    cleaned = "".join(c if c.isalnum() or c in "_-." else "_" for c in engine_name)
    return cleaned.lstrip("_-.") or "Nvgroup"


def _resolve_op(op, average):
    if average is not None:
        warnings.warn("allreduce(average=...) is deprecated; use op=nvgroup_tf.Average or "
                      "op=nvgroup_tf.Sum", DeprecationWarning, stacklevel=3)
        if op is not None:
            raise ValueError("allreduce: pass either op or the deprecated average, not both")
        return Average if average else Sum
    op = Average if op is None else op
    if op == Adasum:
        raise NotImplementedError("nvgroup_tf does not implement Adasum; use op=nvgroup_tf.Average "
                                  "or op=nvgroup_tf.Sum")
    if op not in _REDUCE_OP_ATTR:
        raise ValueError("allreduce: unknown op %r; use nvgroup_tf.Average, Sum, Min, Max or "
                         "Product" % (op,))
    return op


def _allreduce(tensor, op=Sum, prescale_factor=1.0, postscale_factor=1.0, name=None):
    """Raw allreduce op (no compression, no IndexedSlices handling)."""
    _check_initialized()
    engine_name = _engine_name("NvgroupAllreduce", name)
    return basics.op_module().nvgroup_allreduce(
        tensor, reduce_op=_REDUCE_OP_ATTR[op], prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, tensor_name=engine_name,
        name=_node_name(engine_name))


def _grouped_allreduce(tensors, op=Sum, prescale_factor=1.0, postscale_factor=1.0, name=None):
    _check_initialized()
    engine_name = _engine_name("NvgroupGroupedAllreduce", name)
    return basics.op_module().nvgroup_grouped_allreduce(
        tensors, reduce_op=_REDUCE_OP_ATTR[op], prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, tensor_name=engine_name,
        name=_node_name(engine_name))


def _allgather(tensor, name=None):
    _check_initialized()
    engine_name = _engine_name("NvgroupAllgather", name)
    return basics.op_module().nvgroup_allgather(tensor, tensor_name=engine_name,
                                                name=_node_name(engine_name))


def _broadcast(tensor, root_rank, name=None):
    _check_initialized()
    engine_name = _engine_name("NvgroupBroadcast", name)
    return basics.op_module().nvgroup_broadcast(tensor, root_rank=root_rank,
                                                tensor_name=engine_name,
                                                name=_node_name(engine_name))


def _sparse_allreduce(slices, op, prescale_factor, postscale_factor, name):
    """IndexedSlices: gather every rank's values and indices (as Horovod does);
    duplicate indices are summed by whoever applies the slices."""
    if op not in (Sum, Average):
        raise NotImplementedError("allreduce of tf.IndexedSlices supports op=Sum or Average only")
    values = _allgather(slices.values, name=None if name is None else name + ".values")
    indices = _allgather(slices.indices, name=None if name is None else name + ".indices")
    scale = prescale_factor * postscale_factor
    if op == Average:
        scale /= basics.size()
    if scale != 1.0:
        values = values * tf.constant(scale, dtype=values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, name=None):
    """Reduces `tensor` over all ranks (default op: Average).

    prescale_factor multiplies the input before the reduction, postscale_factor
    the result. tf.IndexedSlices are allgathered (values and indices).
    """
    check_arguments("allreduce", name=name, op=op, prescale_factor=prescale_factor,
                    postscale_factor=postscale_factor)
    op = _resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        with tf.device(device_sparse):
            return _sparse_allreduce(tensor, op, prescale_factor, postscale_factor, name)
    with tf.device(device_dense):
        compressed, ctx = compression.compress(tensor)
        reduced = _allreduce(compressed, op, prescale_factor, postscale_factor, name)
        return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, name=None):
    """allreduce of a list of tensors, negotiated and fused as one unit."""
    check_arguments("grouped_allreduce", name=name, op=op, prescale_factor=prescale_factor,
                    postscale_factor=postscale_factor)
    op = _resolve_op(op, average)
    tensors = list(tensors)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    results = [None] * len(tensors)
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            with tf.device(device_sparse):
                results[i] = _sparse_allreduce(t, op, prescale_factor, postscale_factor,
                                               None if name is None else "%s.sparse%d" % (name, i))
    if dense:
        with tf.device(device_dense):
            compressed = [compression.compress(tensors[i]) for i in dense]
            reduced = _grouped_allreduce([c for c, _ in compressed], op, prescale_factor,
                                         postscale_factor, name)
            for i, r, (_, ctx) in zip(dense, reduced, compressed):
                results[i] = compression.decompress(r, ctx)
    return results


def allgather(tensor, name=None):
    """Concatenates every rank's `tensor` along dimension 0, in rank order.
    First dimensions may differ across ranks."""
    check_arguments("allgather", name=name)
    return _allgather(tensor, name)


def broadcast(tensor, root_rank, name=None):
    """`tensor` of rank `root_rank`, on every rank."""
    _check_initialized()
    check_arguments("broadcast", name=name, root_rank=root_rank, size=basics.size())
    return _broadcast(tensor, root_rank, name)


# ---- Gradients -------------------------------------------------------------

def _attr_text(op, attr):
    value = op.get_attr(attr)
    return value.decode() if isinstance(value, bytes) else value


_ATTR_TO_REDUCE_OP = {v: k for k, v in _REDUCE_OP_ATTR.items()}


def _grad_allreduce_args(op):
    reduce_op = _ATTR_TO_REDUCE_OP[_attr_text(op, "reduce_op")]
    if reduce_op not in (Sum, Average):
        raise NotImplementedError("The gradient of allreduce with op=%s is not implemented "
                                  "(only Sum and Average)" % _attr_text(op, "reduce_op"))
    return dict(reduce_op=_REDUCE_OP_ATTR[reduce_op],
                prescale_factor=op.get_attr("prescale_factor"),
                postscale_factor=op.get_attr("postscale_factor"))


@tf.RegisterGradient("NvgroupAllreduce")
def _allreduce_grad(op, grad):
    """d/dx_r of sum_r' L_r'(post * sum(pre * x)) = pre * post * sum_r' g_r':
    the same allreduce applied to the incoming gradients."""
    name = _attr_text(op, "tensor_name") + "/grad"
    return basics.op_module().nvgroup_allreduce(grad, tensor_name=name, name=_node_name(name),
                                                **_grad_allreduce_args(op))


@tf.RegisterGradient("NvgroupGroupedAllreduce")
def _grouped_allreduce_grad(op, *grads):
    name = _attr_text(op, "tensor_name") + "/grad"
    # An output nobody used has no gradient; every rank must still contribute.
    grads = [tf.zeros_like(op.inputs[i]) if g is None else g for i, g in enumerate(grads)]
    return basics.op_module().nvgroup_grouped_allreduce(
        grads, tensor_name=name, name=_node_name(name), **_grad_allreduce_args(op))


@tf.RegisterGradient("NvgroupAllgather")
def _allgather_grad(op, grad):
    """This rank's rows of the gradient summed over ranks."""
    name = _attr_text(op, "tensor_name")
    ops = basics.op_module()
    summed = ops.nvgroup_allreduce(grad, reduce_op="sum", tensor_name=name + "/grad",
                                   name=_node_name(name + "/grad"))
    shape = tf.shape(op.inputs[0], out_type=tf.int64)
    sizes = ops.nvgroup_allgather(shape[:1], tensor_name=name + "/grad_sizes",
                                  name=_node_name(name + "/grad_sizes"))
    # A slice at this rank's offset (not tf.split by `sizes`): its size is this
    # rank's input shape, a compile-time constant under XLA, where split sizes
    # computed by a collective are not.
    begin = tf.concat([tf.reduce_sum(sizes[:basics.rank()], keepdims=True), tf.zeros_like(shape)[1:]], 0)
    return tf.slice(summed, begin, shape)


@tf.RegisterGradient("NvgroupBroadcast")
def _broadcast_grad(op, grad):
    """Only the root's input reaches the outputs: it gets the sum of all ranks'
    gradients, the other ranks zero."""
    name = _attr_text(op, "tensor_name") + "/grad"
    summed = basics.op_module().nvgroup_allreduce(grad, reduce_op="sum", tensor_name=name,
                                                  name=_node_name(name))
    if basics.rank() != op.get_attr("root_rank"):
        # Zero, but computed from the allreduce's output: in a graph, an op
        # nobody consumes is pruned (ops/nvgroup_ops.cc), and the other ranks
        # would wait for it forever. multiply_no_nan keeps inf/NaN out.
        if summed.dtype in (tf.float32, tf.float64, tf.float16):
            return tf.math.multiply_no_nan(summed, tf.zeros([], summed.dtype))
        return summed * tf.zeros([], summed.dtype)
    return summed
