"""Process sets (Horovod's ProcessSet API): collectives on a subset of ranks.

    even = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[even])          # static registration, or later:
    odd = hvd.add_process_set([1, 3])      # dynamic (collective over ALL ranks)
    hvd.allreduce(x, process_set=even)     # ranks 0 and 2 only
    hvd.remove_process_set(odd)

Every added set gets its own engine inside the library (cc/engine/process_set_registry.cc:
its own MPI sub-communicator, negotiation, response cache, communicators and
NV-groups formed among its members). Registration and removal are collective
over all ranks, members and non-members alike, with the same ranks everywhere
(a disagreement raises ValueError on every rank naming each rank's list). A
rank that calls a collective on a set it is not a member of gets
tf.errors.InvalidArgumentError at the call; a ProcessSet whose id is not
registered (removed, or set by hand) gets ValueError at the call, as with
Horovod. `root_rank` of a broadcast in a set is a global rank (as in Horovod).

init(process_sets=[...]) again while initialized (as Horovod allows): a set
whose ranks are already registered takes that registration's id (no error);
a set of new ranks raises ValueError (register it with add_process_set).
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Optional, Sequence, Union

from nvgroup_tf import op_library
from nvgroup_tf.exceptions import NOT_INITIALIZED_MESSAGE, raise_for_status

_MESSAGE_BYTES = 4096
_lock = threading.Lock()
_registered = {}  # process_set_id -> ProcessSet (this process's objects)
_equivalent = {}  # process_set_id -> further ProcessSet objects given that id by a repeated init()


class ProcessSet:
    """A set of ranks (global ranks, any order; duplicates are an error).

    `process_set_id` is None until the set is registered (init(process_sets=...)
    or add_process_set), 0 for global_process_set.
    """

    def __init__(self, ranks_or_comm: Union[Sequence[int], Any]) -> None:
        if hasattr(ranks_or_comm, "Get_group") and hasattr(ranks_or_comm, "py2f"):
            from mpi4py import MPI
            group = ranks_or_comm.Get_group()
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), MPI.COMM_WORLD.Get_group())
        else:
            ranks = list(ranks_or_comm)
        ranks = [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks):
            raise ValueError("ProcessSet: ranks %s contain duplicates" % (ranks,))
        self.ranks = sorted(ranks)
        self.mpi_comm = ranks_or_comm if hasattr(ranks_or_comm, "py2f") else None
        self.process_set_id = None

    def _invalidate(self):
        self.process_set_id = None

    def _check_registered(self):
        if self.process_set_id is None:
            raise ValueError("%r is not registered: pass it to nvgroup_tf.init(process_sets=...) or "
                             "nvgroup_tf.add_process_set()" % (self,))

    def size(self) -> Optional[int]:
        """Number of ranks in the set (None before registration)."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return op_library._topology("size")
        return len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's rank within the set; None if not a member or not registered."""
        if self.process_set_id is None:
            return None
        r = _process_set_rank(self.process_set_id)
        return None if r < 0 else r

    def included(self) -> Optional[bool]:
        """True if this process belongs to the set (None before registration)."""
        if self.process_set_id is None:
            return None
        return _process_set_rank(self.process_set_id) >= 0

    def __eq__(self, other):
        if not isinstance(other, ProcessSet):
            return False
        if self.process_set_id == 0 or other.process_set_id == 0:  # the global set's ranks fill in at init
            return self.process_set_id == other.process_set_id
        return (self.process_set_id, self.ranks) == (other.process_set_id, other.ranks)

    def __hash__(self):
        return hash(0) if self.process_set_id == 0 else hash((self.process_set_id, tuple(self.ranks)))

    def __repr__(self):
        # Horovod's str(ProcessSet); the global set's ranks are filled in by init().
        return "ProcessSet(process_set_id=%s, ranks=%s, mpi_comm=%s)" % (
            self.process_set_id, self.ranks, self.mpi_comm)


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _handle():
    handle, _ = op_library._load()
    if not handle.nvgroup_tf_is_initialized():
        raise ValueError(NOT_INITIALIZED_MESSAGE)
    return handle


def _call(what, fn, *args):
    message = ctypes.create_string_buffer(_MESSAGE_BYTES)
    code = fn(*args, message, _MESSAGE_BYTES)
    if code == 1:  # kInvalidArgument: Horovod raises ValueError for bad process sets
        raise ValueError("%s: %s" % (what, message.value.decode(errors="replace")))
    raise_for_status(code, message.value.decode(errors="replace"), what)


def _process_set_rank(process_set_id):
    handle = _handle()
    value = ctypes.c_int(-1)
    _call("process set %d" % process_set_id, handle.nvgroup_tf_process_set_rank,
          ctypes.c_int(process_set_id), ctypes.byref(value))
    return value.value


