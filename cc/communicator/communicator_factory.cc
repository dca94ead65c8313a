// CreateCommunicator (nvgroup/communicator.h): checks the caller's settings and
// picks the implementation for the device. CPU: cc/cpu/cpu_communicator.h. CUDA: CreateCudaCommunicator
// (cc/device/cuda_communicator.h), given the host node split computed here,
// when the build has NVGROUP_WITH_CUDA; otherwise kUnimplemented.
#include <mpi.h>

#include <chrono>
#include <string>
#include <thread>

#include "common/checks.h"
#include "common/env.h"
#include "cpu/cpu_communicator.h"
#include "nvgroup/communicator.h"
#include "topology/topology.h"
#ifdef NVGROUP_WITH_CUDA
#include "device/cuda_communicator.h"
#endif

namespace nvgroup {

Status Communicator::DelayStream(double microseconds, void* /*stream*/) {
  if (microseconds > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(microseconds));
  return Status::Ok();
}

StatusOr<std::unique_ptr<Communicator>> CreateCommunicator(int64_t mpi_comm_fortran, Device device,
                                                           const Knobs& knobs,
                                                           const CommunicatorOptions& options) {
  int initialized = 0, finalized = 0;
  NVG_MPI_CHECK(MPI_Initialized(&initialized));
  NVG_MPI_CHECK(MPI_Finalized(&finalized));
  if (!initialized || finalized)
    return Status::FailedPrecondition("CreateCommunicator needs an initialized MPI (MPI_Init was " +
                                      std::string(initialized ? "followed by MPI_Finalize" : "not called") +
                                      ")");
  MPI_Comm comm = mpi_comm_fortran == -1 ? MPI_COMM_WORLD
                                         : MPI_Comm_f2c(static_cast<MPI_Fint>(mpi_comm_fortran));
  if (comm == MPI_COMM_NULL)
    return Status::InvalidArgument("MPI communicator handle " + std::to_string(mpi_comm_fortran) +
                                   " is MPI_COMM_NULL");
  // The parser validates the environment; these are the fields a caller may
  // have overridden with values it could not hold.
  if (knobs.group_size < 0)
    return Status::InvalidArgument("Knobs.group_size must be >= 0 (0 = detect), got " +
                                   std::to_string(knobs.group_size));
  if (knobs.peer_timeout_s <= 0)
    return Status::InvalidArgument("Knobs.peer_timeout_s must be positive, got " +
                                   std::to_string(knobs.peer_timeout_s));

  if (device.kind == DeviceKind::kCpu) return CreateCpuCommunicator(comm, knobs, options);
#ifdef NVGROUP_WITH_CUDA
  Topology host_topology;
  TopologyComms comms;
  NVG_RETURN_IF_ERROR_CTX(SplitNodes(comm, &host_topology, &comms), "splitting ranks into nodes");
  return CreateCudaCommunicator(comm, device.ordinal, knobs, options, host_topology);
#else
  return Status::Unimplemented("device " + device.ToString() +
                               " needs a CUDA build: rebuild with NVGROUP_WITH_CUDA=1");
#endif
}

}  // namespace nvgroup
