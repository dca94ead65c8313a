#include "cpu/cpu_communicator.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "algorithms/hierarchical_allreduce.h"
#include "common/checks.h"
#include "cpu/host_reduce.h"
#include "topology/topology.h"

namespace nvgroup {
namespace {

// Largest byte count handed to one MPI call: MPI counts are int.
constexpr size_t kMaxMpiBytes = size_t{1} << 30;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

class CpuCommunicator final : public Communicator {
 public:
  CpuCommunicator() = default;
  ~CpuCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  Status Init(MPI_Comm comm, const CommunicatorOptions& options, const Knobs& knobs);

  const Topology& topology() const override { return topo_; }
  Device device() const override { return Device::Cpu(); }

  Status Allreduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                   void* stream) override;
  Status Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes_per_rank,
                    void* stream) override;
  Status Broadcast(void* buf, size_t bytes, int root, void* stream) override;

  void* registered_buffer() override { return registered_.get(); }
  size_t registered_capacity() const override { return registered_bytes_; }

  Status WaitEvent(void*, void*) override { return Status::Ok(); }
  Status BatchedScaledCopy(const CopySpec* copies, size_t num_copies, DataType dtype, double scale,
                           void* stream) override;
  Status Synchronize(void*) override { return Status::Ok(); }
  void Abort() override { aborted_.store(true, std::memory_order_release); }

 private:
  Status CheckNotAborted() const {
    if (aborted_.load(std::memory_order_acquire))
      return Status::Aborted("communicator was aborted (shutdown or a lost peer)");
    return Status::Ok();
  }
  Status FlatAllreduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op);

  MPI_Comm comm_ = MPI_COMM_NULL;
  Topology topo_;
  TopologyComms comms_;
  AllreduceAlgorithm algorithm_ = AllreduceAlgorithm::kAuto;
  size_t chunk_bytes_ = 0;
  size_t registered_bytes_ = 0;
  std::unique_ptr<char, FreeDeleter> registered_;
  std::vector<char> scratch_;  // flat path: the `size` incoming copies of this rank's slice
  std::atomic<bool> aborted_{false};
};

Status CpuCommunicator::Init(MPI_Comm comm, const CommunicatorOptions& options, const Knobs& knobs) {
  NVG_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
  NVG_RETURN_IF_ERROR_CTX(SplitNodes(comm_, &topo_, &comms_), "splitting ranks into nodes");
  const bool from_options = options.group_size > 0;
  NVG_RETURN_IF_ERROR(SplitGroups(comm_, from_options ? options.group_size : knobs.group_size,
                                  from_options ? "group_size" : "NVGROUP_GROUP_SIZE", &topo_,
                                  &comms_));
  algorithm_ = knobs.algorithm;
  chunk_bytes_ = options.pipeline_chunk_bytes > 0 ? options.pipeline_chunk_bytes : knobs.pipeline_chunk;
  registered_bytes_ = options.registered_bytes > 0
                          ? options.registered_bytes
                          : std::max<size_t>(knobs.fusion_threshold, size_t{64} << 20);
  void* p = nullptr;
  // 4096: page alignment, so the buffer can later be a shared mapping of the same shape.
  if (posix_memalign(&p, 4096, registered_bytes_) != 0)
    return Status::Internal("cannot allocate the registered buffer of " +
                            std::to_string(registered_bytes_) + " bytes");
  registered_.reset(static_cast<char*>(p));
  return Status::Ok();
}

Status CpuCommunicator::Allreduce(const void* in, void* out, size_t count, DataType dtype,
                                  ReduceOp op, void* /*stream*/) {
  NVG_RETURN_IF_ERROR(ValidateReduction(dtype, op));
  if (count > 0 && (in == nullptr || out == nullptr))
    return Status::InvalidArgument("allreduce of " + std::to_string(count) +
                                   " elements with a null input or output pointer");
  NVG_RETURN_IF_ERROR(CheckNotAborted());
  if (count == 0) return Status::Ok();
  return FlatAllreduce(in, out, count, dtype, op);
}

