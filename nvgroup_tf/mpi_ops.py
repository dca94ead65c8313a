"""The collectives: allreduce, grouped_allreduce, allgather, broadcast (Horovod API).

Each function checks init, resolves the name the engine matches across ranks,
and calls the op from ops/nvgroup_ops.cc. Gradients are registered for every op.

Note [Collective names]. The engine matches a collective across ranks by name,
so names must be identical on all ranks and unique among collectives in flight.
  * name=... given: the engine name is the name itself, whatever the
    collective (e.g. "grad/dense/kernel"), so one name used for different
    collectives on different ranks is a mismatch error on every rank
    (tf.errors.FailedPreconditionError "Mismatched collective types"), not a
    stall; on one rank a name may be reused once the previous collective of
    that name completed. Use this whenever ranks may issue
    collectives in different orders (threads, independent graph branches) and
    for tensors reduced every step (a stable name lets the engine's response
    cache skip negotiation).
  * name=None, eager: "<OpType>.auto<k>", where k counts this process's
    unnamed eager calls of that op type. Deterministic as long as every rank
    makes the same sequence of unnamed eager calls.
  * name=None, inside a graph (tf.function): "<OpType>.graph:<graphs>/<node>",
    where <node> is the name TF gives the op in its graph (name scope plus
    TF's per-graph "_1", "_2" suffixes: the same on every rank that builds the
    same program) and <graphs> the names of the enclosing function graphs,
    outermost first (the tf.function's Python name; a cond/while branch's
    name without the process-wide uid TF appends). Like Horovod, which names
    an unnamed op inside a graph after the graph's tensor names. Nothing here
    depends on how often a function was traced, so a retrace on one rank only
    (an uneven last batch, a function traced only on rank 0) shifts no name.
  * ignore_name_scope (Horovod's argument) is accepted and changes nothing:
    a given name never includes the name scope (Horovod's ignore_name_scope=True
    behaviour), and an unnamed graph op keeps its scope, which makes it unique.
  * gradients: "<forward name>/grad" (allgather's sizes: "/grad_sizes").
  * grouped_allreduce: tensor i is "<name>[i]" (ops/adapter.h).

Note [Stateful ops]. The ops are registered stateful (ops/nvgroup_ops.cc):
TF then never prunes a collective whose result this rank does not use (the
other ranks would wait for it forever), never constant-folds one whose input
is a constant (it would run once, at graph optimisation time, on one rank's
schedule), and never merges two by CSE. Inside a tf.function, TF's automatic
control dependencies would chain every stateful op in program order, which
serialises independent collectives (no overlap of gradient buckets with
backprop, no fusion of what is in flight together). Each collective op is
therefore marked to run independently (`_checked` below calls the graph's
AutomaticControlDependencies.run_independently, which adds it to the
function's control outputs, so it always runs, and gives it no control edges,
so it starts as soon as its inputs exist) -- the treatment TF gives its own
collectives (CollectiveReduce & co. in auto_control_deps.ASYNC_STATEFUL_OPS).
"""
from __future__ import annotations

import collections
import re
import threading
import warnings
from typing import TYPE_CHECKING, Optional, Sequence, Union

import tensorflow as tf

from nvgroup_tf import basics
from nvgroup_tf import process_sets as _process_sets
from nvgroup_tf._validation import check_arguments
from nvgroup_tf.compression import Compression
from nvgroup_tf.exceptions import NOT_INITIALIZED_MESSAGE

if TYPE_CHECKING:
    from nvgroup_tf.compression import Compressor

# Horovod's horovod.tensorflow.mpi_ops._basics (its HorovodBasics object), which
# Horovod's process-set tests call: here the basics module, which has those methods.
_basics = basics

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
    """Eager or user-given names; see Note [Collective names]."""
    if name is not None:
        return str(name)
    with _name_lock:
        k = _auto_counts[op_type]
        _auto_counts[op_type] += 1
    return "%s.auto%d" % (op_type, k)


