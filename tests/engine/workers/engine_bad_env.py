"""Malformed or inconsistent NVGROUP_* environment fails init on every rank
with an error naming the variable (argv[1]: 'all' = set by the launcher on all
ranks, 'one' = only the last rank has it, 'differs' = ranks disagree,
'knobs' = for every knob that changes the algorithm, in turn, the last rank
alone has a different value: init must fail on every rank naming the knob and
both values), and a later init with a good environment works."""
import os
import sys

import numpy as np
from mpi4py import MPI

from engine_common import E, check, expect_error, finish

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
mode = sys.argv[1]
if mode == "one" and rank == size - 1:
    os.environ["NVGROUP_FUSION_THRESHOLD"] = "abc"
if mode == "differs" and rank == size - 1:
    os.environ["NVGROUP_FUSION_THRESHOLD"] = "1024"

# (variable, value on the last rank, how the error prints the others' value
# and the last rank's). Values that parse equal agree ("0065536" == "65536").
KNOBS = [
    ("NVGROUP_ONESHOT_MAX_BYTES", "65536", "0", "65536"),
    ("NVGROUP_PIPELINE_CHUNK", "1048576", "4194304", "1048576"),
    ("NVGROUP_PIPELINE_MIN_CHUNK", "65536", "1048576", "65536"),
    ("NVGROUP_CROSS_ALLGATHER_MAX_BYTES", "0", "32768", "0"),
    ("NVGROUP_ALLREDUCE_ALGORITHM", "mpi", "auto", "mpi"),
    ("NVGROUP_FUSION_THRESHOLD", "1024", "67108864", "1024"),
    ("NVGROUP_CACHE_CAPACITY", "7", "1024", "7"),
    ("NVGROUP_BUCKET_CAP_MB", "4", "25", "4"),
]

if mode == "differs":
    expect_error(E.init, "NVGROUP_FUSION_THRESHOLD differs across ranks", code="INVALID_ARGUMENT")
elif mode == "knobs":
    last = size - 1
    others = "rank 0 has" if size == 2 else "ranks [%s] have" % ", ".join(str(r) for r in range(last))
    for var, value, shown_others, shown_last in KNOBS:
        if rank == last:
            os.environ[var] = value
        text = expect_error(E.init, "%s differs across ranks: %s %s, rank %d has %s; it must be the same "
                            "on every rank" % (var, others, shown_others, last, shown_last),
                            code="INVALID_ARGUMENT")
        check(not E.is_initialized(), "initialized although %s differs: %r" % (var, text))
        os.environ.pop(var, None)
    # Two knobs at once: both are named.
    if rank == last:
        os.environ["NVGROUP_ONESHOT_MAX_BYTES"] = "4096"
        os.environ["NVGROUP_ALLREDUCE_ALGORITHM"] = "hierarchical"
    expect_error(E.init, "NVGROUP_ALLREDUCE_ALGORITHM differs across ranks", "NVGROUP_ONESHOT_MAX_BYTES differs "
                 "across ranks", code="INVALID_ARGUMENT")
    os.environ.pop("NVGROUP_ONESHOT_MAX_BYTES", None)
    os.environ.pop("NVGROUP_ALLREDUCE_ALGORITHM", None)
    # The same value spelled differently agrees (the bucket cap: unset is its default, 25 MiB).
    os.environ["NVGROUP_PIPELINE_CHUNK"] = "0065536" if rank == last else "65536"
    os.environ["NVGROUP_BUCKET_CAP_MB"] = "4.0" if rank == last else "4"
    E.init()
    E.shutdown()
    os.environ["NVGROUP_BUCKET_CAP_MB"] = "25" if rank == last else ""
    E.init()
    E.shutdown()
    os.environ.pop("NVGROUP_PIPELINE_CHUNK", None)
    os.environ.pop("NVGROUP_BUCKET_CAP_MB", None)
else:
    expect_error(E.init, "NVGROUP_FUSION_THRESHOLD='abc'", "expected an integer", code="INVALID_ARGUMENT")
check(not E.is_initialized(), "initialized despite the bad environment")

os.environ.pop("NVGROUP_FUSION_THRESHOLD", None)
E.init()
x = np.ones(4, np.int64)
y = np.zeros(4, np.int64)
E.wait(E.allreduce_async("ok", x.ctypes.data, y.ctypes.data, [4], "int64"), 30)
check(np.all(y == size), "allreduce after a good init")
E.shutdown()
finish()
