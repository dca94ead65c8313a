// CudaCommunicator (cuda_communicator_impl.h): the collectives that move
// bytes without reducing them -- Allgatherv, Broadcast and Alltoallv: peer
// copies through the members' registered buffers when all ranks form one
// NV-group, else staged through host memory and MPI (correct, not tuned).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <string>
#include <vector>

#include "common/collective_args.h"
#include "common/cuda_checks.h"
#include "device/cuda_communicator_impl.h"

namespace nvgroup {

StatusOr<bool> CudaCommunicator::UsePeerCopies(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const char* reg = static_cast<const char*>(group_.region->data(group_.topo.group_rank));
  auto overlaps = [&](const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    return n > 0 && c < reg + group_.region->data_bytes() && c + n > reg;
  };
  int ok = group_.topo.group_count == 1 && group_.topo.group_size > 1 && !overlaps(a, a_bytes) &&
           !overlaps(b, b_bytes);
  int all_ok = 0;  // the choice is collective: pointers differ per rank
  NVG_MPI_CHECK(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, comm_));
  return all_ok == 1;
}

// Within one NV-group: peer copies through the registered buffers. Otherwise
// host staging through MPI. Correct and simple, not tuned paths.
Status CudaCommunicator::Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes_per_rank,
                                    void* stream_arg) {
  NVG_RETURN_IF_ERROR(CheckHealthy());
  const int size = group_.topo.size;
  if (static_cast<int>(bytes_per_rank.size()) != size)
    return Status::InvalidArgument("allgatherv: " + std::to_string(bytes_per_rank.size()) +
                                   " byte counts given for " + std::to_string(size) + " ranks");
  std::vector<int> counts(size), displs(size);
  size_t total = 0;
  for (int r = 0; r < size; ++r) {
    if (total > static_cast<size_t>(INT_MAX) || bytes_per_rank[r] > static_cast<size_t>(INT_MAX))
      return Status::InvalidArgument("allgatherv: more than 2^31-1 bytes in total");
    counts[r] = static_cast<int>(bytes_per_rank[r]);
    displs[r] = static_cast<int>(total);
    total += bytes_per_rank[r];
  }
  const size_t mine = bytes_per_rank[group_.topo.rank];
  if ((mine > 0 && in == nullptr) || (total > 0 && out == nullptr))
    return Status::InvalidArgument("allgatherv: null input or output pointer");
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  // Runs on work_ (Note [Internal stream]) and returns with work_ drained, so
  // the caller's stream needs no join; host waits cannot be captured.
  auto capturing = Capturing(StreamOf(stream_arg));
  if (!capturing.ok()) return capturing.status();
  if (capturing.value())
    return Status::InvalidArgument(
        "allgatherv/broadcast wait on the host between steps and "
        "cannot be captured in a CUDA graph");
  NVG_RETURN_IF_ERROR(EnterWork(StreamOf(stream_arg)));
  cudaStream_t stream = work_;
  StatusOr<bool> peer = total <= registered_capacity() ? UsePeerCopies(in, mine, out, total)
                                                       : StatusOr<bool>(false);
  if (!peer.ok()) return peer.status();
  if (peer.value()) {
    // One NV-group: every rank puts its part into its registered buffer at its
    // displacement, then copies every member's part out of the member's buffer
    // (peer copies over NVLink). MPI barriers on the group order the steps.
    char* own = static_cast<char*>(registered_buffer());
    const int me = group_.topo.rank;
    if (mine > 0)
      NVG_CUDA_CHECK(cudaMemcpyAsync(own + displs[me], in, mine, cudaMemcpyDeviceToDevice, stream));
    NVG_CUDA_CHECK(cudaStreamSynchronize(stream));
    NVG_MPI_CHECK(MPI_Barrier(group_.comms.group));  // orders: every part is in place
    for (int p = 0; p < group_.topo.group_size; ++p) {
      const int r = member_ranks_[p];
      if (counts[r] > 0)
        NVG_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(out) + displs[r],
                                       group_.region->data(p) + displs[r], counts[r], cudaMemcpyDefault,
                                       stream));
    }
    NVG_CUDA_CHECK(cudaStreamSynchronize(stream));
    NVG_MPI_CHECK(MPI_Barrier(group_.comms.group));  // orders: reads done before reuse
    return Status::Ok();
  }
  std::vector<char> send(mine), recv(total);
  NVG_CUDA_CHECK(cudaStreamSynchronize(stream));  // orders: `in` is produced
  if (mine > 0) NVG_CUDA_CHECK(cudaMemcpy(send.data(), in, mine, cudaMemcpyDeviceToHost));
  NVG_MPI_CHECK(MPI_Allgatherv(send.data(), static_cast<int>(mine), MPI_BYTE, recv.data(), counts.data(),
                               displs.data(), MPI_BYTE, comm_));
  if (total > 0) {
    NVG_CUDA_CHECK(cudaMemcpyAsync(out, recv.data(), total, cudaMemcpyHostToDevice, stream));
    NVG_CUDA_CHECK(cudaStreamSynchronize(stream));  // recv is freed on return
  }
  return Status::Ok();
}

