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

A mismatch or a program error (FailedPreconditionError, ValueError, ...) is
not retried: it propagates.

Without nvgrouprun's elastic mode the ranks after a reset are the ranks
before it, commit() never raises HostsUpdatedInterrupt, and a rank that died
stays dead: the re-init then fails with the liveness error and that error
ends `run`.

Under nvgrouprun's elastic mode (--min-np/--max-np/--host-discovery-script;
the protocol is in nvgroup_tf/runner/elastic_driver.py; the driver sets
NVGROUP_ELASTIC_JOB) membership changes by relaunching the job:
  * commit() also writes the committed state (on each host, by its local rank
    0) to NVGROUP_ELASTIC_DIR/commit: a pickle tagged with the job's identity
    and the commit counter, written to a temporary name and renamed over the
    previous one, so a kill at any point leaves a whole commit;
  * commit() and check_host_updates() then ask rank 0 whether the driver has
    written NVGROUP_ELASTIC_NOTIFY (one stat) and broadcast the answer, so all
    ranks raise HostsUpdatedInterrupt at the same commit; `run` then writes
    the current state and ends the process with EXIT_HOSTS_UPDATED, and the
    driver relaunches on the new hosts;
  * an engine failure (a dead peer) ends the process with status 1 after
    printing the cause; the driver relaunches on the hosts it has;
  * when a relaunched `run` starts, the ranks gather their hosts' commit
    counters; when any rank has a commit of this job, the one with the
    highest counter is broadcast to all, every rank restores it, the reset
    callbacks run, and the function is called from that point.
"""
import functools
import os
import pickle
import socket
import sys

import tensorflow as tf

from nvgroup_tf import basics
from nvgroup_tf.exceptions import HorovodInternalError
from nvgroup_tf.functions import (allgather_object, broadcast_object, broadcast_object_fn,
                                  broadcast_variables)
from nvgroup_tf.util import _executing_eagerly


# Exit status of a process that leaves for the driver to relaunch it on new
# hosts; nvgroup_tf/runner/elastic_driver.py uses the same number.
EXIT_HOSTS_UPDATED = 75


# The variables nvgrouprun's elastic driver sets for every rank it launches
# (rows of the settings table, cc/common/env.cc; docs/SETTINGS.md).
_DRIVER_SETTINGS = ("NVGROUP_ELASTIC_DIR", "NVGROUP_ELASTIC_NOTIFY", "NVGROUP_ELASTIC_LAUNCH")


def _elastic_job():
    """The driver's job identity when running under nvgrouprun's elastic mode, else None.
    A malformed value, or the identity without the driver's other variables, is a
    ValueError naming them (they are set together by nvgrouprun, not by hand)."""
    job = basics.setting_value("NVGROUP_ELASTIC_JOB")
    if not job:
        return None
    missing = [name for name in _DRIVER_SETTINGS if not basics.setting_value(name)]
    if missing:
        raise ValueError("NVGROUP_ELASTIC_JOB is set but %s %s not: these variables are set together by "
                         "nvgrouprun's elastic mode (--min-np/--max-np/--host-discovery-script)"
                         % (" and ".join(missing), "is" if len(missing) == 1 else "are"))
    return job


def _commit_path():
    return os.path.join(basics.setting_value("NVGROUP_ELASTIC_DIR"), "commit")


def _write_commit(job, counter, payload):
    """Atomic on this host: the file is the previous commit or this one, never a mix.
    The temporary name holds the host and the pid, so writers on hosts that share
    the directory never write one temporary file."""
    path = _commit_path()
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = "%s.tmp.%s.%d" % (path, socket.gethostname(), os.getpid())
    with open(tmp, "wb") as f:
        pickle.dump({"job": job, "counter": counter, "payload": payload}, f,
                    protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)


def _read_commit(job):
    """(counter, payload) of this host's newest commit of `job`, or (-1, None)."""
    try:
        with open(_commit_path(), "rb") as f:
            record = pickle.load(f)
    except FileNotFoundError:
        return -1, None
    if not isinstance(record, dict) or record.get("job") != job:
        return -1, None
    return int(record["counter"]), record["payload"]


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by commit() / check_host_updates() under nvgrouprun's elastic mode
    when the driver reports new or lost hosts (see the module docstring)."""

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
        self._commit_counter = 0

    def register_reset_callbacks(self, callbacks):
        """Functions called after each reset (e.g. to rescale the learning rate)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res=None):
        """Horovod's in-process driver notification; the driver here tells the
        workers through a file instead (check_host_updates)."""

    def commit(self):
        """Saves the state in host memory (and, in elastic mode, on the host's
        disk): a later failure restores this point."""
        self.save()
        self._commit_counter += 1
        job = _elastic_job()
        if job is not None and basics.local_rank() == 0:
            _write_commit(job, self._commit_counter, self._persisted())
        self.check_host_updates()

    def check_host_updates(self):
        """Elastic mode: raises HostsUpdatedInterrupt on every rank when the
        driver has reported a change of hosts (rank 0 looks, all get its answer).
        Otherwise membership cannot change: returns."""
        if _elastic_job() is None:
            return
        seen = basics.rank() == 0 and os.path.exists(basics.setting_value("NVGROUP_ELASTIC_NOTIFY"))
        if self._bcast_object(bool(seen)):
            raise HostsUpdatedInterrupt(skip_sync=False)

    def _persisted(self):
        """What a relaunched process needs to restore the last save()."""
        raise NotImplementedError()

    def _load_persisted(self, payload):
        """Makes `payload` (from _persisted) the saved state, then restore()s it."""
        raise NotImplementedError()

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

    def _persisted(self):
        return {"attrs": dict(self._saved_state)}

    def _load_persisted(self, payload):
        self._saved_state = dict(payload["attrs"])
        self.restore()


