"""Gradient synchronization shared by DistributedOptimizer (Keras 3 and tf_keras)
and DistributedGradientTape.

How it works
------------
`GradientReducer.reduce(grads, variables)` turns each rank's gradients into the
reduced gradients (Average by default) of all ranks:
  * Dense gradients are taken in backprop order (the reverse of the variable
    order) and split into fusion buckets by `nvgroup_tf.bucketing.assign_buckets`
    (or by the Horovod-style `groups` / `num_groups` when given). Each bucket is
    ONE grouped_allreduce, built inside the name scope
    "<prefix>_Allreduce/<bucket_name>" (bucket index + hash of its variables'
    paths) and left unnamed, so its engine name is the graph op name (Note
    [Collective names] in mpi_ops.py): the same on every rank, stable across
    steps and retraces (the engine's response cache hits from the second step
    on), and unique per reduction -- TF uniquifies name scopes inside a graph,
    so two tapes, a persistent tape asked twice, or two optimizers over the
    same variables in one function get distinct names ("..._Allreduce_1/...")
    and can never pair one rank's bucket with another rank's different one.
    Inside a tf.function each bucket's collective depends only on its own
    gradients, so TF starts it as soon as backprop has produced them, while
    later layers' gradients are still being computed.
  * Called eagerly (a custom loop without tf.function), the whole reduction
    runs as one traced tf.function per list of variables (as Horovod does), so
    the buckets are in flight together and fused by the engine instead of
    running one blocking op after another.
  * tf.IndexedSlices (embedding gradients) go through nvgroup_tf.allreduce,
    which allgathers values and indices (cheaper than a dense reduce when few
    rows are touched); with sparse_as_dense=True they are densified first and
    fused with the dense ones.
  * Local variables (register_local_var / local_layers, Horovod's
    PartialDistributed*; given as variables or as their `v.ref()`, see
    variable_key): their gradients are not communicated; with
    scale_local_gradients (default) they are divided by size(), as Horovod does.
  * gradient_predivide_factor f (Horovod): Average becomes prescale 1/f,
    postscale f (the engine divides by size()): the same average, with the
    division split around the sum.
  * None gradients stay None. With one rank nothing is communicated (as Horovod).

`LocalAggregator` implements backward_passes_per_step=N (Horovod semantics):
every call adds the local gradients to accumulators; every N-th call the sum
(divided by N when average_aggregated_gradients) is reduced and applied, and
the accumulators are zeroed; other calls only advance the optimizer's
iteration counter. Its `counter` (Horovod's `_agg_helper.counter`) holds the
passes since the last reduction, 0..N-1. All ranks count the same calls, so
they take the same branch and issue the same collectives. `step` does it all
in one call (apply_gradients of local gradients); `compute` is Horovod's
`_compute_gradients` half: it returns the reduced sum on the N-th pass and the
local running sum on the others, and the apply that follows runs only where
`counter` is back at 0.
"""
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from nvgroup_tf import basics
from nvgroup_tf import bucketing
from nvgroup_tf import mpi_ops
from nvgroup_tf.compression import Compression

MiB = 1 << 20

# First bucket: small so the first collective starts early (PyTorch DDP uses
# 1 MiB for the same reason: kDefaultFirstBucketBytes in PyTorch's
# torch/csrc/distributed/c10d/reducer.hpp).
FIRST_BUCKET_CAP_BYTES = 1 * MiB


# Benchmarks only (set_reduce_alone_for_testing): reduce through the engine
# even when the job has one rank, which otherwise keeps its gradients.
_reduce_alone = False


def set_reduce_alone_for_testing(on: bool) -> None:
    """Benchmarks only: with `on`, a job of one rank still sends its gradients
    through the engine (its buckets, the simulated link), as a job of several
    ranks does; the results are the same. Affects reducers built (and
    functions traced) afterwards. Horovod has no such switch: a job of one
    rank skips the allreduce."""
    global _reduce_alone
    _reduce_alone = bool(on)


