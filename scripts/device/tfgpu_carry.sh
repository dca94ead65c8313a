#!/usr/bin/env bash
# Here, in the project root, after the kit's prepare.sh: puts part N into .tfgpu/carry (the kit's next.sh)
# and, with the last part (or N = stage), this directory's device scripts, the commit, and with
# TFGPU_OLD_LIB=path/to/libnvgroup_tf_ops.so a baseline op library (and, with TFGPU_OLD_REF=commit, the
# Python package of that commit) for tfgpu_suite.sh's `old` stage.
#   bash scripts/device/tfgpu_carry.sh N        (TFGPU_KIT: the kit, default ../shared/tfgpu)
set -euo pipefail
KIT=${TFGPU_KIT:-../shared/tfgpu}
[ -x "$KIT/next.sh" ] || { echo "no kit at $KIT: set TFGPU_KIT"; exit 2; }
bash "$KIT/next.sh" "$1"
if [ -f .tfgpu/carry/stage.tar ]; then
  cp scripts/device/tfgpu_suite.sh scripts/device/tf_gpu_step_bench.py .tfgpu/carry/
  git rev-parse --short HEAD > .tfgpu/carry/commit
  if [ -n "${TFGPU_OLD_LIB:-}" ]; then  # TFGPU_OLD_REF: the commit it was built from (its Python package)
    mkdir -p .tfgpu/carry/old && cp "$TFGPU_OLD_LIB" .tfgpu/carry/old/libnvgroup_tf_ops.so
    [ -n "${TFGPU_OLD_REF:-}" ] && git archive "$TFGPU_OLD_REF" nvgroup_tf | tar -x -C .tfgpu/carry/old
    echo "$TFGPU_OLD_REF" > .tfgpu/carry/old/ref
  fi
  echo "last part: run   bash .tfgpu/carry/tfgpu_suite.sh [suite bench old]   there ($(du -sh .tfgpu/carry | cut -f1))"
fi
