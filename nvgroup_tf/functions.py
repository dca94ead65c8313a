"""Helpers built on the collectives: broadcast_variables and object exchange."""
import pickle

import numpy as np
import tensorflow as tf

from nvgroup_tf import basics
from nvgroup_tf.mpi_ops import allgather, broadcast


def _variable_name(variable):
    # Keras 3 variables are identified by .path; tf.Variable by .name.
    return getattr(variable, "path", None) or getattr(variable, "name", "variable")


def broadcast_variables(variables, root_rank, name="broadcast_variables"):
    """Assigns every variable the value it has on `root_rank`.

    Eager: runs the broadcasts and returns None. Inside tf.function: returns the
    grouped assign op. Variable i is named "<name>.<i>.<variable name>" (see
    Note [Collective names] in mpi_ops.py): identical on every rank as long as
    every rank passes the variables in the same order.
    """
    assigns = []
    for i, variable in enumerate(variables):
        value = broadcast(tf.convert_to_tensor(variable), root_rank,
                          name="%s.%d.%s" % (name, i, _variable_name(variable)))
        assigns.append(variable.assign(value))
    if tf.executing_eagerly():
        return None
    return tf.group(*assigns)


def broadcast_object(obj, root_rank=0, name="broadcast_object"):
    """Any picklable object of `root_rank`, on every rank (eager only)."""
    if basics.rank() == root_rank:
        payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    else:
        payload = np.zeros([0], dtype=np.uint8)
    length = broadcast(tf.constant([payload.size], tf.int64), root_rank, name=name + ".length")
    if basics.rank() != root_rank:
        payload = np.zeros([int(length.numpy()[0])], dtype=np.uint8)
    data = broadcast(tf.constant(payload), root_rank, name=name + ".data")
    return pickle.loads(data.numpy().tobytes())


def allgather_object(obj, name="allgather_object"):
    """List of every rank's picklable `obj`, in rank order (eager only)."""
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    lengths = allgather(tf.constant([payload.size], tf.int64), name=name + ".lengths").numpy()
    data = allgather(tf.constant(payload), name=name + ".data").numpy()
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return [pickle.loads(data[offsets[r]:offsets[r + 1]].tobytes()) for r in range(len(lengths))]