def check_bucket_cap_bytes(bucket_cap_bytes: Optional[int]) -> Optional[int]:
    """The constructor argument, validated (None: not given)."""
    if bucket_cap_bytes is not None and (isinstance(bucket_cap_bytes, bool) or not isinstance(bucket_cap_bytes, int)
                                         or bucket_cap_bytes < 0):
        raise ValueError("bucket_cap_bytes must be a non-negative int (0 disables fusion), got %r"
                         % (bucket_cap_bytes,))
    return bucket_cap_bytes


def resolve_bucket_cap_bytes(bucket_cap_bytes: Optional[int]) -> int:
    """Constructor argument, else NVGROUP_BUCKET_CAP_MB (MiB; default 25) as
    every rank agreed it at init (basics.agreed_setting_value: the engine's
    value, not what the variable says now), in bytes. 0 = no fusion. Without the
    argument it needs nvgroup_tf.init()."""
    if check_bucket_cap_bytes(bucket_cap_bytes) is not None:
        return bucket_cap_bytes
    return int(float(basics.agreed_setting_value("NVGROUP_BUCKET_CAP_MB")) * MiB)


def variable_path(variable, index: int) -> str:
    """Stable identity of a variable across ranks: Keras 3 `.path`, else the TF name."""
    path = getattr(variable, "path", None)
    if path:
        return str(path)
    name = getattr(variable, "name", None)
    return str(name) if name else "source_%d" % index


def _num_bytes(grad, variable) -> int:
    shape = grad.shape if grad.shape.is_fully_defined() else tf.TensorShape(getattr(variable, "shape", None))
    if not shape.is_fully_defined():
        return 0  # unknown at trace time: counts as small; assignment stays deterministic
    return int(shape.num_elements()) * tf.as_dtype(grad.dtype).size


@dataclasses.dataclass(frozen=True)
class ReduceOptions:
    """The reduction settings of DistributedOptimizer, DistributedGradientTape
    and their Partial variants, built once from their (Horovod's) keyword
    arguments and handed to GradientReducer / LocalAggregator. Field names and
    defaults are Horovod's; None for op / compression means Average /
    Compression.none. Validated by GradientReducer and LocalAggregator."""

    op: Any = None
    compression: Any = None
    sparse_as_dense: bool = False
    device_dense: str = ""
    device_sparse: str = ""
    gradient_predivide_factor: float = 1.0
    backward_passes_per_step: int = 1
    average_aggregated_gradients: bool = False
    num_groups: int = 0
    groups: Any = None
    process_set: Any = None
    scale_local_gradients: bool = True
    bucket_cap_bytes: Optional[int] = None

    def replace(self, **changes) -> "ReduceOptions":
        return dataclasses.replace(self, **changes)


