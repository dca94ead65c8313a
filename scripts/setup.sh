#!/usr/bin/env bash
# Sets up nvgroup_tf on a fresh Ubuntu/Debian machine: Open MPI, a virtual
# environment in .venv with the pinned Python packages, and the native build
# (engine + TF op library, in place). Idempotent: every step is skipped or a
# no-op when already done. Runs as root or with sudo.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
apt_install() {
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "$@"
}

# 1. System packages: MPI (only if no MPI compiler wrapper is there), a C++
#    compiler and venv support.
if ! command -v mpicxx >/dev/null 2>&1; then apt_install openmpi-bin libopenmpi-dev; fi
if ! command -v g++ >/dev/null 2>&1; then apt_install g++; fi
if ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then apt_install python3-venv; fi

# 2. Virtual environment and Python packages (pip skips what is installed).
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
PY=.venv/bin/python
$PY -m pip install -q tensorflow-cpu==2.21.0 mpi4py==4.1.2 numpy pybind11 pytest hypothesis matplotlib
# The checks' tools: ruff (scripts/test.sh lints with it), pytest-xdist (`pytest
# -n N` in the README) and clang-format (scripts/format_check.sh); pinned, since
# another version can report or format differently.
$PY -m pip install -q ruff==0.17.6 pytest-xdist==3.8.0 clang-format==21.1.8
# Legacy Keras for TF_USE_LEGACY_KERAS=1 (Keras side; one line, --no-deps):
$PY -m pip install -q --no-deps tf-keras==2.21.0

# 3. Native build: nvgroup_tf/_engine*.so and nvgroup_tf/lib/libnvgroup_tf_ops.so.
#    Objects are cached under build/, so a rebuild only compiles what changed.
NVGROUP_BUILD_JOBS="${NVGROUP_BUILD_JOBS:-$(nproc)}" $PY setup.py -q build_ext --inplace
echo "nvgroup_tf set up: $($PY -c 'import nvgroup_tf.basics as b; print(b.LIBRARY_PATH)' 2>/dev/null)"
