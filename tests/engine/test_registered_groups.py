"""Registered groups (RegisterGroup / EnqueueRegisteredGroup / UnregisterGroup,
cc/include/nvgroup/engine.h) through the pybind11 module: the worker
(tests/engine/workers/engine_registered_groups.py) checks every element of
every result on every rank against float64 (ints exact), bitwise against
EnqueueGroup of the same requests and across ranks, the interop with ranks
calling EnqueueGroup, a mismatch failing on every rank, each misuse error,
re-registration after a shape change and many steps in a row."""
import os

import pytest

from mpi_util import assert_all_ranks_ok, run_mpi

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "engine_registered_groups.py")


@pytest.mark.parametrize("np", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_registered_groups(np):
    result = run_mpi(WORKER, np, timeout=240)
    assert_all_ranks_ok(result, np)