Status CpuCommunicator::FlatAllreduce(const void* in, void* out, size_t count, DataType dtype,
                                      ReduceOp op) {
  const int n = topo_.size, me = topo_.rank;
  const size_t esize = DataTypeSize(dtype);
  // Pieces hold a whole number of 16-byte units per slice (as the skeleton's chunks).
  const size_t unit = std::max<size_t>(1, ChunkSlices::kSliceAlignBytes / esize) * n;
  const size_t piece_elems = std::max(unit, (chunk_bytes_ / esize) / unit * unit);
  scratch_.resize(piece_elems * esize + unit * esize);  // n slices of <= piece/n + one unit each
  std::vector<int> send_counts(n), send_displs(n), recv_counts(n), recv_displs(n);
  std::vector<const void*> sources(n);
  const int divisor = op == ReduceOp::kAverage ? n : 1;

  for (size_t offset = 0; offset < count; offset += piece_elems) {
    ChunkSlices piece;
    piece.offset = 0;  // slice offsets relative to the piece
    piece.count = std::min(piece_elems, count - offset);
    piece.group_size = n;
    piece.element_size = esize;
    const size_t mine = piece.SliceCount(me) * esize;
    for (int k = 0; k < n; ++k) {
      send_counts[k] = static_cast<int>(piece.SliceCount(k) * esize);
      send_displs[k] = static_cast<int>(piece.SliceOffset(k) * esize);
      recv_counts[k] = static_cast<int>(mine);
      recv_displs[k] = static_cast<int>(k * mine);
      sources[k] = scratch_.data() + k * mine;
    }
    const char* piece_in = static_cast<const char*>(in) + offset * esize;
    char* piece_out = static_cast<char*>(out) + offset * esize;
    // Alltoallv returns once our send buffer is consumed, so writing our slice of
    // `out` below cannot disturb what peers receive even when in == out.
    NVG_MPI_CHECK(MPI_Alltoallv(piece_in, send_counts.data(), send_displs.data(), MPI_BYTE,
                                scratch_.data(), recv_counts.data(), recv_displs.data(), MPI_BYTE,
                                comm_));
    if (mine > 0)
      NVG_RETURN_IF_ERROR(ReduceFold(dtype, op, sources.data(), n,
                                     piece_out + piece.SliceOffset(me) * esize, mine / esize, divisor));
    NVG_MPI_CHECK(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, piece_out, send_counts.data(),
                                 send_displs.data(), MPI_BYTE, comm_));
    NVG_RETURN_IF_ERROR(CheckNotAborted());
  }
  return Status::Ok();
}

Status CpuCommunicator::Allgatherv(const void* in, void* out,
                                   const std::vector<size_t>& bytes_per_rank, void* /*stream*/) {
  const int n = topo_.size;
  if (static_cast<int>(bytes_per_rank.size()) != n)
    return Status::InvalidArgument("allgatherv: bytes_per_rank has " +
                                   std::to_string(bytes_per_rank.size()) + " entries, expected one per rank (" +
                                   std::to_string(n) + ")");
  NVG_RETURN_IF_ERROR(CheckNotAborted());
  // Cross-rank check: every rank shares the byte count it sends and a digest of
  // the whole vector it expects; all ranks then judge the same table.
  uint64_t digest = 1469598103934665603ull;  // FNV-1a offset basis
  for (size_t b : bytes_per_rank) digest = (digest ^ b) * 1099511628211ull;  // FNV-1a prime
  uint64_t mine[2] = {bytes_per_rank[topo_.rank], digest};
  std::vector<uint64_t> all(2 * n);
  NVG_MPI_CHECK(MPI_Allgather(mine, 2, MPI_UINT64_T, all.data(), 2, MPI_UINT64_T, comm_));
  uint64_t truth = 1469598103934665603ull;
  for (int r = 0; r < n; ++r) truth = (truth ^ all[2 * r]) * 1099511628211ull;
  for (int r = 0; r < n; ++r)
    if (all[2 * r + 1] != truth) {
      std::string sent;
      for (int k = 0; k < n; ++k) sent += (k ? ", " : "") + std::to_string(all[2 * k]);
      return Status::InvalidArgument("allgatherv: rank " + std::to_string(r) +
                                     " expects different per-rank byte counts than the ranks send ([" +
                                     sent + "])");
    }
  std::vector<size_t> displs(n, 0);
  size_t total = 0;
  for (int r = 0; r < n; ++r) {
    displs[r] = total;
    total += bytes_per_rank[r];
  }
  if (total > 0 && (out == nullptr || (bytes_per_rank[topo_.rank] > 0 && in == nullptr)))
    return Status::InvalidArgument("allgatherv with a null input or output pointer");
  char* outc = static_cast<char*>(out);
  if (total <= static_cast<size_t>(INT_MAX)) {
    std::vector<int> counts(n), idispls(n);
    for (int r = 0; r < n; ++r) {
      counts[r] = static_cast<int>(bytes_per_rank[r]);
      idispls[r] = static_cast<int>(displs[r]);
    }
    if (outc + displs[topo_.rank] != in && bytes_per_rank[topo_.rank] > 0)
      std::memmove(outc + displs[topo_.rank], in, bytes_per_rank[topo_.rank]);
    NVG_MPI_CHECK(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out, counts.data(),
                                 idispls.data(), MPI_BYTE, comm_));
    return Status::Ok();
  }
  // Beyond int displacements: each rank broadcasts its block, in int-sized pieces.
  if (outc + displs[topo_.rank] != in && bytes_per_rank[topo_.rank] > 0)
    std::memmove(outc + displs[topo_.rank], in, bytes_per_rank[topo_.rank]);
  for (int r = 0; r < n; ++r)
    for (size_t off = 0; off < bytes_per_rank[r]; off += kMaxMpiBytes)
      NVG_MPI_CHECK(MPI_Bcast(outc + displs[r] + off,
                              static_cast<int>(std::min(kMaxMpiBytes, bytes_per_rank[r] - off)),
                              MPI_BYTE, r, comm_));
  return Status::Ok();
}

