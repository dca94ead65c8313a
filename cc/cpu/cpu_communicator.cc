#include "cpu/cpu_communicator.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>

#include "algorithms/hierarchical_allreduce.h"
#include "common/checks.h"
#include "common/collective_args.h"
#include "cpu/host_primitives.h"
#include "cpu/host_reduce.h"
#include "topology/topology.h"
#include "transport/shm_group.h"

namespace nvgroup {
namespace {

// Largest byte count handed to one MPI call: MPI counts are int.
constexpr size_t kMaxMpiBytes = size_t{1} << 30;

// Status of an MPI return code (NVG_MPI_CHECK's text), for call sites that
// pass it on through Track instead of returning at once.
Status Mpi(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return Status::Ok();
  return Status::Internal(std::string(call) + " failed: " + MpiErrorString(rc));
}

class CpuCommunicator final : public Communicator {
 public:
  CpuCommunicator() = default;
  ~CpuCommunicator() override {
    cross_.reset();  // complete the exchanges in flight
    flat_.reset();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  Status Init(MPI_Comm comm, const Knobs& knobs, const CommunicatorOptions& options);

  const Topology& topology() const override { return topo_; }
  Device device() const override { return Device::Cpu(); }

  Status Allreduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                   void* stream) override;
  Status Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes_per_rank,
                    void* stream) override;
  Status Broadcast(void* buf, size_t bytes, int root, void* stream) override;
  Status ReduceScatter(const void* in, void* out, const std::vector<size_t>& counts, DataType dtype,
                       ReduceOp op, void* stream) override;
  Status Alltoallv(const void* in, const std::vector<size_t>& send_bytes, void* out,
                   const std::vector<size_t>& recv_bytes, void* stream) override;

  void* registered_buffer() override { return shm_->buffer(topo_.group_rank); }
  size_t registered_capacity() const override { return shm_->capacity(); }

  Status WaitEvent(void*, void*) override { return Status::Ok(); }
  Status BatchedScaledCopy(const CopySpec* copies, size_t num_copies, DataType dtype, double scale,
                           void* stream) override;
  Status FusedAllreduce(const FusedMember* members, size_t num_members, size_t bytes, DataType dtype,
                        ReduceOp op, double prescale, double postscale, void* stream,
                        const PhaseObserver& observer) override;
  Status Synchronize(void*) override { return Status::Ok(); }
  void Abort() override {
    aborted_.store(true, std::memory_order_release);
    if (shm_ != nullptr) shm_->MarkFailed();  // group members stop waiting for us
  }

 private:
  // kAborted after Abort(), kUnavailable after a failed collective, else OK.
  Status CheckUsable() const;
  // Passes `s` through; a failure during communication leaves the peers in an
  // unknown state, so it breaks the communicator for good and tells the group
  // members (their barriers fail at once instead of timing out).
  Status Track(Status s);
  Status HierarchicalAllreduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op);
  Status FlatAllreduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op);
  Status RunPieces(const void* in, void* out, size_t count, DataType dtype, ReduceOp op, bool in_registered);
  Status GroupReduceScatter(const void* in, void* out, size_t total, size_t my_offset, size_t mine,
                            DataType dtype, ReduceOp op, bool in_registered);
  Status HierarchicalReduceScatter(const void* in, void* out, const std::vector<size_t>& counts,
                                   DataType dtype, ReduceOp op, bool in_registered);

  MPI_Comm comm_ = MPI_COMM_NULL;
  Topology topo_;
  TopologyComms comms_;
  AllreduceAlgorithm algorithm_ = AllreduceAlgorithm::kAuto;
  size_t chunk_bytes_ = 0;     // the flat path's pieces, the reduce-scatter's chunks
  PipelineChunking chunking_;  // the hierarchical allreduce's chunks
  std::atomic<bool> aborted_{false};  // before shm_, which holds a pointer to it
  std::unique_ptr<ShmGroup> shm_;
  std::string first_failure_;        // non-empty once a collective failed mid-way
  std::vector<char> flat_scratch_[2];  // the flat exchange's receive buffers, by piece parity
  std::vector<char>
      scatter_scratch_;  // ReduceScatter through a full allreduce (NVGROUP_ALLREDUCE_ALGORITHM=mpi)
  // The hierarchical ReduceScatter (several groups): who sits where, the
  // call's plan and its buffers, kept between calls.
  RowOwners row_owners_;
  RowScatterPlan row_plan_;
  HostScatterBuffers row_buffers_;
  std::vector<char> cross_scratch_[2];  // CrossExchange receive buffers, by chunk parity
  // The cross-group step (group_count > 1) and the flat path's exchange over
  // all ranks in rank order (when the algorithm can take the flat path).
  // Declared last: destroyed first, they complete the exchanges in flight
  // before the buffers above go away.
  std::unique_ptr<CrossExchange> cross_;
  std::unique_ptr<CrossExchange> flat_;
};

