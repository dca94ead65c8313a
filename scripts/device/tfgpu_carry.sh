#!/usr/bin/env bash
# Here, in the project root, after the kit's prepare.sh: puts piece N of the kit's parts into .tfgpu/carry
# and, with the last part (or N = stage), this directory's device scripts, the commit, and with
# TFGPU_OLD_LIB=path/to/libnvgroup_tf_ops.so a baseline op library (and, with TFGPU_OLD_REF=commit, the
# Python package of that commit) for tfgpu_suite.sh's `old` stage.
#   bash scripts/device/tfgpu_carry.sh N        (TFGPU_KIT: the kit, default ../shared/tfgpu)
set -euo pipefail
KIT=${TFGPU_KIT:-../shared/tfgpu}
[ -x "$KIT/next.sh" ] || { echo "no kit at $KIT: set TFGPU_KIT"; exit 2; }
# The kit's 60 MiB parts leave 4 MiB of a transfer's 64 MiB for the project's own files, which are more:
# the parts are cut again into TFGPU_PART_MB (default 54) MiB pieces in .tfgpu/parts_small (once per
# prepare.sh; device.sh appends whatever pieces of NAME.zip come, in order), and N counts those pieces.
SMALL=.tfgpu/parts_small
if [ "$1" != stage ] && { [ ! -f $SMALL/order ] || [ .tfgpu/parts/order -nt $SMALL/order ]; }; then
  rm -rf $SMALL && mkdir -p $SMALL
  for z in $(sed 's/\.[0-9]*$//' .tfgpu/parts/order | uniq); do
    cat $(grep "^$z\." .tfgpu/parts/order | sed 's|^|.tfgpu/parts/|') | split -b "${TFGPU_PART_MB:-54}M" -d -a 2 - "$SMALL/$z."
  done
  (cd $SMALL && ls | grep -v '^order$' > order)
  echo "$(wc -l < $SMALL/order) pieces of ${TFGPU_PART_MB:-54} MiB in $SMALL"
fi
if [ "$1" = stage ]; then
  bash "$KIT/next.sh" stage
else
  rm -rf .tfgpu/carry && mkdir -p .tfgpu/carry && cp "$KIT/device.sh" .tfgpu/parts/md5 .tfgpu/carry/
  total=$(wc -l < $SMALL/order)
  i=$((10#$1)); [ "$i" -lt "$total" ] || { echo "piece $1: there are only $total (00..$(printf %02d $((total - 1))))"; exit 2; }
  ln "$SMALL/$(sed -n "$((i + 1))p" $SMALL/order)" .tfgpu/carry/
  [ $((i + 1)) = "$total" ] && cp .tfgpu/parts/stage.tar .tfgpu/carry/
  echo "piece $1 of $total: $(ls .tfgpu/carry | tr '\n' ' ')($(du -sh .tfgpu/carry | cut -f1))"
fi
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
