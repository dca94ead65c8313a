#include "common/collective_args.h"

#include <algorithm>
#include <climits>
#include <string>

#include "common/checks.h"
#include "common/env.h"

namespace nvgroup {

size_t RegisteredBytes(const CommunicatorOptions& options, const Knobs& knobs) {
  constexpr size_t kMinDefault = size_t{64} << 20;
  return options.registered_bytes > 0 ? options.registered_bytes
                                      : std::max(knobs.fusion_threshold, kMinDefault);
}

bool Overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

Status CheckReduceScatter(const void* in, const void* out, const std::vector<size_t>& counts,
                          size_t element_size, int rank, int size, const void* reg, size_t capacity,
                          ReduceScatterSplit* split) {
  const int n = size;
  if (static_cast<int>(counts.size()) != n)
    return Status::InvalidArgument("reducescatter: " + std::to_string(counts.size()) + " counts given for " +
                                   std::to_string(n) + " ranks");
  ReduceScatterSplit s;
  for (int r = 0; r < n; ++r) {
    if (r == rank) s.offset = s.total;
    s.total += counts[r];
  }
  s.mine = counts[rank];
  if ((s.total > 0 && in == nullptr) || (s.mine > 0 && out == nullptr))
    return Status::InvalidArgument("reducescatter with a null input or output pointer");
  if (Overlaps(out, s.mine * element_size, reg, capacity))
    return Status::InvalidArgument("reducescatter output overlaps the registered buffer");
  s.in_registered = in == reg && s.total * element_size <= capacity;
  if (!s.in_registered && Overlaps(in, s.total * element_size, reg, capacity))
    return Status::InvalidArgument(
        "reducescatter input overlaps the registered buffer but does not fit it "
        "from its start");
  *split = s;
  return Status::Ok();
}

Status AgreeAlltoallv(MPI_Comm comm, int size, const void* in, const std::vector<size_t>& send_bytes,
                      const void* out, const std::vector<size_t>& recv_bytes, bool fast_here,
                      bool capturing_here, AlltoallvAgreement* agreed) {
  const int n = size;
  agreed->mpi_failed = false;
  if (static_cast<int>(send_bytes.size()) != n || static_cast<int>(recv_bytes.size()) != n)
    return Status::InvalidArgument("alltoallv: byte counts must have one entry per rank (" +
                                   std::to_string(n) + ")");
  size_t send_total = 0, recv_total = 0;
  std::vector<uint64_t> sent(2 * static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    sent[2 * r] = send_bytes[r];
    sent[2 * r + 1] = send_total;
    send_total += send_bytes[r];
    recv_total += recv_bytes[r];
  }
  agreed->send_total = send_total;
  agreed->recv_total = recv_total;
  agreed->incoming.assign(2 * static_cast<size_t>(n), 0);
  auto mpi = [&](int rc, const char* call) {
    if (rc == MPI_SUCCESS) return Status::Ok();
    agreed->mpi_failed = true;
    return Status::Internal(std::string(call) + " failed: " + MpiErrorString(rc));
  };
  NVG_RETURN_IF_ERROR(mpi(MPI_Alltoall(sent.data(), 2, MPI_UINT64_T, agreed->incoming.data(), 2, MPI_UINT64_T,
                                       comm),
                          "MPI_Alltoall (argument check of an alltoallv)"));
  // counts disagree, null pointer, beyond int, this rank cannot take the fast
  // path, this rank captures a CUDA graph
  int64_t verdict[5] = {0, 0, 0, fast_here ? 0 : 1, capturing_here ? 1 : 0};
  for (int r = 0; r < n; ++r)
    if (agreed->incoming[2 * r] != recv_bytes[r]) verdict[0] = 1;
  if ((send_total > 0 && in == nullptr) || (recv_total > 0 && out == nullptr)) verdict[1] = 1;
  if (send_total > static_cast<size_t>(INT_MAX) || recv_total > static_cast<size_t>(INT_MAX)) verdict[2] = 1;
  int64_t any[5];
  NVG_RETURN_IF_ERROR(mpi(MPI_Allreduce(verdict, any, 5, MPI_INT64_T, MPI_MAX, comm),
                          "MPI_Allreduce (argument check of an alltoallv)"));
  if (any[0])
    return Status::InvalidArgument("alltoallv: a rank expects different byte counts than its peers send");
  if (any[1]) return Status::InvalidArgument("alltoallv: a rank passed a null input or output pointer");
  if (any[2]) return Status::Unimplemented("alltoallv: more than 2^31-1 bytes sent or received by one rank");
  if (any[4])
    return Status::InvalidArgument(
        "alltoallv: a rank called it while capturing a CUDA graph (alltoallv "
        "waits on the host and cannot be captured)");
  agreed->fast_everywhere = any[3] == 0;
  return Status::Ok();
}

void MpiCountsAndDisplacements(const std::vector<size_t>& bytes, std::vector<int>* counts,
                               std::vector<int>* displacements) {
  counts->resize(bytes.size());
  displacements->resize(bytes.size());
  size_t offset = 0;
  for (size_t r = 0; r < bytes.size(); ++r) {
    (*counts)[r] = static_cast<int>(bytes[r]);
    (*displacements)[r] = static_cast<int>(offset);
    offset += bytes[r];
  }
}

}  // namespace nvgroup