Status CpuCommunicator::Init(MPI_Comm comm, const Knobs& knobs, const CommunicatorOptions& options) {
  NVG_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
  // Errors come back as return codes (NVG_MPI_CHECK) instead of aborting the job;
  // the sub-communicators split from comm_ inherit this.
  NVG_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  NVG_RETURN_IF_ERROR_CTX(SplitNodes(comm_, &topo_, &comms_), "splitting ranks into nodes");
  NVG_RETURN_IF_ERROR(SplitGroups(comm_, knobs.group_size, "NVGROUP_GROUP_SIZE", &topo_, &comms_));
  algorithm_ = knobs.algorithm;
  chunk_bytes_ = knobs.pipeline_chunk;
  chunking_.max_bytes = knobs.pipeline_chunk;
  chunking_.min_bytes = knobs.pipeline_min_chunk;
  const size_t registered_bytes = RegisteredBytes(options, knobs);
  // One float64 element at least, so every dtype can move through it in pieces.
  if (registered_bytes < sizeof(double))
    return Status::InvalidArgument("registered_bytes=" + std::to_string(registered_bytes) +
                                   " is too small (at least 8 bytes)");
  std::vector<int> global_ranks(topo_.group_size);
  NVG_MPI_CHECK(MPI_Allgather(&topo_.rank, 1, MPI_INT, global_ranks.data(), 1, MPI_INT, comms_.group));
  StatusOr<std::unique_ptr<ShmGroup>> shm = ShmGroup::Create(comms_.group, global_ranks, registered_bytes,
                                                             knobs.peer_timeout_s, &aborted_);
  if (!shm.ok()) return shm.status().WithContext("setting up the group's shared memory");
  shm_ = shm.consume();
  if (topo_.group_count > 1) {
    NVG_RETURN_IF_ERROR_CTX(RowOwners::Gather(comm_, topo_, &row_owners_),
                            "placing the ranks in their groups");
    CrossExchange::Options cross_options;
    cross_options.allgather_max_bytes = knobs.cross_allgather_max_bytes;
    StatusOr<std::unique_ptr<CrossExchange>> cross = CrossExchange::Create(comms_.cross, cross_options);
    if (!cross.ok()) return cross.status().WithContext("setting up the cross-group exchange");
    cross_ = cross.consume();
  }
  const bool flat_possible = algorithm_ == AllreduceAlgorithm::kMpi ||
                             (algorithm_ == AllreduceAlgorithm::kAuto && topo_.group_size == 1);
  if (flat_possible && topo_.size > 1) {
    // Progressed by the caller (Start and Wait): it only waits between pieces,
    // so a progress thread would have nothing to overlap.
    CrossExchange::Options flat_options;
    flat_options.use_thread = false;
    flat_options.allgather_max_bytes = knobs.cross_allgather_max_bytes;
    StatusOr<std::unique_ptr<CrossExchange>> flat = CrossExchange::Create(comm_, flat_options);
    if (!flat.ok()) return flat.status().WithContext("setting up the flat path's exchange");
    flat_ = flat.consume();
  }
  return Status::Ok();
}

Status CpuCommunicator::CheckUsable() const {
  if (aborted_.load(std::memory_order_acquire))
    return Status::Aborted("communicator was aborted (shutdown or a lost peer)");
  if (!first_failure_.empty())
    return Status::Unavailable("communicator is unusable after an earlier failure: " + first_failure_);
  return Status::Ok();
}

