"""Horovod's elastic state API (hvd.elastic) for recovery with the same ranks.

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...                     # collectives
            state.commit()          # remember this point

    train(state)

`run` syncs the state from rank 0 (variables by broadcast, the extra
attributes as one pickled object) and calls the function. When a collective
fails with an engine failure -- a tf.errors.UnavailableError, AbortedError or
InternalError raised by an nvgroup op -- or the function raises
HorovodInternalError, every rank restores its last commit, shuts the engine
down, initializes it again over the same communicator, syncs from rank 0 and
calls the function again. Each retry is reported on stderr with its cause.

Not provided: elastic membership. There is no driver that adds or removes
hosts (Horovod's horovodrun --elastic / host discovery), so the ranks after a
reset are the ranks before it, commit() never raises HostsUpdatedInterrupt,
and a rank that died stays dead: the re-init then fails with the liveness
error and that error ends `run`. A mismatch or a program error
(FailedPreconditionError, ValueError, ...) is not retried: it propagates.
"""
import functools
import sys

import tensorflow as tf

from nvgroup_tf import basics
from nvgroup_tf.exceptions import HorovodInternalError
from nvgroup_tf.functions import broadcast_object, broadcast_object_fn, broadcast_variables
from nvgroup_tf.util import _executing_eagerly


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod raises it from commit() when hosts were added or removed. Kept
    for code that catches it; nvgroup_tf never raises it (no membership changes)."""

    def __init__(self, skip_sync=False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class State:
    """Base of the elastic states: commit() = save() + check_host_updates();
    subclasses implement save, restore and sync."""

    def __init__(self, bcast_object, get_rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Functions called after each reset (e.g. to rescale the learning rate)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res=None):
        """Horovod's driver notification; never called here (no driver)."""

    def commit(self):
        """Saves the state in host memory: a later failure restores this point."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """No host changes can happen here (see the module docstring): returns."""

    def save(self):
        raise NotImplementedError()

    def restore(self):
        raise NotImplementedError()

    def sync(self):
        raise NotImplementedError()


class ObjectState(State):
    """State of plain Python attributes, given as keyword arguments."""

    def __init__(self, bcast_object, get_rank, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self):
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        # Rank 0's last saved attributes, on every rank (as Horovod).
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)


def _optimizer_variables(optimizer):
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def _eager_object_broadcast():
    return lambda obj: broadcast_object(obj, root_rank=0, name="nvg_elastic_state")


class TensorFlowKerasState(ObjectState):
    """State of a Keras model and its optimizer plus extra attributes (kwargs).

    commit() copies the model's and the optimizer's variables; restore() assigns
    them back; sync() broadcasts them from rank 0. A Keras 3 optimizer that has
    not been built yet is built here over the model's trainable variables, so
    its state (iterations, slots) is part of every commit.
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if hasattr(model, "built") and not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer or model.optimizer
        if self.optimizer is None:
            raise ValueError("TensorFlowKerasState needs an optimizer: pass optimizer= or "
                             "compile the model first")
        if hasattr(self.optimizer, "built") and not self.optimizer.built:
            self.optimizer.build(model.trainable_variables)
        self.backend = backend
        if not _executing_eagerly():
            raise ValueError("TensorFlowKerasState needs eager execution (TF2); for a TF1 "
                             "graph use TensorFlowState with a session")
        self._save_model()
        super().__init__(bcast_object=_eager_object_broadcast(), get_rank=basics.rank, **kwargs)

    def _model_variables(self):
        # Keras 3 keeps random-seed states among model.variables; each replica
        # keeps its own (see nvgroup_tf/keras/callbacks.py, _variables_to_broadcast).
        from nvgroup_tf.keras.callbacks import _variables_to_broadcast
        return _variables_to_broadcast(self.model)

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        self._load_model()
        super().restore()

    def sync(self):
        broadcast_variables(self._model_variables(), root_rank=0, name="nvg_elastic_model")
        broadcast_variables(_optimizer_variables(self.optimizer), root_rank=0,
                            name="nvg_elastic_optimizer")
        self._save_model()
        super().sync()

    def _save_model(self):
        self._saved_model_state = [tf.identity(v) for v in self._model_variables()]
        self._saved_optimizer_state = [tf.identity(v) for v in _optimizer_variables(self.optimizer)]

    def _load_model(self):
        for variable, value in zip(self._model_variables(), self._saved_model_state):
            variable.assign(value)
        for variable, value in zip(_optimizer_variables(self.optimizer), self._saved_optimizer_state):
            variable.assign(value)


class TensorFlowState(ObjectState):
    """State of a list of tf.Variables (default: tf.compat.v1.global_variables())
    plus extra attributes (kwargs). Eager, or a TF1 graph with `session`
    (default: the default session)."""

    def __init__(self, variables=None, session=None, **kwargs):
        self.variables = list(variables if variables is not None
                              else tf.compat.v1.global_variables())
        self.session = session
        if _executing_eagerly():
            bcast_object = _eager_object_broadcast()
            self._bcast_op = None
        else:
            self.session = session or tf.compat.v1.get_default_session()
            if self.session is None:
                raise ValueError("TensorFlowState in graph mode needs a session: pass session= or "
                                 "create it inside `with tf.compat.v1.Session() as sess:`")
            self._bcast_op = broadcast_variables(self.variables, root_rank=0,
                                                 name="nvg_elastic_variables")
            bcast_object = broadcast_object_fn(root_rank=0, session=self.session,
                                               name="nvg_elastic_state")
        self._save_model()
        super().__init__(bcast_object=bcast_object, get_rank=basics.rank, **kwargs)

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        self._load_model()
        super().restore()

    def sync(self):
        if self._bcast_op is None:
            broadcast_variables(self.variables, root_rank=0, name="nvg_elastic_variables")
        else:
            self.session.run(self._bcast_op)
        self._save_model()
        super().sync()

    def _save_model(self):
        if self._bcast_op is None:
            self._values = [v.numpy() for v in self.variables]
        else:
            self._values = self.session.run(self.variables)

    def _load_model(self):
        for variable, value in zip(self.variables, self._values):
            if self._bcast_op is None:
                variable.assign(value)
            else:
                variable.load(value, self.session)


# TF errors of a failed engine (the peer or the engine went away), as opposed
# to mismatches and misuse, which a retry would only repeat.
_ENGINE_FAILURES = (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.InternalError)


def _is_engine_failure(error):
    return isinstance(error, _ENGINE_FAILURES) and "nvgroup" in str(error).lower()


def _reset():
    basics.shutdown()
    basics.init(basics._init_comm)


def _run_fn(func, reset):
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError as e:
                who = "rank %d" % basics.rank() if basics.is_initialized() else "a rank"
                print("nvgroup_tf.elastic: %s: %s; restoring the last commit, re-initializing "
                      "and retrying" % (who, e), file=sys.stderr, flush=True)
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            reset()
            state.on_reset()
    return wrapper


def run(func):
    """Decorator: runs func(state, ...) and retries it after engine failures
    (see the module docstring). The first argument must be a State."""
    def wrapper(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except _ENGINE_FAILURES as e:
            if _is_engine_failure(e):
                raise HorovodInternalError("a collective failed: %s" % e) from e
            raise
    return _run_fn(functools.wraps(func)(wrapper), _reset)
