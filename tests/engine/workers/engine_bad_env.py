"""Malformed or inconsistent NVGROUP_* environment fails init on every rank
with an error naming the variable (argv[1]: 'all' = set by the launcher on all
ranks, 'one' = only the last rank has it, 'differs' = ranks disagree), and a
later init with a good environment works."""
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

if mode == "differs":
    expect_error(E.init, "NVGROUP_FUSION_THRESHOLD differs across ranks", code="INVALID_ARGUMENT")
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