def _node_name(engine_name):
    """A valid TF node name for graphs (eager ignores it)."""
    cleaned = "".join(c if c.isalnum() or c in "_-." else "_" for c in engine_name)
    return cleaned.lstrip("_-.") or "Nvgroup"


_UID_SUFFIX = re.compile(r"_\d+$")


def _graph_path(graph):
    """Names of the function graphs enclosing `graph` (itself included),
    outermost first, without the uid TF appends to control-flow branches."""
    from tensorflow.python.ops import control_flow_v2_func_graphs as cf_graphs
    names = []
    while graph is not None:
        name = getattr(graph, "name", "") or ""
        if isinstance(graph, cf_graphs.ControlFlowFuncGraph):
            name = _UID_SUFFIX.sub("", name)
        if name:
            names.append(name)
        graph = getattr(graph, "outer_graph", None)
    return "/".join(reversed(names))


def _names(op_type, name):
    """(engine name, TF node name, expected full node name or None) of a new
    collective op; see Note [Collective names]."""
    if name is not None or tf.executing_eagerly():
        engine_name = _engine_name(op_type, name)
        return engine_name, _node_name(engine_name), None
    graph = tf.compat.v1.get_default_graph()
    # The op is created right after this with node name `op_type` in the
    # current name scope, so TF gives it exactly this unique name.
    node = graph.unique_name(op_type, mark_as_used=False)
    return "%s.graph:%s/%s" % (op_type, _graph_path(graph), node), op_type, node


def _checked(result, expected_node=None):
    """Every new collective op passes through here: in a graph, checks that it
    got the node name its engine name was derived from, and lets it run
    independently of automatic control dependencies (Note [Stateful ops])."""
    if tf.executing_eagerly():
        return result
    op = (result[0] if isinstance(result, (list, tuple)) else result).op
    if expected_node is not None and op.name != expected_node:
        raise RuntimeError("nvgroup_tf: internal naming error: op named %r, expected %r"
                           % (op.name, expected_node))
    acd = getattr(op.graph, "experimental_acd_manager", None)
    if acd is not None:
        acd.run_independently(op)
    return result


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


def _allreduce(tensor, op=Sum, prescale_factor=1.0, postscale_factor=1.0, name=None,
               process_set=None):
    """Raw allreduce op (no compression, no IndexedSlices handling)."""
    _check_initialized()
    engine_name, node_name, expected_node = _names("NvgroupAllreduce", name)
    return _checked(basics.op_module().nvgroup_allreduce(
        tensor, reduce_op=_REDUCE_OP_ATTR[op], prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, tensor_name=engine_name,
        process_set_id=_process_sets._process_set_id(process_set), name=node_name), expected_node)


def _grouped_allreduce(tensors, op=Sum, prescale_factor=1.0, postscale_factor=1.0, name=None,
                       process_set=None, done_after=None):
    """done_after (XLA programs only): tensors that must exist before XLA may
    use the results (ops/xla_ops.h Note [Start and done], "Done after")."""
    _check_initialized()
    if done_after:
        engine_name, node_name, expected_node = _names("NvgroupXlaGroupedAllreduce", name)
        return _checked(basics.op_module().nvgroup_xla_grouped_allreduce(
            tensors, list(done_after), reduce_op=_REDUCE_OP_ATTR[op], prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, tensor_name=engine_name,
            process_set_id=_process_sets._process_set_id(process_set), name=node_name), expected_node)
    engine_name, node_name, expected_node = _names("NvgroupGroupedAllreduce", name)
    return _checked(basics.op_module().nvgroup_grouped_allreduce(
        tensors, reduce_op=_REDUCE_OP_ATTR[op], prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, tensor_name=engine_name,
        process_set_id=_process_sets._process_set_id(process_set), name=node_name), expected_node)