Status CpuCommunicator::Track(Status s) {
  if (!s.ok()) {
    if (first_failure_.empty()) first_failure_ = s.ToString();
    shm_->MarkFailed();
  }
  return s;
}

Status CpuCommunicator::Allreduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                                  void* /*stream*/) {
  NVG_RETURN_IF_ERROR(ValidateReduction(dtype, op));
  if (count > 0 && (in == nullptr || out == nullptr))
    return Status::InvalidArgument("allreduce of " + std::to_string(count) +
                                   " elements with a null input or output pointer");
  NVG_RETURN_IF_ERROR(CheckUsable());
  if (count == 0) return Status::Ok();
  const bool flat = algorithm_ == AllreduceAlgorithm::kMpi ||
                    (algorithm_ == AllreduceAlgorithm::kAuto && topo_.group_size == 1);
  if (flat) return Track(FlatAllreduce(in, out, count, dtype, op));
  return HierarchicalAllreduce(in, out, count, dtype, op);
}

// The flat path (Note [Determinism contract]): the message in pieces of at
// most pipeline_chunk bytes (whole units per rank; MPI counts are int, so at
// most 1 GiB), each piece one job of the exchange over all ranks in rank order
// (CrossExchange, cc/algorithms/cross_exchange.h: its slice is the piece, its
// parts one per rank; reduce-scatter + allgather, or allgather + fold for
// small pieces, the same bits). Two pieces are in flight, their receive
// buffers by piece parity (CrossJobs): piece k + 2 reuses those of piece k
// after Finish(k). A piece reads only its part of `in` and writes only its
// part of `out`, so `out` may be `in`.
Status CpuCommunicator::FlatAllreduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op) {
  if (topo_.size == 1) {
    if (out != in) std::memcpy(out, in, count * DataTypeSize(dtype));
    return Status::Ok();
  }
  if (flat_ == nullptr) return Status::Internal("flat allreduce without its exchange");
  const size_t esize = DataTypeSize(dtype);
  const size_t piece = PieceElements(std::min(chunk_bytes_, kMaxMpiBytes), esize,
                                     AlignUnitElements(esize) * static_cast<size_t>(topo_.size));
  const size_t num_pieces = (count + piece - 1) / piece;
  const CrossExchange::Fold fold = HostFold(dtype, op, op == ReduceOp::kAverage ? topo_.size : 1);
  CrossJobs jobs(flat_.get());
  auto start = [&](size_t k) -> Status {
    const size_t offset = k * piece, n = std::min(piece, count - offset);
    std::vector<char>& scratch = flat_scratch_[k % 2];
    scratch.resize(std::max(scratch.size(), flat_->RecvBytes(n, esize)));
    CrossExchange::Job job;
    job.send = static_cast<const char*>(in) + offset * esize;
    job.recv = scratch.data();
    job.result = static_cast<char*>(out) + offset * esize;
    job.count = n;
    job.element_size = esize;
    job.fold = fold;
    return jobs.Start(k, std::move(job));
  };
  // A piece started is always finished (its buffers stay in use until then).
  constexpr size_t kInFlight = 2;
  Status first;
  size_t started = 0;
  for (; started < std::min(kInFlight, num_pieces) && first.ok(); ++started) first = start(started);
  if (!first.ok()) --started;  // a failed Start queued nothing
  for (size_t k = 0; k < started; ++k) {
    Status s = jobs.Finish(k);
    if (!s.ok()) s = s.WithContext("flat allreduce of piece " + std::to_string(k));
    if (first.ok()) first = s;
    if (first.ok() && started < num_pieces) {
      first = start(started);
      if (first.ok()) ++started;
    }
  }
  return first;
}

