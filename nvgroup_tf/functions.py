"""Helpers built on the collectives: variable broadcasts and object exchange.

As with Horovod, each works eagerly and in TF1-style graph mode (a tf.Graph
run by a tf.compat.v1.Session): in graph mode the object helpers run their
collectives through `session` (default: the default session), and
broadcast_global_variables / broadcast_variables return the op to run.
Objects travel pickled (cloudpickle when installed, as Horovod uses, else the
standard pickle: lambdas and local classes then need cloudpickle).
"""
from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from nvgroup_tf import basics
from nvgroup_tf.mpi_ops import allgather, broadcast, broadcast_
from nvgroup_tf.util import _executing_eagerly

if TYPE_CHECKING:
    from nvgroup_tf.process_sets import ProcessSet

try:
    import cloudpickle as _pickle
except ImportError:  # not a dependency: the standard pickle covers plain data
    import pickle as _pickle


def _variable_name(variable):
    # Keras 3 variables are identified by .path; tf.Variable by .name.
    return getattr(variable, "path", None) or getattr(variable, "name", "variable")


def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int, process_set: Optional[ProcessSet] = None,
                        inplace: bool = False, name: str = "broadcast_variables") -> Optional[tf.Operation]:
    """Assigns every variable the value it has on `root_rank` (a global rank),
    over `process_set` (default: all ranks); inplace=True goes through
    broadcast_ (Horovod's in-place variant; the same values).

    Eager: runs the broadcasts and returns None. Graph (tf.function or a TF1
    graph): returns the grouped assign op. Variable i is named
    "<name>.<i>.<variable name>" (see Note [Collective names] in mpi_ops.py):
    identical on every rank as long as every rank passes the variables in the
    same order.
    """
    variables = list(variables)
    if inplace:
        updated = broadcast_(variables, root_rank, name=name + ".inplace", process_set=process_set)
        return None if tf.executing_eagerly() else tf.group(*updated)
    assigns = []
    for i, variable in enumerate(variables):
        value = broadcast(tf.convert_to_tensor(variable), root_rank,
                          name="%s.%d.%s" % (name, i, _variable_name(variable)),
                          process_set=process_set)
        assigns.append(variable.assign(value))
    if tf.executing_eagerly():
        return None
    return tf.group(*assigns)


def broadcast_global_variables(root_rank: int) -> tf.Operation:
    """Broadcasts every global variable (tf.compat.v1.global_variables()) from
    root_rank; returns the op to run. Graph mode only, as with Horovod: TF2
    eager code has no global-variable collection, so eagerly this raises
    RuntimeError (use broadcast_variables or BroadcastGlobalVariablesCallback)."""
    if _executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. "
            "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank,
                               name="broadcast_global_variables")


def _session_runner(session):
    """Evaluates a tensor: .numpy() eagerly, session.run in a graph."""
    def run(tensor):
        if _executing_eagerly():
            return tensor.numpy()
        sess = session or tf.compat.v1.get_default_session()
        if sess is None:
            raise ValueError("in graph mode the object helpers need a session: pass session= or "
                             "run them inside `with tf.compat.v1.Session() as sess:`")
        return sess.run(tensor)
    return run


def _dumps(obj):
    buffer = io.BytesIO()
    _pickle.dump(obj, buffer)
    return np.frombuffer(buffer.getvalue(), dtype=np.uint8)


def _loads(array):
    return _pickle.loads(np.asarray(array, dtype=np.uint8).tobytes())