def in_xla_program():
    """True while tracing a function XLA compiles (tf.function(jit_compile=True),
    Keras' jit_compile)."""
    if tf.executing_eagerly():
        return False
    from tensorflow.python.ops import control_flow_util
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def _allgather(tensor, name=None, process_set=None):
    _check_initialized()
    engine_name, node_name, expected_node = _names("NvgroupAllgather", name)
    return _checked(basics.op_module().nvgroup_allgather(
        tensor, tensor_name=engine_name, process_set_id=_process_sets._process_set_id(process_set),
        name=node_name), expected_node)


def _broadcast(tensor, root_rank, name=None, process_set=None):
    _check_initialized()
    engine_name, node_name, expected_node = _names("NvgroupBroadcast", name)
    return _checked(basics.op_module().nvgroup_broadcast(
        tensor, root_rank=root_rank, tensor_name=engine_name,
        process_set_id=_process_sets._process_set_id(process_set), name=node_name), expected_node)


def _sparse_allreduce(slices, op, prescale_factor, postscale_factor, name, process_set=None):
    """IndexedSlices, as Horovod treats them: gather every rank's values and
    indices (duplicate indices are summed by whoever applies the slices);
    Average divides the gathered values by the set's size with TF's `/`, so
    integer values come back as floats (int32/int64 -> float64), as with
    Horovod. Only Sum and Average, and no scale factors (NotImplementedError,
    raised on every rank before any collective)."""
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    values = _allgather(slices.values, name=None if name is None else name + ".values",
                        process_set=process_set)
    indices = _allgather(slices.indices, name=None if name is None else name + ".indices",
                         process_set=process_set)
    if op == Average:
        values = values / tf.cast(_process_sets._process_set_size(process_set), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(tensor: Union[tf.Tensor, tf.IndexedSlices], average: Optional[bool] = None, device_dense: str = "",
              device_sparse: str = "", compression: type[Compressor] = Compression.none,
              op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: Optional[str] = None, process_set: Optional[_process_sets.ProcessSet] = None,
              ignore_name_scope: bool = False) -> Union[tf.Tensor, tf.IndexedSlices]:
    """Reduces `tensor` over all ranks (default op: Average).

    prescale_factor multiplies the input before the reduction, postscale_factor
    the result. tf.IndexedSlices are allgathered (values and indices).
    """
    check_arguments("allreduce", name=name, op=op, prescale_factor=prescale_factor,
                    postscale_factor=postscale_factor)
    op = _resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        with tf.device(device_sparse):
            return _sparse_allreduce(tensor, op, prescale_factor, postscale_factor, name, process_set)
    with tf.device(device_dense):
        compressed, ctx = compression.compress(tensor)
        reduced = _allreduce(compressed, op, prescale_factor, postscale_factor, name, process_set)
        return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors: Sequence[Union[tf.Tensor, tf.IndexedSlices]], average: Optional[bool] = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: type[Compressor] = Compression.none, op: Optional[int] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      name: Optional[str] = None, process_set: Optional[_process_sets.ProcessSet] = None,
                      ignore_name_scope: bool = False) -> list[Union[tf.Tensor, tf.IndexedSlices]]:
    """allreduce of a list of tensors, negotiated and fused as one unit."""
    return grouped_allreduce_done_after(tensors, None, average=average, device_dense=device_dense,
                                        device_sparse=device_sparse, compression=compression, op=op,
                                        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                        name=name, process_set=process_set)


def grouped_allreduce_done_after(tensors, done_after, average=None, device_dense="", device_sparse="",
                                 compression=Compression.none, op=None, prescale_factor=1.0,
                                 postscale_factor=1.0, name=None, process_set=None):
    """grouped_allreduce whose dense results, in an XLA program, are taken only
    once every tensor of `done_after` exists (None or empty: grouped_allreduce;
    ops/xla_ops.h Note [Start and done], "Done after")."""
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
                                               None if name is None else "%s.sparse%d" % (name, i),
                                               process_set)
    if dense:
        with tf.device(device_dense):
            compressed = [compression.compress(tensors[i]) for i in dense]
            reduced = _grouped_allreduce([c for c, _ in compressed], op, prescale_factor,
                                         postscale_factor, name, process_set, done_after=done_after)
            for i, r, (_, ctx) in zip(dense, reduced, compressed):
                results[i] = compression.decompress(r, ctx)
    return results