// The registered buffer holds each member's input for the group step, so the
// buffers the caller passes must not alias it in ways the protocol would break.
// Checked before the first barrier: a bad pointer is this rank's own error and
// leaves the group intact.
Status CpuCommunicator::HierarchicalAllreduce(const void* in, void* out, size_t count, DataType dtype,
                                              ReduceOp op) {
  const size_t bytes = count * DataTypeSize(dtype);
  const char* reg = shm_->buffer(topo_.group_rank);
  const size_t capacity = shm_->capacity();
  const bool in_registered = in == reg && bytes <= capacity;
  if (!in_registered && Overlaps(in, bytes, reg, capacity))
    return Status::InvalidArgument(
        "allreduce input overlaps the registered buffer but does not fit it from its start (" +
        std::to_string(bytes) + " bytes, capacity " + std::to_string(capacity) + ")");
  if (Overlaps(out, bytes, reg, capacity) && !(in_registered && out == reg))
    return Status::InvalidArgument(
        "allreduce output overlaps the registered buffer; it may only be the registered buffer "
        "itself, with the input there too");
  return Track(RunPieces(in, out, count, dtype, op, in_registered));
}

// Pieces of at most registered_capacity() bytes: each piece's input is copied to
// the start of the registered buffer (unless it already lies there), then
//   barrier "inputs in place"  -- orders every member's copy-in before peers read it;
//   the skeleton over HostPrimitives;
//   barrier "reads done"       -- orders every member's reads of our buffer
//                                 before we copy the next piece (or the caller
//                                 fuses the next message) into it.
Status CpuCommunicator::RunPieces(const void* in, void* out, size_t count, DataType dtype, ReduceOp op,
                                  bool in_registered) {
  const size_t esize = DataTypeSize(dtype);
  char* reg = shm_->buffer(topo_.group_rank);
  const size_t piece_elems = in_registered ? count : PieceElements(shm_->capacity(), esize, 1);
  const bool force = algorithm_ == AllreduceAlgorithm::kHierarchical;
  for (size_t offset = 0; offset < count; offset += piece_elems) {
    const size_t n = std::min(piece_elems, count - offset);
    if (!in_registered) std::memcpy(reg, static_cast<const char*>(in) + offset * esize, n * esize);
    NVG_RETURN_IF_ERROR(shm_->Barrier("allreduce: inputs in place"));
    HostPrimitives prims(topo_, shm_.get(), cross_.get(), dtype, op, cross_scratch_);
    NVG_RETURN_IF_ERROR(RunHierarchicalAllreduce(prims, n, static_cast<char*>(out) + offset * esize,
                                                 chunking_, force));
    NVG_RETURN_IF_ERROR(shm_->Barrier("allreduce: reads done"));
  }
  return Status::Ok();
}

// Allgatherv and Broadcast first agree on their arguments in one small
// collective, so a mismatch or a bad pointer on any rank becomes the same
// kInvalidArgument on every rank instead of a hang or a truncation error.
Status CpuCommunicator::Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes_per_rank,
                                   void* /*stream*/) {
  const int n = topo_.size;
  if (static_cast<int>(bytes_per_rank.size()) != n)
    return Status::InvalidArgument("allgatherv: bytes_per_rank has " + std::to_string(bytes_per_rank.size()) +
                                   " entries, expected one per rank (" + std::to_string(n) + ")");
  NVG_RETURN_IF_ERROR(CheckUsable());
  size_t total = 0;
  for (size_t b : bytes_per_rank) total += b;
  const size_t mine = bytes_per_rank[topo_.rank];
  const bool pointers_ok = (total == 0 || out != nullptr) && (mine == 0 || in != nullptr);
  // Each rank shares what it sends, a digest of the vector it expects and
  // whether its pointers are usable; every rank judges the same table.
  uint64_t digest = 1469598103934665603ull;  // FNV-1a 64-bit offset basis
  for (size_t b : bytes_per_rank) digest = (digest ^ b) * 1099511628211ull;  // FNV-1a prime
  uint64_t view[3] = {mine, digest, pointers_ok ? 1u : 0u};
  std::vector<uint64_t> all(3 * n);
  NVG_RETURN_IF_ERROR(Track(Mpi(MPI_Allgather(view, 3, MPI_UINT64_T, all.data(), 3, MPI_UINT64_T, comm_),
                                "MPI_Allgather (argument check of an allgatherv)")));
  uint64_t truth = 1469598103934665603ull;
  std::string sent;
  for (int r = 0; r < n; ++r) {
    truth = (truth ^ all[3 * r]) * 1099511628211ull;
    sent += (r ? ", " : "") + std::to_string(all[3 * r]);
  }
  for (int r = 0; r < n; ++r) {
    if (all[3 * r + 1] != truth)
      return Status::InvalidArgument("allgatherv: rank " + std::to_string(r) +
                                     " expects different per-rank byte counts than the ranks send ([" + sent +
                                     "])");
    if (all[3 * r + 2] == 0)
      return Status::InvalidArgument("allgatherv: rank " + std::to_string(r) +
                                     " passed a null input or output pointer");
  }
  if (total == 0) return Status::Ok();

  std::vector<size_t> displs(n, 0);
  for (int r = 1; r < n; ++r) displs[r] = displs[r - 1] + bytes_per_rank[r - 1];
  char* outc = static_cast<char*>(out);
  if (mine > 0 && outc + displs[topo_.rank] != in) std::memmove(outc + displs[topo_.rank], in, mine);
  if (total <= static_cast<size_t>(INT_MAX)) {
    std::vector<int> counts(n), int_displs(n);
    for (int r = 0; r < n; ++r) {
      counts[r] = static_cast<int>(bytes_per_rank[r]);
      int_displs[r] = static_cast<int>(displs[r]);
    }
    return Track(Mpi(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out, counts.data(), int_displs.data(),
                                    MPI_BYTE, comm_),
                     "MPI_Allgatherv"));
  }
  // Beyond int displacements: each rank broadcasts its block, in int-sized pieces.
  for (int r = 0; r < n; ++r)
    for (size_t off = 0; off < bytes_per_rank[r]; off += kMaxMpiBytes)
      NVG_RETURN_IF_ERROR(Track(Mpi(MPI_Bcast(outc + displs[r] + off,
                                              static_cast<int>(std::min(kMaxMpiBytes,
                                                                        bytes_per_rank[r] - off)),
                                              MPI_BYTE, r, comm_),
                                    "MPI_Bcast (block of a large allgatherv)")));
  return Status::Ok();
}