class GradientReducer:
    """Allreduces lists of gradients in fusion buckets. See the module docstring."""

    def __init__(self, options: Optional[ReduceOptions] = None, name_prefix="DistributedOptimizer"):
        options = ReduceOptions() if options is None else options
        self.op = mpi_ops.Average if options.op is None else options.op
        if self.op == mpi_ops.Adasum:
            raise NotImplementedError("nvgroup_tf does not implement Adasum; use op=Average or op=Sum")
        if self.op not in (mpi_ops.Average, mpi_ops.Sum):
            # Horovod's DistributedOptimizer/DistributedGradientTape accept these two only.
            raise ValueError("op currently only supports Average and Sum (got %r): gradients are "
                             "averaged or summed over ranks" % (self.op,))
        self.process_set = check_process_set(options.process_set)
        self.gradient_predivide_factor = float(options.gradient_predivide_factor)
        if self.gradient_predivide_factor != 1.0 and self.op != mpi_ops.Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if not self.gradient_predivide_factor > 0.0:
            raise ValueError("gradient_predivide_factor must be > 0, got %r"
                             % (options.gradient_predivide_factor,))
        self.compression = Compression.none if options.compression is None else options.compression
        self.sparse_as_dense = bool(options.sparse_as_dense)
        self.device_dense = options.device_dense
        self.device_sparse = options.device_sparse
        groups, num_groups = options.groups, options.num_groups
        if groups is not None and num_groups:
            raise ValueError("give num_groups or groups, not both")
        if isinstance(groups, int):  # Horovod accepts groups=<int> as num_groups
            groups, num_groups = None, groups
        if not isinstance(num_groups, int) or num_groups < 0:
            raise ValueError("num_groups must be a non-negative int, got %r" % (num_groups,))
        self.num_groups = num_groups
        self.group_paths = None
        if groups is not None:
            self.group_paths = [[variable_path(v, -1) for v in g] for g in groups]
            seen = [p for g in self.group_paths for p in g]
            if len(seen) != len(set(seen)):
                raise ValueError("groups: a variable appears in more than one group")
        # The cap: the argument (checked against the other ranks' at the first
        # reduction, _agree_on_cap_argument), else the agreed setting, read
        # when first needed (the reducer may be built before init).
        self._cap_argument = check_bucket_cap_bytes(options.bucket_cap_bytes)
        self._cap_bytes = self._cap_argument
        self._cap_argument_agreed = False
        self.name_prefix = name_prefix
        self.scale_local_gradients = bool(options.scale_local_gradients)
        self.local_vars = []      # registered local variables, in registration order
        self.local_keys = set()   # their variable_key()s
        self._traced = {}         # eager path: variable paths -> tf.function

    def register_local_var(self, var):
        """`var`: a variable (Keras 3, tf.Variable), a watched tensor, or a reference
        (`v.ref()`, Horovod's local-variable sets)."""
        key = variable_key(var)
        if key not in self.local_keys:
            self.local_keys.add(key)
            self.local_vars.append(var.deref() if _is_reference(var) else var)

    @property
    def cap_bytes(self) -> int:
        """Fusion bucket cap in bytes (see resolve_bucket_cap_bytes)."""
        if self._cap_bytes is None:
            self._cap_bytes = resolve_bucket_cap_bytes(None)
        return self._cap_bytes

    @property
    def first_cap_bytes(self) -> int:
        return min(FIRST_BUCKET_CAP_BYTES, self.cap_bytes)

    def _agree_on_cap_argument(self):
        """A bucket_cap_bytes argument decides the buckets, so the names and
        sizes of the collectives: every rank of the set must pass the same,
        or the ranks would wait for collectives the others never start. Checked
        once per reducer, at its first reduction (every rank of the set traces
        it at the same point), by an allgather of the arguments run eagerly
        outside the function being traced; a mismatch raises ValueError on
        every rank, naming each rank's value. Without the argument every rank
        uses the value agreed at init: nothing to check."""
        if self._cap_argument is None or self._cap_argument_agreed or self.num_groups:
            return
        with tf.init_scope():
            if not tf.executing_eagerly():  # a TF1 graph: no eager collective to run here
                return
            caps = mpi_ops.allgather(tf.constant([self._cap_argument], tf.int64),
                                     name=self.name_prefix + ".bucket_cap_bytes_agreement",
                                     process_set=self.process_set)
            caps = [int(c) for c in caps.numpy()]
        if len(set(caps)) > 1:
            raise ValueError("%s: the ranks passed different bucket_cap_bytes (%s, in rank order of the process "
                             "set): every rank must pass the same" % (self.name_prefix, caps))
        self._cap_argument_agreed = True

    def _buckets(self, sizes: List[int], dtypes: List[str], paths: List[str]) -> List[List[int]]:
        """Buckets of positions into the backprop-ordered dense list."""
        n = len(sizes)
        if self.group_paths is not None:
            where = {p: k for k, g in enumerate(self.group_paths) for p in g}
            explicit: Dict[int, List[int]] = {}
            rest = []
            for i, p in enumerate(paths):
                (explicit.setdefault(where[p], []) if p in where else rest).append(i)
            by_dtype = []
            for bucket in explicit.values():  # a fused buffer has one dtype
                per = {}
                for i in bucket:
                    per.setdefault(dtypes[i], []).append(i)
                by_dtype.extend(per.values())
            if rest:
                sub = bucketing.assign_buckets([sizes[i] for i in rest], [dtypes[i] for i in rest],
                                               self.cap_bytes, self.first_cap_bytes)
                by_dtype.extend([rest[j] for j in b] for b in sub)
            return sorted(by_dtype, key=lambda b: b[0])
        if self.num_groups:
            # Horovod: split the list into num_groups parts of (nearly) equal count.
            k = min(self.num_groups, n)
            bounds = [n * j // k for j in range(k + 1)] if k else [0]
            out = []
            for j in range(k):
                per = {}
                for i in range(bounds[j], bounds[j + 1]):
                    per.setdefault(dtypes[i], []).append(i)
                out.extend(per.values())
            return sorted(out, key=lambda b: b[0])
        return bucketing.assign_buckets(sizes, dtypes, self.cap_bytes, self.first_cap_bytes)

    def reduce(self, grads: Sequence, variables: Sequence) -> List:
        """Returns the reduced gradients, same length and order as `grads`."""
        grads = list(grads)
        variables = list(variables)
        if len(grads) != len(variables):
            raise ValueError("%s: %d gradients for %d variables" % (self.name_prefix, len(grads), len(variables)))
        local = [variable_key(v) in self.local_keys for v in variables] if self.local_keys else [False] * len(
            variables)
        out = list(grads)
        if self.scale_local_gradients and any(local):
            size = float(basics.size())
            for i, g in enumerate(grads):
                if local[i] and g is not None:
                    out[i] = _scale(g, 1.0 / size)
        if basics.size() == 1 and not _reduce_alone:
            return out
        if self.process_set is not None and not (self.process_set.included() and self.process_set.size() > 1):
            # As Horovod: a rank outside the set (or a set of one) keeps its gradients.
            return out
        shared = [i for i, g in enumerate(grads) if g is not None and not local[i]]
        if not shared:
            return out
        if tf.executing_eagerly():
            reduced = self._traced_reduce([grads[i] for i in shared], [variables[i] for i in shared])
        else:
            reduced = self._reduce_in_graph([grads[i] for i in shared], [variables[i] for i in shared])
        for i, r in zip(shared, reduced):
            out[i] = r
        return out

    def _traced_reduce(self, grads, variables):
        """Eager callers: the whole reduction as one tf.function (one per list
        of variables, traced once per gradient signature)."""
        key = tuple(variable_path(v, i) for i, v in enumerate(variables))
        fn = self._traced.get(key)
        if fn is None:
            def nvg_reduce_gradients(*gs):
                return self._reduce_in_graph(list(gs), variables)
            fn = tf.function(nvg_reduce_gradients, autograph=False, reduce_retracing=True)
            self._traced[key] = fn
        return list(fn(*grads))

    def _reduce_in_graph(self, grads, variables):
        self._agree_on_cap_argument()
        paths = [variable_path(v, i) for i, v in enumerate(variables)]
        out = list(grads)
        op, prescale, postscale = self.op, 1.0, 1.0
        if self.gradient_predivide_factor != 1.0:  # Horovod: Average split around the sum
            prescale, postscale = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        with tf.name_scope(self.name_prefix + "_Allreduce"):
            dense = []   # positions into grads, backprop order
            for i in reversed(range(len(grads))):
                g = grads[i]
                if isinstance(g, tf.IndexedSlices):
                    if self.sparse_as_dense:
                        with tf.device(self.device_dense):
                            grads[i] = tf.convert_to_tensor(g)
                        dense.append(i)
                    else:
                        with tf.device(self.device_sparse), tf.name_scope(
                                "nvg_sparse_grad_" + bucketing.bucket_name(i, [paths[i]])):
                            # (predivision only matters for dense sums; the average is the same)
                            out[i] = mpi_ops.allreduce(g, op=op, compression=self.compression,
                                                       process_set=self.process_set)
                    continue
                dense.append(i)
            sizes = [_num_bytes(grads[i], variables[i]) for i in dense]
            dtypes = [tf.as_dtype(grads[i].dtype).name for i in dense]
            dense_paths = [paths[i] for i in dense]
            buckets = list(self._buckets(sizes, dtypes, dense_paths))
            # In an XLA program each bucket's results wait for every other
            # bucket's gradients (ops/xla_ops.h Note [Start and done], "Done
            # after"), so backprop runs while the bucket is in flight.
            in_xla = len(buckets) > 1 and mpi_ops.in_xla_program()
            for k, bucket in enumerate(buckets):
                members = [dense[j] for j in bucket]
                done_after = None
                if in_xla:
                    done_after = [grads[dense[j]] for other, b in enumerate(buckets) if other != k for j in b]
                with tf.device(self.device_dense), tf.name_scope(
                        bucketing.bucket_name(k, [paths[i] for i in members])):
                    reduced = mpi_ops.grouped_allreduce_done_after(
                        [grads[i] for i in members], done_after, op=op, compression=self.compression,
                        prescale_factor=prescale, postscale_factor=postscale, process_set=self.process_set)
                for i, r in zip(members, reduced):
                    out[i] = r
        return out


def _is_reference(obj) -> bool:
    return callable(getattr(obj, "deref", None))


class _IdentityKey:
    """Key of an object without `ref()`: its identity (it is kept alive)."""

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _IdentityKey) and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)


