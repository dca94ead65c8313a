#!/usr/bin/env bash
# On the GPU machine, after the TF GPU kit installed (../shared/tfgpu, TFGPU_FULL=1: real cuDNN):
# benchmarks/xla_overlap_bench.py on one GPU, NP ranks (default 2) sharing it under MPS as one NV-group
# (NVGROUP_ONE_GPU_GROUP=1, the default) or as groups of 1 whose cross step is host-staged over MPI
# (NVGROUP_ONE_GPU_GROUP=0), the start/done pair against the single call; the pair's scheduled train-step
# HLO comes back compressed. Results to $OUT.
#   bash scripts/device/xla_overlap.sh [bench args...]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. /tmp/tfgpu/env.sh
export NVG_COMMIT=$(cat .tfgpu/carry/commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo "?")
export NVGROUP_ONE_GPU_GROUP=${NVGROUP_ONE_GPU_GROUP:-1} CUDA_MPS_PIPE_DIRECTORY=/tmp/nvgroup_mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/nvgroup_mps/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS started" || echo "!!! MPS did not start"
trap 'echo quit | nvidia-cuda-mps-control > /dev/null 2>&1' EXIT
python3 benchmarks/xla_overlap_bench.py --ranks "${NP:-2}" --dump /tmp/xla_dump \
  --json "$OUT/xla_overlap_h200x1.json" --png "$OUT/xla_overlap_h200x1.png" "$@" 2>&1 | tee "$OUT/xla_overlap.log" | tail -40
rc=${PIPESTATUS[0]}
for f in $(grep -l 'custom_call_target="nvgroup_collective' /tmp/xla_dump/*/*after_optimizations.txt 2>/dev/null | head -4); do
  gzip -c "$f" > "$OUT/$(basename "$(dirname "$f")")_$(basename "$f" | cut -c1-60).txt.gz"
done
exit $rc