// Alltoallv on the device, after the same count cross-check as the CPU path.
// All ranks in one NV-group of several GPUs and every rank's send data fits
// its registered buffer: peer copies (PeerAlltoallv). Otherwise staged through
// host memory and MPI_Alltoallv (correct, not tuned); that path touches no
// per-communicator device state (Note [Internal stream]): only the caller's
// stream, which it drains, and MPI on comm_.
Status CudaCommunicator::Alltoallv(const void* in, const std::vector<size_t>& send_bytes, void* out,
                                   const std::vector<size_t>& recv_bytes, void* stream_arg) {
  NVG_RETURN_IF_ERROR(CheckHealthy());
  size_t send_total = 0;
  for (size_t b : send_bytes) send_total += b;
  size_t recv_total = 0;
  for (size_t b : recv_bytes) recv_total += b;
  const char* reg = static_cast<const char*>(registered_buffer());
  const bool peer_copies = group_.topo.group_count == 1 && group_.topo.group_size > 1 &&
                           send_total <= registered_capacity() &&
                           !Overlaps(in, send_total, reg, registered_capacity()) &&
                           !Overlaps(out, recv_total, reg, registered_capacity());
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  cudaStream_t stream = StreamOf(stream_arg);
  // Both paths wait on the host: not capturable. A capture on any rank is the
  // same error on every rank (part of the agreement), not a hang of the others.
  auto capturing = Capturing(stream);
  if (!capturing.ok()) return capturing.status();
  AlltoallvAgreement agreed;
  NVG_RETURN_IF_ERROR(AgreeAlltoallv(comm_, group_.topo.size, in, send_bytes, out, recv_bytes, peer_copies,
                                     capturing.value(), &agreed));
  if (agreed.fast_everywhere) return PeerAlltoallv(in, send_total, out, recv_bytes, agreed.incoming, stream);
  std::vector<int> sc, sd, rc, rd;
  MpiCountsAndDisplacements(send_bytes, &sc, &sd);
  MpiCountsAndDisplacements(recv_bytes, &rc, &rd);
  std::vector<char> send(std::max<size_t>(send_total, 1)), recv(std::max<size_t>(recv_total, 1));
  NVG_CUDA_CHECK(cudaStreamSynchronize(stream));  // orders: `in` is produced
  if (send_total > 0) NVG_CUDA_CHECK(cudaMemcpy(send.data(), in, send_total, cudaMemcpyDeviceToHost));
  NVG_MPI_CHECK(MPI_Alltoallv(send.data(), sc.data(), sd.data(), MPI_BYTE, recv.data(), rc.data(), rd.data(),
                              MPI_BYTE, comm_));
  if (recv_total > 0) {
    NVG_CUDA_CHECK(cudaMemcpyAsync(out, recv.data(), recv_total, cudaMemcpyHostToDevice, stream));
    NVG_CUDA_CHECK(cudaStreamSynchronize(stream));  // recv is freed on return
  }
  return Status::Ok();
}

// One NV-group: every rank copies its whole input into its registered buffer,
// then copies from each member p's registered buffer the bytes p sends it
// (at p's offset `incoming[2 r + 1]`, r = p's rank) into `out` (peer copies
// over NVLink / CUDA IPC). Ordering, on work_ (Note [Internal stream]):
//   * work_ first waits for the caller's stream (`in` is produced) and
//     everything earlier on work_ (a previous call's kernels, which end in a
//     barrier of the members: their loads of our registered buffer are done);
//     the copy-in follows on work_;
//   * cudaStreamSynchronize(work_) then MPI_Barrier(group): every member's
//     copy-in has completed before any member's peer copies are issued;
//   * the peer copies, cudaStreamSynchronize(work_), MPI_Barrier(group): every
//     member's reads of our registered buffer completed before we return, so
//     the next call may write it. work_ is drained, so the caller's stream
//     needs no join (as Allgatherv).
Status CudaCommunicator::PeerAlltoallv(const void* in, size_t send_total, void* out,
                                       const std::vector<size_t>& recv_bytes,
                                       const std::vector<uint64_t>& incoming, cudaStream_t caller) {
  NVG_RETURN_IF_ERROR(EnterWork(caller));
  char* own = static_cast<char*>(registered_buffer());
  if (send_total > 0) NVG_CUDA_CHECK(cudaMemcpyAsync(own, in, send_total, cudaMemcpyDeviceToDevice, work_));
  NVG_CUDA_CHECK(cudaStreamSynchronize(work_));
  NVG_MPI_CHECK(MPI_Barrier(group_.comms.group));  // orders: every member's input is in place
  std::vector<size_t> displ(recv_bytes.size());
  for (size_t r = 1; r < recv_bytes.size(); ++r) displ[r] = displ[r - 1] + recv_bytes[r - 1];
  for (int p = 0; p < group_.topo.group_size; ++p) {
    const int r = member_ranks_[p];
    if (recv_bytes[r] > 0)
      NVG_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(out) + displ[r],
                                     group_.region->data(p) + incoming[2 * r + 1], recv_bytes[r],
                                     cudaMemcpyDefault, work_));
  }
  NVG_CUDA_CHECK(cudaStreamSynchronize(work_));
  NVG_MPI_CHECK(MPI_Barrier(group_.comms.group));  // orders: reads done before the buffers are reused
  return Status::Ok();
}