def allgather(tensor: tf.Tensor, name: Optional[str] = None, process_set: Optional[_process_sets.ProcessSet] = None,
              ignore_name_scope: bool = False) -> tf.Tensor:
    """Concatenates every rank's `tensor` along dimension 0, in rank order.
    First dimensions may differ across ranks."""
    check_arguments("allgather", name=name)
    return _allgather(tensor, name, process_set)


def broadcast(tensor: tf.Tensor, root_rank: int, name: Optional[str] = None, process_set: Optional[_process_sets.ProcessSet] = None,
              ignore_name_scope: bool = False) -> tf.Tensor:
    """`tensor` of rank `root_rank` (a global rank, also with a process set), on every rank."""
    _check_initialized()
    check_arguments("broadcast", name=name, root_rank=root_rank, size=basics.size())
    return _broadcast(tensor, root_rank, name, process_set)


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
                postscale_factor=op.get_attr("postscale_factor"),
                process_set_id=op.get_attr("process_set_id"))


@tf.RegisterGradient("NvgroupAllreduce")
def _allreduce_grad(op, grad):
    """d/dx_r of sum_r' L_r'(post * sum(pre * x)) = pre * post * sum_r' g_r':
    the same allreduce applied to the incoming gradients (as Horovod)."""
    name = _attr_text(op, "tensor_name") + "/grad"
    return _checked(basics.op_module().nvgroup_allreduce(grad, tensor_name=name, name=_node_name(name),
                                                         **_grad_allreduce_args(op)))


@tf.RegisterGradient("NvgroupGroupedAllreduce")
def _grouped_allreduce_grad(op, *grads):
    name = _attr_text(op, "tensor_name") + "/grad"
    # An output nobody used has no gradient; every rank must still contribute.
    grads = [tf.zeros_like(op.inputs[i]) if g is None else g for i, g in enumerate(grads)]
    return _checked(basics.op_module().nvgroup_grouped_allreduce(
        grads, tensor_name=name, name=_node_name(name), **_grad_allreduce_args(op)))


@tf.RegisterGradient("NvgroupXlaGroupedAllreduce")
def _xla_grouped_allreduce_grad(op, *grads):
    """As NvgroupGroupedAllreduce's; the done_after inputs only order, no gradient."""
    reduced = _grouped_allreduce_grad(op, *grads)
    return list(reduced) + [None] * (len(op.inputs) - len(op.outputs))


@tf.RegisterGradient("NvgroupAllgather")
def _allgather_grad(op, grad):
    """Horovod's gradient: the incoming gradients AVERAGED over ranks, then this
    rank's rows (Horovod averages here; the exact derivative of a sum of
    per-rank losses would be the sum, size() times larger)."""
    name = _attr_text(op, "tensor_name")
    ops = basics.op_module()
    ps_id = op.get_attr("process_set_id")
    averaged = _checked(ops.nvgroup_allreduce(grad, reduce_op="average", tensor_name=name + "/grad",
                                              process_set_id=ps_id, name=_node_name(name + "/grad")))
    shape = tf.shape(op.inputs[0], out_type=tf.int64)
    sizes = _checked(ops.nvgroup_allgather(shape[:1], tensor_name=name + "/grad_sizes",
                                           process_set_id=ps_id, name=_node_name(name + "/grad_sizes")))
    # Horovod's gradient (the average of the gradient over the set's ranks,
    # this rank's rows), taken as a slice at this rank's offset rather than
    # tf.split by `sizes`: its size is this rank's input shape, a compile-time
    # constant under XLA, where split sizes computed by a collective are not.
    me = _process_sets._process_set_rank_of(_process_set_of(ps_id))
    begin = tf.concat([tf.reduce_sum(sizes[:me], keepdims=True), tf.zeros_like(shape)[1:]], 0)
    return tf.slice(averaged, begin, shape)


