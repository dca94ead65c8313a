"""Makes tests/mpi_util.py importable from every test directory, and marks the
tests that start processes under mpirun with `mpi`.

A test is marked `mpi` when it, one of its fixtures, or a function or module of
tests/ that it names reaches `mpi_util.run_mpi` or `mpi_util.MPI_ENV`, the two
ways the multi-rank tests launch their ranks; a test that launches them some
other way carries `@pytest.mark.mpi` itself. `pytest -m "not mpi"` is the fast
tier (`scripts/test.sh --fast`). Under that selection `mpirun` and `mpiexec` on
PATH are replaced by a stub that fails (it answers only `--version`), so a
test that launches ranks without the mark fails in the fast tier instead of
slowing it down.
"""
import os
import re
import shutil
import sys
import tempfile
import types

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)

import mpi_util  # noqa: E402 (after the sys.path entry above)

_LAUNCHERS = (mpi_util.run_mpi, mpi_util.MPI_ENV)
# `mpirun --version` (the launcher's check of which MPI it has) still answers.
_STUB = """#!/bin/sh
if [ "$*" = "--version" ] && [ -n "{real}" ]; then exec "{real}" --version; fi
echo "$0: the fast tier (-m 'not mpi') started mpirun: mark the test with @pytest.mark.mpi" >&2
exit 97
"""


def _code_objects(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _in_tests(path):
    return bool(path) and os.path.abspath(path).startswith(TESTS + os.sep)


def _reaches_launcher(obj, seen):
    """Whether `obj` (a function or module of tests/) names a launcher, directly
    or through the functions and modules of tests/ it names."""
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if isinstance(obj, types.ModuleType):
        if not _in_tests(getattr(obj, "__file__", None)):
            return False
        members = list(vars(obj).values())
        return any(m is launcher for m in members for launcher in _LAUNCHERS) or any(
            _reaches_launcher(m, seen) for m in members if isinstance(m, types.FunctionType))
    func = getattr(obj, "__func__", obj)
    code = getattr(func, "__code__", None)
    if code is None or not _in_tests(code.co_filename):
        return False
    for c in _code_objects(code):
        for name in c.co_names:
            value = func.__globals__.get(name)
            if any(value is launcher for launcher in _LAUNCHERS):
                return True
            if isinstance(value, (types.FunctionType, types.ModuleType)) and _reaches_launcher(value, seen):
                return True
    return False


def _starts_mpirun(item):
    funcs = [getattr(item, "function", None)]
    fixture_info = getattr(item, "_fixtureinfo", None)
    for defs in (fixture_info.name2fixturedefs.values() if fixture_info else ()):
        funcs += [d.func for d in defs]
    seen = set()
    return any(f is not None and _reaches_launcher(f, seen) for f in funcs)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("mpi") is None and _starts_mpirun(item):
            item.add_marker(pytest.mark.mpi)


def pytest_configure(config):
    if not re.search(r"\bnot\s+mpi\b", config.getoption("markexpr") or ""):
        return
    stub_dir = tempfile.mkdtemp(prefix="nvgroup_no_mpirun_")
    for name in ("mpirun", "mpiexec"):
        real = shutil.which(name) or ""
        path = os.path.join(stub_dir, name)
        with open(path, "w") as f:
            f.write(_STUB.format(real=real))
        os.chmod(path, 0o755)
    os.environ["PATH"] = stub_dir + os.pathsep + os.environ.get("PATH", "")
    config._nvgroup_stub_dir = stub_dir


def pytest_unconfigure(config):
    stub_dir = getattr(config, "_nvgroup_stub_dir", None)
    if stub_dir:
        shutil.rmtree(stub_dir, ignore_errors=True)
