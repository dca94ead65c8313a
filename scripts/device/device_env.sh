# Sourced by the device scripts (after they cd to the repo root): the
# environment every run on the shared GPU machines needs.
# Never NVLink multicast on the shared machines (KINDS.md of the device tool).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Open MPI as root, more ranks than cores, shared memory and loopback TCP only.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader,tcp OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
# Several ranks share the one GPU under MPS (without it their contexts
# time-slice and every dependent copy waits for a slice). start_mps starts the
# daemon, quits it when the script exits (an EXIT trap), and returns non-zero
# with a message when it did not start.
start_mps() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvgroup_mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/nvgroup_mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  trap 'echo quit | nvidia-cuda-mps-control > /dev/null 2>&1' EXIT
  nvidia-cuda-mps-control -d || { echo "!!! MPS did not start"; return 1; }
  sleep 1
}