Status CpuCommunicator::Broadcast(void* buf, size_t bytes, int root, void* /*stream*/) {
  NVG_RETURN_IF_ERROR(CheckUsable());
  // Min and max (negated) of root and size, and the max of "bad pointer", in one MPI_MIN.
  const int64_t bad = bytes > 0 && buf == nullptr ? 1 : 0;
  int64_t view[5] = {root, -static_cast<int64_t>(root), static_cast<int64_t>(bytes),
                     -static_cast<int64_t>(bytes), -bad};
  int64_t agreed[5];
  NVG_RETURN_IF_ERROR(Track(Mpi(MPI_Allreduce(view, agreed, 5, MPI_INT64_T, MPI_MIN, comm_),
                                "MPI_Allreduce (argument check of a broadcast)")));
  if (agreed[0] != -agreed[1] || agreed[2] != -agreed[3])
    return Status::InvalidArgument("broadcast: ranks disagree on root (" + std::to_string(agreed[0]) + ".." +
                                   std::to_string(-agreed[1]) + ") or size (" + std::to_string(agreed[2]) +
                                   ".." + std::to_string(-agreed[3]) + " bytes)");
  if (root < 0 || root >= topo_.size)
    return Status::InvalidArgument("broadcast root " + std::to_string(root) + " is not a rank (size " +
                                   std::to_string(topo_.size) + ")");
  if (agreed[4] != 0) return Status::InvalidArgument("broadcast: a rank passed a null pointer");
  char* p = static_cast<char*>(buf);
  for (size_t off = 0; off < bytes; off += kMaxMpiBytes)
    NVG_RETURN_IF_ERROR(Track(Mpi(MPI_Bcast(p + off, static_cast<int>(std::min(kMaxMpiBytes, bytes - off)),
                                            MPI_BYTE, root, comm_),
                                  "MPI_Bcast")));
  return Status::Ok();
}