def variable_key(variable):
    """Hashable identity of a variable for local-variable lookups, the same for
    a variable and its references (`v.ref()`, hvd.vars_to_refs): a Keras 3
    variable's key is the reference of the tf.Variable it holds (what its
    `ref()` returns, nvgroup_tf/keras/compat.py); a tf.Variable's or tensor's
    is its `ref()`; a reference's is its object's; anything else is keyed by
    identity."""
    if _is_reference(variable):
        variable = variable.deref()
    held = _keras3_held_variable(variable)
    if held is not None:
        return held.ref()
    ref = getattr(variable, "ref", None)
    if callable(ref):
        try:
            return ref()
        except (TypeError, ValueError):
            pass
    return _IdentityKey(variable)


def _keras3_held_variable(variable):
    try:
        from keras.src.backend.common.variables import Variable as KerasVariable
    except ImportError:  # no Keras 3
        return None
    if isinstance(variable, KerasVariable):
        held = getattr(variable, "_value", None)
        return held if callable(getattr(held, "ref", None)) else None
    return None


def _scale(grad, factor):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def check_process_set(process_set):
    """Horovod's process_set argument, normalized: None for the global set (None,
    hvd.global_process_set or any object with process_set_id 0), else a registered
    nvgroup_tf.ProcessSet: the gradients are then reduced over its ranks only
    (Average divides by its size); on a rank outside it the gradients stay as
    they are (Horovod's behaviour)."""
    if process_set is None or getattr(process_set, "process_set_id", None) == 0:
        return None
    from nvgroup_tf import process_sets
    process_sets._process_set_id(process_set)  # TypeError / ValueError naming the problem
    return process_set


