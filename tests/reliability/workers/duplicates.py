"""Duplicate names in flight: refused synchronously on the rank that submits
the second one, with an error naming it; the first one still completes with
the right result, and nothing hangs. The refusal counts as that rank's
collective of the name (Note [Refused duplicates] in cc/engine/coordinator.h):
the other ranks' second collective of that name fails with the same error,
and afterwards the name works again on every rank."""

import numpy as np
from mpi4py import MPI

import nvgroup_tf._engine as engine
from rel_common import allreduce_into, check_allreduce, run_worker, say, wait_bounded

COMM = MPI.COMM_WORLD


def submit(name, x):
    return allreduce_into(name, x, "float64")


def expect_duplicate_error(call, name):
    try:
        call()
    except RuntimeError as e:
        if "INVALID_ARGUMENT" not in str(e) or "duplicate" not in str(e) or name not in str(e):
            raise AssertionError("unclear error for a duplicate name: %s" % e)
        return str(e)
    raise AssertionError("a second '%s' in flight was accepted" % name)


def main():
    engine.init()
    rank, size = engine.rank(), engine.size()
    xs = [np.random.default_rng([3, r]).standard_normal(17) for r in range(size)]
    x = xs[rank]
    h, y = submit("dup", x)
    item = ("pair", x.ctypes.data, x.ctypes.data, [x.size], "float64")
    # A name twice in one group: refused on every rank.
    expect_duplicate_error(lambda: engine.grouped_allreduce_async([item, item], keepalive=x), "pair")
    texts = []
    if rank == 0:
        # Rank 1 holds back, so the first 'dup' is certainly still in flight.
        texts.append(expect_duplicate_error(lambda: submit("dup", x), "dup"))
    COMM.Barrier()
    wait_bounded(h, 60)
    why = check_allreduce(y, xs, "float64", "sum")
    if why:
        raise AssertionError("'dup' after the refused duplicate: %s" % why)
    if rank != 0:
        # The first 'dup' completed here: the second is accepted, and fails
        # because rank 0 refused its own.
        h, y = submit("dup", x)
        texts.append(expect_duplicate_error(lambda: wait_bounded(h, 30), "dup"))
    if len(set(COMM.allgather(texts[0]))) != 1:
        raise AssertionError("the ranks' errors for the second 'dup' differ")
    # The names are free again on every rank.
    for name in ("dup", "pair"):
        h, y = submit(name, x)
        wait_bounded(h, 60)
        why = check_allreduce(y, xs, "float64", "sum")
        if why:
            raise AssertionError("'%s' reused after the error: %s" % (name, why))
    engine.shutdown()
    say("rank %d: DUPLICATES_OK" % rank)


if __name__ == "__main__":
    run_worker(main)