def _process_set_ranks(process_set_id):
    handle = _handle()
    capacity = 1 << 16
    ranks = (ctypes.c_int * capacity)()
    count = ctypes.c_int(0)
    _call("process set %d" % process_set_id, handle.nvgroup_tf_process_set_ranks,
          ctypes.c_int(process_set_id), ranks, ctypes.c_int(capacity), ctypes.byref(count))
    return list(ranks[:count.value])


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Registers `process_set` (a ProcessSet or a sequence of ranks) and returns
    the registered ProcessSet. Collective over all ranks (members or not), which
    must pass the same ranks."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError("%r is already registered" % (process_set,))
    handle = _handle()
    ranks = (ctypes.c_int * max(1, len(process_set.ranks)))(*process_set.ranks)
    new_id = ctypes.c_int(-1)
    with _lock:
        _call("add_process_set(%s)" % (process_set.ranks,), handle.nvgroup_tf_add_process_set, ranks,
              ctypes.c_int(len(process_set.ranks)), ctypes.byref(new_id))
        process_set.process_set_id = new_id.value
        _registered[new_id.value] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters `process_set` (collective over all ranks); its collectives in
    flight fail with tf.errors.AbortedError. Returns True if it was removed
    (False for the global set or a set that is not registered, as Horovod)."""
    if process_set.process_set_id in (None, 0):
        return False
    handle = _handle()
    with _lock:
        _call("remove_process_set(%r)" % (process_set,), handle.nvgroup_tf_remove_process_set,
              ctypes.c_int(process_set.process_set_id))
        for ps in [_registered.pop(process_set.process_set_id, None)] + _equivalent.pop(
                process_set.process_set_id, []):
            if ps is not None:
                ps._invalidate()
        process_set._invalidate()
    return True


def _process_set_id(process_set):
    """The id collectives pass to the ops (None = the global set)."""
    if process_set is None:
        return 0
    if not isinstance(process_set, ProcessSet):
        raise TypeError("process_set must be a nvgroup_tf.ProcessSet, got %s" % type(process_set).__name__)
    process_set._check_registered()
    if process_set.process_set_id != 0 and process_set.process_set_id not in _registered:
        raise ValueError("%r: process set id %d is not registered (removed, or never added with "
                         "nvgroup_tf.init(process_sets=...) / nvgroup_tf.add_process_set())"
                         % (process_set, process_set.process_set_id))
    return process_set.process_set_id


def _process_set_size(process_set):
    return op_library._topology("size") if _process_set_id(process_set) == 0 else len(process_set.ranks)


def _process_set_rank_of(process_set):
    """This rank's rank within the set (raises if not a member)."""
    if _process_set_id(process_set) == 0:
        return op_library._topology("rank")
    r = _process_set_rank(process_set.process_set_id)
    if r < 0:
        raise ValueError("rank %d is not a member of %r" % (op_library._topology("rank"), process_set))
    return r


def _register_static(process_sets, already_initialized=False):
    """For init(process_sets=...): registers each set in order, right after the
    engine started (every rank passes the same list). 'dynamic' is accepted for
    Horovod compatibility (registration is always possible later). On an init()
    while initialized (already_initialized), each set must be registered
    already -- the same object, or one of the same ranks, which then takes the
    registered id -- as Horovod maps a repeated init's sets onto the
    registered ones; a set of new ranks raises ValueError naming it."""
    global_process_set.ranks = list(range(op_library._topology("size")))
    if process_sets is None or process_sets == "dynamic":
        return
    if not already_initialized:
        for ps in process_sets:
            if isinstance(ps, ProcessSet) and (ps.process_set_id == 0 or ps.process_set_id in _registered):
                continue  # the global set, or registered already
            add_process_set(ps)
        return
    by_ranks = {tuple(ps.ranks): ps_id for ps_id, ps in _registered.items()}
    for ps in process_sets:
        if not isinstance(ps, ProcessSet):
            ps = ProcessSet(ps)
        if ps.process_set_id == 0 or ps.process_set_id in _registered:
            continue
        ps_id = by_ranks.get(tuple(ps.ranks))
        if ps_id is None:
            raise ValueError(
                "nvgroup_tf.init(process_sets=...) while initialized: %r is not registered; the sets "
                "of a repeated init() must be the ones already registered (%s). Register new sets "
                "with nvgroup_tf.add_process_set()." % (ps, sorted(by_ranks) or "none"))
        ps.process_set_id = ps_id
        _equivalent.setdefault(ps_id, []).append(ps)


def _get_process_set_ids_and_ranks():
    """{process_set_id: ranks} of every registered set, the global set (0) included
    (Horovod's basics._get_process_set_ids_and_ranks)."""
    with _lock:
        ids = sorted(_registered)
    out = {0: list(range(op_library._topology("size")))}
    for ps_id in ids:
        out[ps_id] = _process_set_ranks(ps_id)
    return out


def _process_set_size_of_id(process_set_id):
    """Number of ranks of the set with this id (Horovod's basics._process_set_size)."""
    if process_set_id == 0:
        return op_library._topology("size")
    return len(_process_set_ranks(process_set_id))


def _reset_after_shutdown():
    """shutdown() drops every set: the objects become unregistered."""
    with _lock:
        for ps in _registered.values():
            ps._invalidate()
        for sets in _equivalent.values():
            for ps in sets:
                ps._invalidate()
        _registered.clear()
        _equivalent.clear()