def local_layers_variables(local_layers) -> List:
    """The trainable weights of Horovod's `local_layers` argument (a Keras layer
    or a list of them; None for none), whose gradients stay local."""
    import keras
    # Keras 3 layers, and tf_keras ones under TF_USE_LEGACY_KERAS=1 (tf.keras is tf_keras then).
    layer_types = tuple({keras.layers.Layer, tf.keras.layers.Layer})
    if local_layers is None:
        return []
    if isinstance(local_layers, layer_types):
        local_layers = [local_layers]
    layers = list(local_layers)
    if not all(isinstance(layer, layer_types) for layer in layers):
        raise ValueError("All local layers must be of keras.layers.Layer type.")
    return [var for layer in layers for var in layer.trainable_weights]


class LocalAggregator:
    """backward_passes_per_step > 1: accumulate locally, reduce every N-th call."""

    def __init__(self, backward_passes_per_step: int, average_aggregated_gradients: bool):
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be an int >= 1, got %r" % (backward_passes_per_step,))
        self.n = backward_passes_per_step
        self.average = bool(average_aggregated_gradients)
        # init_scope lifts creation out of any tf.function being traced, so the
        # variables exist once, whatever retracing happens later.
        with tf.init_scope():
            self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="nvg_backward_passes")
        self.accumulators: Optional[List] = None

    def _build(self, grads, variables):
        with tf.init_scope():
            self.accumulators = [
                None if g is None else tf.Variable(tf.zeros(v.shape, dtype=g.dtype), trainable=False,
                                                   name="nvg_grad_accumulator")
                for g, v in zip(grads, variables)]

    def _accumulate(self, grads, variables):
        """Adds `grads` to the accumulators and counts the pass; returns whether
        this pass is the N-th (a bool tensor ordered after the updates)."""
        if self.accumulators is None:
            self._build(grads, variables)
        if len(grads) != len(self.accumulators) or any(
                (g is None) != (a is None) for g, a in zip(grads, self.accumulators)):
            raise ValueError("backward_passes_per_step: the set of gradients changed between calls")
        updates = [self.counter.assign_add(1)]
        for g, a in zip(grads, self.accumulators):
            if g is not None:
                updates.append(a.assign_add(tf.convert_to_tensor(g)))
        # The counter update and accumulation happen before the branch reads them.
        with tf.control_dependencies(updates):
            return tf.equal(self.counter.read_value(), self.n)

    def _aggregated(self):
        return [None if a is None else (a.read_value() / self.n if self.average else a.read_value())
                for a in self.accumulators]

    def _reset(self, after):
        """Zeroes the accumulators and the counter once the tensors `after` exist."""
        with tf.control_dependencies([t for t in after if t is not None]):
            ops = [self.counter.assign(0)]
            for a in self.accumulators:
                if a is not None:
                    ops.append(a.assign(tf.zeros_like(a)))
        return ops

    def compute(self, grads: Sequence, variables: Sequence, reduce_fn: Callable[[List], List]) -> List:
        """Horovod's `_compute_gradients` with backward_passes_per_step: adds
        `grads` to the running sums; on the N-th pass returns
        reduce_fn(aggregated) (the sums, divided by N when
        average_aggregated_gradients) and zeroes the sums and the counter,
        otherwise returns this rank's running sums (not reduced, not divided).
        None stays None."""
        grads = list(grads)
        is_boundary = self._accumulate(grads, variables)
        present = [i for i, g in enumerate(grads) if g is not None]

        def boundary():
            reduced = reduce_fn(self._aggregated())
            reduced = [tf.convert_to_tensor(reduced[i]) for i in present]
            with tf.control_dependencies(self._reset(reduced)):
                return [tf.identity(r) for r in reduced]

        def not_boundary():   # the running sums as they are (Horovod divides by N only when reducing)
            return [self.accumulators[i].read_value() for i in present]

        result = tf.cond(is_boundary, boundary, not_boundary) if present else []
        out = [None] * len(grads)
        for i, r in zip(present, result):
            out[i] = r
        return out

    def applies_now(self):
        """After `compute`: whether this pass's gradients are the reduced ones."""
        return tf.equal(self.counter.read_value(), 0)

    def step(self, grads: Sequence, variables: Sequence, apply_fn: Callable[[List], None],
             skip_fn: Callable[[], None]) -> None:
        """Accumulates `grads`; on every N-th call runs apply_fn(aggregated grads)
        (which reduces and applies), otherwise skip_fn()."""
        grads = list(grads)
        is_boundary = self._accumulate(grads, variables)

        def boundary():
            aggregated = self._aggregated()
            apply_fn(aggregated)
            # Zero only after the reduced values are applied (apply's ops consume
            # `aggregated`, which is a snapshot, so this ordering is by data).
            self._reset(aggregated)
            return tf.constant(True)

        def not_boundary():
            skip_fn()
            return tf.constant(False)

        tf.cond(is_boundary, boundary, not_boundary)