Status CpuCommunicator::Broadcast(void* buf, size_t bytes, int root, void* /*stream*/) {
  NVG_RETURN_IF_ERROR(CheckNotAborted());
  // Cross-rank check of (root, bytes): min and max (negated) in one MPI_MIN.
  int64_t view[4] = {root, -static_cast<int64_t>(root), static_cast<int64_t>(bytes),
                     -static_cast<int64_t>(bytes)};
  int64_t agreed[4];
  NVG_MPI_CHECK(MPI_Allreduce(view, agreed, 4, MPI_INT64_T, MPI_MIN, comm_));
  if (agreed[0] != -agreed[1] || agreed[2] != -agreed[3])
    return Status::InvalidArgument("broadcast: ranks disagree on root (" + std::to_string(agreed[0]) +
                                   ".." + std::to_string(-agreed[1]) + ") or size (" +
                                   std::to_string(agreed[2]) + ".." + std::to_string(-agreed[3]) +
                                   " bytes)");
  if (root < 0 || root >= topo_.size)
    return Status::InvalidArgument("broadcast root " + std::to_string(root) + " is not a rank (size " +
                                   std::to_string(topo_.size) + ")");
  if (bytes > 0 && buf == nullptr) return Status::InvalidArgument("broadcast of a null pointer");
  char* p = static_cast<char*>(buf);
  for (size_t off = 0; off < bytes; off += kMaxMpiBytes)
    NVG_MPI_CHECK(MPI_Bcast(p + off, static_cast<int>(std::min(kMaxMpiBytes, bytes - off)), MPI_BYTE,
                            root, comm_));
  return Status::Ok();
}

Status CpuCommunicator::BatchedScaledCopy(const CopySpec* copies, size_t num_copies, DataType dtype,
                                          double scale, void* /*stream*/) {
  for (size_t i = 0; i < num_copies; ++i)
    NVG_RETURN_IF_ERROR_CTX(ScaledCopy(dtype, copies[i].src, copies[i].dst, copies[i].count, scale),
                            "scaled copy " + std::to_string(i) + " of " + std::to_string(num_copies));
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<Communicator>> CreateCpuCommunicator(MPI_Comm comm,
                                                              const CommunicatorOptions& options,
                                                              const Knobs& knobs) {
  auto c = std::make_unique<CpuCommunicator>();
  NVG_RETURN_IF_ERROR_CTX(c->Init(comm, options, knobs), "creating the CPU communicator");
  return std::unique_ptr<Communicator>(std::move(c));
}

}  // namespace nvgroup