@tf.RegisterGradient("NvgroupBroadcast")
def _broadcast_grad(op, grad):
    """Horovod's gradient: only the root's input reaches the outputs; it gets
    the incoming gradients AVERAGED over ranks, the other ranks zero."""
    name = _attr_text(op, "tensor_name") + "/grad"
    averaged = _checked(basics.op_module().nvgroup_allreduce(grad, reduce_op="average", tensor_name=name,
                                                             process_set_id=op.get_attr("process_set_id"),
                                                             name=_node_name(name)))
    if basics.rank() != op.get_attr("root_rank"):
        return averaged * tf.zeros([], averaged.dtype)  # as Horovod: grad * 0 (inf/NaN stay NaN)
    return averaged


# ---- reducescatter, alltoall, grouped allgather, join, process sets -------------
# reducescatter, grouped_reducescatter, alltoall, grouped_allgather, broadcast_,
# join, process_set_included_op; ops in ops/nvgroup_negotiated_output_ops.cc and
# ops/nvgroup_topology_ops.cc.

def _process_set_of(process_set_id):
    """The ProcessSet object of an op's process_set_id attr (for gradients)."""
    if process_set_id == 0:
        return None
    ps = _process_sets._registered.get(process_set_id)
    if ps is None:
        raise ValueError("process set %d of this collective is no longer registered" % process_set_id)
    return ps


def _reduce_op_attr(op, what):
    if op == Adasum:
        raise NotImplementedError("nvgroup_tf does not implement Adasum; use op=nvgroup_tf.Average "
                                  "or op=nvgroup_tf.Sum")
    if op not in (Sum, Average):
        raise ValueError("%s supports op=nvgroup_tf.Sum or nvgroup_tf.Average, got %r" % (what, op))
    return _REDUCE_OP_ATTR[op]


def _reducescatter(tensor, op=Sum, prescale_factor=1.0, postscale_factor=1.0, name=None,
                   process_set=None):
    _check_initialized()
    engine_name, node_name, expected_node = _names("NvgroupReducescatter", name)
    return _checked(basics.op_module().nvgroup_reducescatter(
        tensor, reduce_op=_reduce_op_attr(op, "reducescatter"), prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, tensor_name=engine_name,
        process_set_id=_process_sets._process_set_id(process_set), name=node_name), expected_node)


