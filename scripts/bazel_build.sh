#!/usr/bin/env bash
# Builds the TF op library with Bazel (BUILD, WORKSPACE, bazel/) and checks
# that TensorFlow loads it and sees the four ops. A separate, documented check:
# scripts/test.sh does not run it (the first build takes minutes).
#
# Bazel: $BAZEL, else `bazel` on PATH, else Bazel 2.1.0 from the npm registry
# (@bazel/bazel-linux_x64 ships the binary itself; bazelisk would download one
# from GitHub at run time, which machines limited to package registries can't).
set -euo pipefail
cd "$(dirname "$0")/.."

BAZEL="${BAZEL:-$(command -v bazel || true)}"
if [ -z "$BAZEL" ]; then
  BAZEL=build/bazel_npm/node_modules/@bazel/bazel-linux_x64/bazel-2.1.0-linux-x86_64
  if [ ! -x "$BAZEL" ]; then
    npm install --no-audit --no-fund --prefix build/bazel_npm @bazel/bazel-linux_x64@2.1.0
    chmod +x "$BAZEL"
  fi
fi
export NVGROUP_PYTHON="${NVGROUP_PYTHON:-$PWD/.venv/bin/python}"

"$BAZEL" build --symlink_prefix=build/bazel- //:libnvgroup_tf_ops.so
# Bazel 2.1 also links bazel-out into the workspace root whatever the prefix.
if [ -L bazel-out ]; then rm bazel-out; fi
LIB=build/bazel-bin/libnvgroup_tf_ops.so
"$NVGROUP_PYTHON" - "$LIB" <<'PY'
import sys
import tensorflow as tf
ops = tf.load_op_library(sys.argv[1])
names = [n for n in ("nvgroup_allreduce", "nvgroup_grouped_allreduce", "nvgroup_allgather",
                     "nvgroup_broadcast") if hasattr(ops, n)]
assert len(names) == 4, "ops missing from %s: found %s" % (sys.argv[1], names)
print("bazel_build: %s loads in TensorFlow %s with ops %s" % (sys.argv[1], tf.__version__, names))
PY
