#!/usr/bin/env bash
# Compile check of the GPU build on a machine without a GPU: the TF DEVICE_GPU
# adapter (ops/*_gpu.cc, with the other ops/ files, under GOOGLE_CUDA=1) against
# TF's headers, and the engine's CUDA parts (cc/**/*.cu for sm_${ARCH},
# cc/**/*_cuda.cc) with the rest of the engine under NVGROUP_WITH_CUDA=1, then
# one link with --no-undefined so a declared-but-missing function fails here
# rather than at dlopen on the GPU machine. Nothing is loaded or run.
#
# tensorflow-cpu ships no CUDA headers where TF's GPU headers look for them
# ("third_party/gpus/cuda/include/..."): a build-local include tree maps that
# path onto $CUDA_HOME/include.
#
# Objects are cached in build/gpu_check/ (rebuilt when the source or any
# header under cc/ or ops/ is newer).
set -euo pipefail
cd "$(dirname "$0")/.."

CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
ARCH="${NVGROUP_CUDA_ARCH:-90}"  # a list: "70;80;90"
mapfile -t GENCODE < <(python3 scripts/cuda_arch.py "$ARCH") && [ "${#GENCODE[@]}" -gt 0 ] || exit 2
PY=.venv/bin/python
OUT=build/gpu_check
mkdir -p "$OUT/obj" "$OUT/include/third_party/gpus/cuda"
ln -sfn "$CUDA_HOME/include" "$OUT/include/third_party/gpus/cuda/include"

command -v nvcc >/dev/null 2>&1 || { echo "check_gpu_build: nvcc not found (set PATH/CUDA_HOME)"; exit 1; }
read -r -a TF_CFLAGS <<< "$($PY -c 'import tensorflow as tf; print(" ".join(tf.sysconfig.get_compile_flags()))' 2>/dev/null)"
read -r -a TF_LFLAGS <<< "$($PY -c 'import tensorflow as tf; print(" ".join(tf.sysconfig.get_link_flags()))' 2>/dev/null)"
# The XLA lowerings (ops/xla_*.cc): the same extra flags as setup.py's tf_xla_flags().
read -r -a XLA_FLAGS <<< "$($PY -c '
import os, tensorflow as tf
inc, lib = tf.sysconfig.get_include(), tf.sysconfig.get_lib()
print(" ".join(["-I" + os.path.join(inc, "external", "highwayhash"),
                "-I" + os.path.join(inc, "external", "farmhash_archive", "src")]))' 2>/dev/null)"
TF_LIB_DIR="$($PY -c 'import tensorflow as tf; print(tf.sysconfig.get_lib())' 2>/dev/null)"
read -r -a MPI_CFLAGS <<< "$(mpicxx --showme:compile)"
read -r -a MPI_LFLAGS <<< "$(mpicxx --showme:link)"

COMMON=(-O2 -fPIC -std=c++17 -Wall -Wno-unused-function -DOMPI_SKIP_MPICXX=1
        -Icc/include -Icc -I. -I"$CUDA_HOME/include" -DNVGROUP_WITH_CUDA=1 "${MPI_CFLAGS[@]}")
TF_EXTRA=(-U__GCC_DESTRUCTIVE_SIZE -U__GCC_CONSTRUCTIVE_SIZE -Wno-deprecated-declarations
          -Wno-sign-compare -DGOOGLE_CUDA=1 -I"$OUT/include")
HEADERS_MTIME=$(find cc ops -name '*.h' -o -name '*.cuh' | xargs stat -c %Y | sort -n | tail -1)

OBJECTS=()
compile() {  # compile SRC CMD... : runs CMD -c SRC -o OBJ when OBJ is stale
  local src=$1; shift
  local obj="$OUT/obj/${src//\//__}.o"
  OBJECTS+=("$obj")
  if [ -f "$obj" ] && [ "$(stat -c %Y "$obj")" -ge "$(stat -c %Y "$src")" ] \
     && [ "$(stat -c %Y "$obj")" -ge "$HEADERS_MTIME" ]; then return; fi
  echo "  compile $src"
  "$@" -c "$src" -o "$obj"
}

echo "check_gpu_build: engine (NVGROUP_WITH_CUDA=1, sm_$ARCH)"
while IFS= read -r src; do
  case "$src" in
    *.cu) compile "$src" nvcc -O3 -std=c++17 -Xcompiler -fPIC \
            "${GENCODE[@]}" -DNVGROUP_WITH_CUDA=1 \
            -Icc/include -Icc $(printf '%s\n' "${MPI_CFLAGS[@]}" | grep '^-I') ;;
    *) compile "$src" g++ "${COMMON[@]}" ;;
  esac
done < <(find cc \( -name '*.cc' -o -name '*.cu' \) -not -path 'cc/python/*' \
           -not -path 'cc/tools/*' -not -path 'cc/tests/*' | sort)

echo "check_gpu_build: TF adapter with DEVICE_GPU kernels (GOOGLE_CUDA=1)"
GPU_SOURCES=$(ls ops/*_gpu.cc 2>/dev/null | wc -l)
[ "$GPU_SOURCES" -gt 0 ] || { echo "check_gpu_build: no ops/*_gpu.cc to compile"; exit 1; }
for src in ops/*.cc; do
  compile "$src" g++ "${COMMON[@]}" "${TF_CFLAGS[@]}" "${TF_EXTRA[@]}" "${XLA_FLAGS[@]}"
done

LIB="$OUT/libnvgroup_tf_ops_gpu.so"
g++ -shared -Wl,--no-undefined -o "$LIB" "${OBJECTS[@]}" "${MPI_LFLAGS[@]}" \
    -L"$CUDA_HOME/lib64" -lcudart "${TF_LFLAGS[@]}" -L"$TF_LIB_DIR" -l:libtensorflow_cc.so.2 -lrt -lpthread
KERNELS=$(nm -C "$LIB" | grep -c 'GpuTraits' || true)
[ "$KERNELS" -gt 0 ] || { echo "check_gpu_build: no GPU kernel symbols in $LIB"; exit 1; }
echo "check_gpu_build: OK ($LIB, $(echo "${OBJECTS[@]}" | wc -w) objects, GPU kernel symbols: $KERNELS)"