def reducescatter(tensor: tf.Tensor, device_dense: str = "", compression: type[Compressor] = Compression.none,
                  op: int = Average, name: Optional[str] = None, process_set: Optional[_process_sets.ProcessSet] = None,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduces `tensor` over the ranks (op Sum or Average, default Average) and
    scatters dimension 0: rank r gets rows [sum_{k<r} n_k, ... + n_r) with
    n_k = dim0 // size + (1 if k < dim0 % size else 0), as Horovod splits it."""
    check_arguments("reducescatter", name=name, prescale_factor=prescale_factor,
                    postscale_factor=postscale_factor)
    with tf.device(device_dense):
        compressed, ctx = compression.compress(tensor)
        reduced = _reducescatter(compressed, op, prescale_factor, postscale_factor, name, process_set)
        return compression.decompress(reduced, ctx)


def grouped_reducescatter(tensors: Sequence[tf.Tensor], device_dense: str = "",
                          compression: type[Compressor] = Compression.none, op: int = Average,
                          name: Optional[str] = None, process_set: Optional[_process_sets.ProcessSet] = None,
                          ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[tf.Tensor]:
    """reducescatter of a list of tensors, negotiated as one unit."""
    check_arguments("grouped_reducescatter", name=name, prescale_factor=prescale_factor,
                    postscale_factor=postscale_factor)
    _check_initialized()
    tensors = list(tensors)
    if not tensors:
        return tensors
    with tf.device(device_dense):
        compressed = [compression.compress(t) for t in tensors]
        engine_name, node_name, expected_node = _names("NvgroupGroupedReducescatter", name)
        reduced = _checked(basics.op_module().nvgroup_grouped_reducescatter(
            [c for c, _ in compressed], reduce_op=_reduce_op_attr(op, "grouped_reducescatter"),
            prescale_factor=prescale_factor, postscale_factor=postscale_factor,
            tensor_name=engine_name, process_set_id=_process_sets._process_set_id(process_set),
            name=node_name), expected_node)
        return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


def alltoall(tensor: tf.Tensor, splits: Optional[Union[Sequence[int], tf.Tensor]] = None,
             name: Optional[str] = None, ignore_name_scope: bool = False,
             process_set: Optional[_process_sets.ProcessSet] = None) -> Union[tf.Tensor, tuple[tf.Tensor, tf.Tensor]]:
    """Sends rows [sum(splits[:r]), sum(splits[:r+1])) of `tensor` to rank r and
    returns the rows every rank sent here, concatenated in rank order. Without
    `splits`, dimension 0 is split evenly (it must divide by the number of
    ranks) and only the output is returned; with `splits`, (output,
    received_splits) as Horovod."""
    check_arguments("alltoall", name=name)
    _check_initialized()
    splits_tensor = (tf.convert_to_tensor(splits, dtype=tf.int32) if splits is not None
                     else tf.constant([], dtype=tf.int32))
    engine_name, node_name, expected_node = _names("NvgroupAlltoall", name)
    output, received = _checked(basics.op_module().nvgroup_alltoall(
        tensor, splits_tensor, tensor_name=engine_name,
        process_set_id=_process_sets._process_set_id(process_set), name=node_name), expected_node)
    return (output, received) if splits is not None else output


def grouped_allgather(tensors: Sequence[tf.Tensor], name: Optional[str] = None,
                      ignore_name_scope: bool = False, process_set: Optional[_process_sets.ProcessSet] = None) -> list[tf.Tensor]:
    """allgather of a list of tensors, negotiated as one unit."""
    check_arguments("grouped_allgather", name=name)
    _check_initialized()
    tensors = list(tensors)
    if not tensors:
        return tensors
    engine_name, node_name, expected_node = _names("NvgroupGroupedAllgather", name)
    return _checked(basics.op_module().nvgroup_grouped_allgather(
        tensors, tensor_name=engine_name, process_set_id=_process_sets._process_set_id(process_set),
        name=node_name), expected_node)


def broadcast_(variables: Sequence[tf.Variable], root_rank: int, name: Optional[str] = None,
               process_set: Optional[_process_sets.ProcessSet] = None) -> list[tf.Tensor]:
    """Broadcasts `variables` from `root_rank` in place (Horovod's broadcast_):
    every variable is assigned the root's value; returns their new values."""
    _check_initialized()
    check_arguments("broadcast_", name=name, root_rank=root_rank, size=basics.size())
    variables = list(variables)
    assigns = []
    for i, var in enumerate(variables):
        part = None if name is None else "%s/%d" % (name, i)
        assigns.append(var.assign(_broadcast(var.read_value(), root_rank, part, process_set)))
    with tf.control_dependencies(assigns):
        return [tf.identity(var.read_value()) for var in variables]


def join() -> tf.Tensor:
    """This rank has run out of data (Horovod's join): until every rank joined,
    the other ranks' allreduces (and reducescatters) complete with this rank
    contributing zeros (Average still divides by the full size); any other
    collective submitted meanwhile fails with tf.errors.FailedPreconditionError.
    Returns the last rank to join (an int32 scalar tensor)."""
    _check_initialized()
    return _checked(basics.op_module().nvgroup_join())


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """1 if this rank belongs to process set `process_set_id`, 0 if not; -1 before
    init and -3 for an unknown set (Horovod's error codes), at run time."""
    return _checked(basics.op_module().nvgroup_process_set_included(process_set_id=process_set_id, name=name))


tf.no_gradient("NvgroupJoin")
tf.no_gradient("NvgroupProcessSetIncluded")


def _scale_of(op):
    return op.get_attr("prescale_factor") * op.get_attr("postscale_factor")


def _reducescatter_grad_of(grad, op, reduce_op_text, name):
    """Horovod's reducescatter gradient: the allgather of the incoming gradients,
    multiplied by the number of ranks for Sum (Horovod's convention), and by the
    scale factors (the chain rule; Horovod omits them)."""
    ps_id = op.get_attr("process_set_id")
    scale = _scale_of(op)
    if reduce_op_text == "sum":
        scale *= _process_sets._process_set_size(_process_set_of(ps_id))
    if scale != 1.0:
        grad = grad * tf.constant(scale, dtype=grad.dtype)
    return _checked(basics.op_module().nvgroup_allgather(grad, tensor_name=name, process_set_id=ps_id,
                                                         name=_node_name(name)))


@tf.RegisterGradient("NvgroupReducescatter")
def _reducescatter_grad(op, grad):
    return _reducescatter_grad_of(grad, op, _attr_text(op, "reduce_op"),
                                  _attr_text(op, "tensor_name") + "/grad")


@tf.RegisterGradient("NvgroupGroupedReducescatter")
def _grouped_reducescatter_grad(op, *grads):
    base = _attr_text(op, "tensor_name") + "/grad"
    out = []
    for i, g in enumerate(grads):
        if g is None:  # every rank must still contribute its part
            g = tf.zeros_like(op.outputs[i])
        out.append(_reducescatter_grad_of(g, op, _attr_text(op, "reduce_op"), "%s[%d]" % (base, i)))
    return out


@tf.RegisterGradient("NvgroupAlltoall")
def _alltoall_grad(op, grad, _received_splits_grad):
    """The rows go back where they came from: alltoall of the gradient with the
    received splits (Horovod's gradient); splits are not differentiable."""
    name = _attr_text(op, "tensor_name") + "/grad"
    if grad is None:
        grad = tf.zeros_like(op.outputs[0])
    back, _ = _checked(basics.op_module().nvgroup_alltoall(grad, op.outputs[1], tensor_name=name,
                                                           process_set_id=op.get_attr("process_set_id"),
                                                           name=_node_name(name)))
    return [back, None]


@tf.RegisterGradient("NvgroupGroupedAllgather")
def _grouped_allgather_grad(op, *grads):
    """Member by member as the allgather gradient (Horovod's): this rank's rows
    of the gradient averaged over the set's ranks."""
    base = _attr_text(op, "tensor_name")
    ps_id = op.get_attr("process_set_id")
    me = _process_sets._process_set_rank_of(_process_set_of(ps_id))
    ops = basics.op_module()
    out = []
    for i, g in enumerate(grads):
        if g is None:  # every rank must still contribute
            g = tf.zeros_like(op.outputs[i])
        averaged = _checked(ops.nvgroup_allreduce(
            g, reduce_op="average", tensor_name="%s/grad[%d]" % (base, i), process_set_id=ps_id,
            name=_node_name("%s/grad[%d]" % (base, i))))
        shape = tf.shape(op.inputs[i], out_type=tf.int64)
        sizes = _checked(ops.nvgroup_allgather(
            shape[:1], tensor_name="%s/grad_sizes[%d]" % (base, i), process_set_id=ps_id,
            name=_node_name("%s/grad_sizes[%d]" % (base, i))))
        begin = tf.concat([tf.reduce_sum(sizes[:me], keepdims=True), tf.zeros_like(shape)[1:]], 0)
        out.append(tf.slice(averaged, begin, shape))  # as allgather's gradient
    return out