Status CudaCommunicator::Broadcast(void* buf, size_t bytes, int root, void* stream_arg) {
  NVG_RETURN_IF_ERROR(CheckHealthy());
  if (root < 0 || root >= group_.topo.size)
    return Status::InvalidArgument("broadcast: root " + std::to_string(root) + " outside 0.." +
                                   std::to_string(group_.topo.size - 1));
  if (bytes > static_cast<size_t>(INT_MAX))
    return Status::InvalidArgument("broadcast: more than 2^31-1 bytes");
  if (bytes == 0) return Status::Ok();
  if (buf == nullptr) return Status::InvalidArgument("broadcast: null buffer");
  NVG_CUDA_CHECK(cudaSetDevice(group_.device));
  // Runs on work_ (Note [Internal stream]) and returns with work_ drained, so
  // the caller's stream needs no join; host waits cannot be captured.
  auto capturing = Capturing(StreamOf(stream_arg));
  if (!capturing.ok()) return capturing.status();
  if (capturing.value())
    return Status::InvalidArgument(
        "allgatherv/broadcast wait on the host between steps and "
        "cannot be captured in a CUDA graph");
  NVG_RETURN_IF_ERROR(EnterWork(StreamOf(stream_arg)));
  cudaStream_t stream = work_;
  StatusOr<bool> peer = UsePeerCopies(buf, bytes, nullptr, 0);
  if (!peer.ok()) return peer.status();
  if (peer.value()) {
    // One NV-group: the root stages each piece in its registered buffer, the
    // others copy it from there (peer copies over NVLink); MPI barriers on the
    // group order the steps. Pieces of the registered capacity.
    int root_member = 0;
    for (int p = 0; p < group_.topo.group_size; ++p)
      if (member_ranks_[p] == root) root_member = p;
    char* root_data = group_.region->data(root_member);
    const size_t cap = registered_capacity();
    for (size_t off = 0; off < bytes; off += cap) {
      const size_t n = std::min(cap, bytes - off);
      if (group_.topo.rank == root)
        NVG_CUDA_CHECK(cudaMemcpyAsync(root_data, static_cast<char*>(buf) + off, n, cudaMemcpyDeviceToDevice,
                                       stream));
      NVG_CUDA_CHECK(cudaStreamSynchronize(stream));
      NVG_MPI_CHECK(MPI_Barrier(group_.comms.group));  // orders: the piece is staged
      if (group_.topo.rank != root) {
        NVG_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(buf) + off, root_data, n, cudaMemcpyDefault,
                                       stream));
        NVG_CUDA_CHECK(cudaStreamSynchronize(stream));
      }
      NVG_MPI_CHECK(MPI_Barrier(group_.comms.group));  // orders: reads done before reuse
    }
    return Status::Ok();
  }
  std::vector<char> host(bytes);
  NVG_CUDA_CHECK(cudaStreamSynchronize(stream));  // orders: the root's buffer is produced
  if (group_.topo.rank == root) NVG_CUDA_CHECK(cudaMemcpy(host.data(), buf, bytes, cudaMemcpyDeviceToHost));
  NVG_MPI_CHECK(MPI_Bcast(host.data(), static_cast<int>(bytes), MPI_BYTE, root, comm_));
  if (group_.topo.rank != root) {
    NVG_CUDA_CHECK(cudaMemcpyAsync(buf, host.data(), bytes, cudaMemcpyHostToDevice, stream));
    NVG_CUDA_CHECK(cudaStreamSynchronize(stream));  // host is freed on return
  }
  return Status::Ok();
}

}  // namespace nvgroup