Status CpuCommunicator::ReduceScatter(const void* in, void* out, const std::vector<size_t>& counts,
                                      DataType dtype, ReduceOp op, void* /*stream*/) {
  NVG_RETURN_IF_ERROR(ValidateReduction(dtype, op));
  const size_t esize = DataTypeSize(dtype);
  ReduceScatterSplit split;
  NVG_RETURN_IF_ERROR(CheckReduceScatter(in, out, counts, esize, topo_.rank, topo_.size,
                                         shm_->buffer(topo_.group_rank), shm_->capacity(), &split));
  NVG_RETURN_IF_ERROR(CheckUsable());
  const size_t total = split.total, my_offset = split.offset, mine = split.mine;
  const bool in_registered = split.in_registered;
  if (total == 0) return Status::Ok();
  const bool one_group = topo_.group_count == 1 && topo_.group_size > 1 &&
                         algorithm_ != AllreduceAlgorithm::kMpi;
  if (one_group) return Track(GroupReduceScatter(in, out, total, my_offset, mine, dtype, op, in_registered));
  if (topo_.group_count > 1 && algorithm_ != AllreduceAlgorithm::kMpi)
    return Track(HierarchicalReduceScatter(in, out, counts, dtype, op, in_registered));
  // The flat path (NVGROUP_ALLREDUCE_ALGORITHM=mpi; one rank): the allreduce's
  // own fold, then our rows.
  scatter_scratch_.resize(total * esize);
  NVG_RETURN_IF_ERROR(Allreduce(in, scatter_scratch_.data(), total, dtype, op, nullptr));
  if (mine > 0) std::memcpy(out, scatter_scratch_.data() + my_offset * esize, mine * esize);
  return Status::Ok();
}

// The group reduce-scatter step with the caller's row split instead of the
// skeleton's slices. Per piece of at most registered_capacity() bytes:
//   copy the piece into our registered buffer (unless it is already there);
//   barrier "inputs in place" -- orders every member's copy-in before the reads;
//   fold our rows of the piece over the members' buffers in group_rank order
//     (the order GroupAllreduce folds in, so the bits equal the allreduce's);
//   barrier "reads done"      -- orders every member's reads of our buffer
//                                before the next piece overwrites it.
Status CpuCommunicator::GroupReduceScatter(const void* in, void* out, size_t total, size_t my_offset,
                                           size_t mine, DataType dtype, ReduceOp op, bool in_registered) {
  const size_t esize = DataTypeSize(dtype);
  char* reg = shm_->buffer(topo_.group_rank);
  const size_t piece = in_registered ? total : PieceElements(shm_->capacity(), esize, 1);
  const int divisor = op == ReduceOp::kAverage ? topo_.size : 1;
  std::vector<const void*> sources(topo_.group_size);
  for (size_t p0 = 0; p0 < total; p0 += piece) {
    const size_t p1 = std::min(total, p0 + piece);
    if (!in_registered) std::memcpy(reg, static_cast<const char*>(in) + p0 * esize, (p1 - p0) * esize);
    NVG_RETURN_IF_ERROR(shm_->Barrier("reducescatter: inputs in place"));
    const size_t lo = std::max(p0, my_offset), hi = std::min(p1, my_offset + mine);
    if (lo < hi) {
      for (int m = 0; m < topo_.group_size; ++m) sources[m] = shm_->buffer(m) + (lo - p0) * esize;
      NVG_RETURN_IF_ERROR(ReduceFold(dtype, op, sources.data(), topo_.group_size,
                                     static_cast<char*>(out) + (lo - my_offset) * esize, hi - lo, divisor));
    }
    NVG_RETURN_IF_ERROR(shm_->Barrier("reducescatter: reads done"));
  }
  return Status::Ok();
}

// Several groups: the skeleton of cc/algorithms/hierarchical_reduce_scatter.h
// over HostScatterPrimitives (protocol there and in cc/cpu/host_primitives.h).
// Pieces of the registered capacity when G > 1 (the group reads the members'
// registered buffers); with groups of one rank nothing is shared and the whole
// message is one piece. A rank's parts of one chunk hold at most a member's
// share of the pipeline chunk (chunk / G, as the allreduce's slice).
Status CpuCommunicator::HierarchicalReduceScatter(const void* in, void* out,
                                                  const std::vector<size_t>& counts, DataType dtype,
                                                  ReduceOp op, bool in_registered) {
  const size_t esize = DataTypeSize(dtype);
  size_t total = 0;
  for (size_t c : counts) total += c;
  const size_t piece = topo_.group_size == 1 || in_registered ? total
                                                              : PieceElements(shm_->capacity(), esize, 1);
  const size_t capacity = std::max<size_t>(2 * static_cast<size_t>(topo_.group_count),
                                           chunk_bytes_ / esize / topo_.group_size);
  NVG_RETURN_IF_ERROR(row_plan_.Build(counts, row_owners_, topo_.group_rank, topo_.group_index, piece,
                                      capacity, capacity));
  HostScatterPrimitives prims(topo_, shm_.get(), cross_.get(), row_plan_, in, in_registered, out, dtype, op,
                              &row_buffers_);
  return RunHierarchicalReduceScatter(prims, row_plan_);
}