def _optimizer_variables(optimizer):
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class _Snapshot:
    """Copies of the variables' values now (what commit() keeps), made by one
    call of a traced function over them rather than one eager op per variable:
    a program that commits every batch (as Horovod's examples do) pays this
    each batch. The function captures the variables (Keras 3 variables passed
    as arguments would be converted eagerly at every call) and is traced again
    when the list changes."""

    def __init__(self):
        self._variables = None
        self._copy = None

    def __call__(self, variables):
        variables = list(variables)
        if not variables:
            return []
        if self._variables is None or len(variables) != len(self._variables) or any(
                a is not b for a, b in zip(variables, self._variables)):
            self._variables = variables
            self._copy = tf.function(lambda: [tf.identity(v) for v in variables], autograph=False)
        return self._copy()


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
        self._snapshots = (_Snapshot(), _Snapshot())  # the model's variables, the optimizer's
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
        self._saved_model_state = self._snapshots[0](self._model_variables())
        self._saved_optimizer_state = self._snapshots[1](_optimizer_variables(self.optimizer))

    def _load_model(self):
        for variable, value in zip(self._model_variables(), self._saved_model_state):
            variable.assign(value)
        for variable, value in zip(_optimizer_variables(self.optimizer), self._saved_optimizer_state):
            variable.assign(value)

    def _persisted(self):
        return dict(super()._persisted(),
                    model=[v.numpy() for v in self._saved_model_state],
                    optimizer=[v.numpy() for v in self._saved_optimizer_state])

    def _load_persisted(self, payload):
        _check_shapes(payload["model"], self._model_variables(), "model")
        _check_shapes(payload["optimizer"], _optimizer_variables(self.optimizer), "optimizer")
        self._saved_model_state = [tf.constant(v) for v in payload["model"]]
        self._saved_optimizer_state = [tf.constant(v) for v in payload["optimizer"]]
        super()._load_persisted(payload)


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

    def _persisted(self):
        return dict(super()._persisted(), variables=list(self._values))

    def _load_persisted(self, payload):
        _check_shapes(payload["variables"], self.variables, "variables")
        self._values = list(payload["variables"])
        super()._load_persisted(payload)

    def _load_model(self):
        for variable, value in zip(self.variables, self._values):
            if self._bcast_op is None:
                variable.assign(value)
            else:
                variable.load(value, self.session)


def _check_shapes(values, variables, what):
    got = [tuple(v.shape) for v in values]
    want = [tuple(v.shape) for v in variables]
    if got != want:
        raise ValueError("the elastic commit's %s (%d arrays) does not match this program's "
                         "(%d arrays): first difference %s" % (
                             what, len(got), len(want),
                             next(((i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w),
                                  "in the count")))


def _report(text):
    """One line on stderr in one write: print() writes the text and the newline
    separately, and mpirun, forwarding the ranks' output as it comes, then
    joins several ranks' lines into one."""
    sys.stderr.write("nvgroup_tf.elastic: %s\n" % text)
    sys.stderr.flush()


def _resume_from_commits(state):
    """After a relaunch: the newest commit of this job among all ranks' hosts,
    restored on every rank, then the reset callbacks. Returns whether there was one."""
    job = _elastic_job()
    counter, payload = _read_commit(job)
    counters = allgather_object(counter, name="nvg_elastic_counters")
    newest = max(counters)
    if newest < 0:
        return False
    root = counters.index(newest)
    payload = broadcast_object(payload if basics.rank() == root else None, root_rank=root,
                               name="nvg_elastic_commit")
    state._load_persisted(payload)
    state._commit_counter = newest
    _report("rank %d: launch %s resumes from commit %d of rank %d's host (%s)"
            % (basics.rank(), basics.setting_value("NVGROUP_ELASTIC_LAUNCH"), newest, root,
               ", ".join("%s=%r" % kv for kv in sorted(payload["attrs"].items()))))
    state.on_reset()
    return True


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
        if _elastic_job() is not None:
            return _run_relaunched(func, state, args, kwargs)
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError as e:
                who = "rank %d" % basics.rank() if basics.is_initialized() else "a rank"
                _report("%s: %s; restoring the last commit, re-initializing and retrying" % (who, e))
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            reset()
            state.on_reset()
    return wrapper


def _run_relaunched(func, state, args, kwargs):
    """One launch under nvgrouprun's elastic mode (see the module docstring)."""
    _resume_from_commits(state)
    state.sync()
    try:
        return func(state, *args, **kwargs)
    except HostsUpdatedInterrupt:
        # The hosts changed: keep what was done since the last commit (as Horovod,
        # which does not restore on this interrupt), then leave for the relaunch.
        state.save()
        state._commit_counter += 1
        if basics.local_rank() == 0:
            _write_commit(_elastic_job(), state._commit_counter, state._persisted())
        _report("rank %d: hosts changed; state written at commit %d, leaving for the relaunch"
                % (basics.rank(), state._commit_counter))
        _leave(EXIT_HOSTS_UPDATED)
    except HorovodInternalError as e:
        _report("rank %d: %s; leaving for the driver to relaunch from commit %d"
                % (basics.rank() if basics.is_initialized() else -1, e, state._commit_counter))
        _leave(1)


def _leave(status):
    sys.stdout.flush()
    sys.stderr.flush()
    if status == EXIT_HOSTS_UPDATED:
        basics.shutdown()
        raise SystemExit(status)
    os._exit(status)  # a dead peer: MPI_Finalize could wait for it


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