def broadcast_object(obj: Any, root_rank: int = 0, session: Optional[tf.compat.v1.Session] = None,
                     name: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> Any:
    """Any picklable object of `root_rank` (a global rank), on every rank of
    `process_set` (default: all ranks). Horovod's broadcast_object.

    `name` defaults to the object's type name, as with Horovod; it names the two
    broadcasts ("<name>.sz", "<name>.t"), so concurrent calls need distinct names.
    """
    if name is None:
        name = type(obj).__name__
    run = _session_runner(session)
    if basics.rank() == root_rank:
        payload = _dumps(obj)
        run(broadcast(tf.constant([payload.size], dtype=tf.int64), root_rank, name=name + ".sz",
                      process_set=process_set))
    else:
        size = run(broadcast(tf.constant([0], dtype=tf.int64), root_rank, name=name + ".sz",
                             process_set=process_set))
        payload = np.zeros([int(size[0])], dtype=np.uint8)
    data = run(broadcast(tf.constant(payload, dtype=tf.uint8), root_rank, name=name + ".t",
                         process_set=process_set))
    return obj if basics.rank() == root_rank else _loads(data)


def broadcast_object_fn(root_rank: int = 0, session: Optional[tf.compat.v1.Session] = None,
                        name: Optional[str] = None, process_set: Optional[ProcessSet] = None) -> Callable[[Any], Any]:
    """A function obj -> broadcast_object(obj) whose collectives are built once.

    Graph mode (Horovod's use, e.g. TF1 elastic state): two broadcasts of
    placeholders are added to the current graph now, and every call runs them
    through `session` (default: the default session at this call), so repeated
    calls do not grow the graph. Eagerly, each call is a broadcast_object.
    """
    name = name or "broadcast_object_fn"
    if _executing_eagerly():
        return lambda obj: broadcast_object(obj, root_rank, name=name, process_set=process_set)

    size_in = tf.compat.v1.placeholder(tf.int64, [1], name="bcast_object_size")
    size_out = broadcast(size_in, root_rank, name=name + ".sz", process_set=process_set)
    data_in = tf.compat.v1.placeholder(tf.uint8, [None], name="bcast_object_data")
    data_out = broadcast(data_in, root_rank, name=name + ".t", process_set=process_set)
    session = session or tf.compat.v1.get_default_session()
    if session is None:
        raise ValueError("broadcast_object_fn in graph mode needs a session: pass session= or "
                         "call it inside `with tf.compat.v1.Session() as sess:`")

    def _broadcast(obj):
        if basics.rank() == root_rank:
            payload = _dumps(obj)
            session.run(size_out, feed_dict={size_in: [payload.size]})
        else:
            size = session.run(size_out, feed_dict={size_in: [0]})
            payload = np.zeros([int(size[0])], dtype=np.uint8)
        data = session.run(data_out, feed_dict={data_in: payload})
        return obj if basics.rank() == root_rank else _loads(data)

    return _broadcast


def allgather_object(obj: Any, session: Optional[tf.compat.v1.Session] = None, name: Optional[str] = None,
                     process_set: Optional[ProcessSet] = None) -> list[Any]:
    """List of the picklable `obj` of every rank of `process_set` (default: all
    ranks), in rank order (Horovod's allgather_object). `name` defaults to the
    object's type name ("<name>.sz", "<name>.t")."""
    if name is None:
        name = type(obj).__name__
    run = _session_runner(session)
    payload = _dumps(obj)
    sizes = run(allgather(tf.constant([payload.size], dtype=tf.int64), name=name + ".sz",
                          process_set=process_set))
    data = run(allgather(tf.constant(payload, dtype=tf.uint8), name=name + ".t",
                         process_set=process_set))
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return [_loads(data[offsets[r]:offsets[r + 1]]) for r in range(len(sizes))]


if hasattr(tf.compat.v1.train, "SessionRunHook"):
    class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
        """TF1 SessionRunHook: broadcasts every global variable from root_rank
        once the session is created (Horovod's hook of the same name, for
        MonitoredTrainingSession)."""

        def __init__(self, root_rank: int, device: str = "") -> None:
            super().__init__()
            self.root_rank = root_rank
            self.device = device
            self.bcast_op = None

        def begin(self):
            if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
                with tf.device(self.device):
                    self.bcast_op = broadcast_global_variables(self.root_rank)

        def after_create_session(self, session, coord):
            session.run(self.bcast_op)