// One group of G > 1 members (the auto algorithm): the host primitives' fused
// mode (Note [Fused bucket on one group], cc/cpu/host_primitives.h).
Status CpuCommunicator::FusedAllreduce(const FusedMember* members, size_t num_members, size_t bytes,
                                       DataType dtype, ReduceOp op, double prescale, double postscale,
                                       void* stream, const PhaseObserver& observer) {
  NVG_RETURN_IF_ERROR(ValidateReduction(dtype, op));
  NVG_RETURN_IF_ERROR(CheckUsable());
  if (bytes > shm_->capacity())
    return Status::InvalidArgument("fused allreduce of " + std::to_string(bytes) +
                                   " bytes exceeds the registered buffer (" +
                                   std::to_string(shm_->capacity()) + " bytes)");
  if (topo_.size == 1)
    return FusedAllreduceOneRank(members, num_members, dtype, prescale, postscale, stream, observer);
  if (algorithm_ == AllreduceAlgorithm::kAuto && topo_.group_count == 1 && topo_.group_size > 1) {
    HostPrimitives prims(topo_, shm_.get(), cross_.get(), dtype, op, cross_scratch_);
    return Track(prims.GroupAllreduceMembers(members, num_members, bytes / DataTypeSize(dtype), prescale,
                                             postscale, observer));
  }
  return FusedAllreduceThroughBuffer(members, num_members, bytes, dtype, op, prescale, postscale, stream,
                                     observer);
}

Status CpuCommunicator::Alltoallv(const void* in, const std::vector<size_t>& send_bytes, void* out,
                                  const std::vector<size_t>& recv_bytes, void* /*stream*/) {
  NVG_RETURN_IF_ERROR(CheckUsable());
  // What each rank will send us, checked against what we expect, on every rank.
  AlltoallvAgreement agreed;
  Status s = AgreeAlltoallv(comm_, topo_.size, in, send_bytes, out, recv_bytes, false, false, &agreed);
  if (!s.ok()) return agreed.mpi_failed ? Track(s) : s;
  std::vector<int> sc, sd, rc, rd;
  MpiCountsAndDisplacements(send_bytes, &sc, &sd);
  MpiCountsAndDisplacements(recv_bytes, &rc, &rd);
  // A non-null dummy for empty buffers: some MPIs reject null with zero counts.
  char dummy = 0;
  return Track(Mpi(MPI_Alltoallv(in != nullptr ? in : &dummy, sc.data(), sd.data(), MPI_BYTE,
                                 out != nullptr ? out : &dummy, rc.data(), rd.data(), MPI_BYTE, comm_),
                   "MPI_Alltoallv"));
}

Status CpuCommunicator::BatchedScaledCopy(const CopySpec* copies, size_t num_copies, DataType dtype,
                                          double scale, void* /*stream*/) {
  for (size_t i = 0; i < num_copies; ++i)
    NVG_RETURN_IF_ERROR_CTX(ScaledCopy(dtype, copies[i].src, copies[i].dst, copies[i].count, scale),
                            "scaled copy " + std::to_string(i) + " of " + std::to_string(num_copies));
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<Communicator>> CreateCpuCommunicator(MPI_Comm comm, const Knobs& knobs,
                                                              const CommunicatorOptions& options) {
  auto c = std::make_unique<CpuCommunicator>();
  NVG_RETURN_IF_ERROR_CTX(c->Init(comm, knobs, options), "creating the CPU communicator");
  return std::unique_ptr<Communicator>(std::move(c));
}

}  // namespace nvgroup
