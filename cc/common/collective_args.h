// Argument checks of the collectives, written once for the CPU and the CUDA
// communicator (cc/cpu/cpu_communicator.cc, cc/device/communicator_*_cuda.cc)
// so both reject the same misuse with the same words (communicator.h states
// the rules), and the registered buffer's size both create.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "nvgroup/communicator.h"
#include "nvgroup/status.h"

namespace nvgroup {

struct Knobs;  // cc/common/env.h

// Bytes of the registered buffer per rank: options.registered_bytes, or by
// default knobs.fusion_threshold or 64 MiB, whichever is larger.
size_t RegisteredBytes(const CommunicatorOptions& options, const Knobs& knobs);

// Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte.
bool Overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes);

// ReduceScatter: this rank receives elements [offset, offset + mine) of the
// `total` (counts in rank order).
struct ReduceScatterSplit {
  size_t total = 0;
  size_t offset = 0;
  size_t mine = 0;
  bool in_registered = false;  // `in` is the registered buffer itself (from its start)
};

// Local checks of a ReduceScatter over `size` ranks: one count per rank; no null pointer where
// there are elements; `out` outside the registered buffer [reg, reg +
// capacity); `in` either that buffer from its start (the whole input fitting
// it) or outside it.
Status CheckReduceScatter(const void* in, const void* out, const std::vector<size_t>& counts,
                          size_t element_size, int rank, int size, const void* reg, size_t capacity,
                          ReduceScatterSplit* split);

// What the ranks agreed on for an Alltoallv.
struct AlltoallvAgreement {
  size_t send_total = 0;
  size_t recv_total = 0;
  // From every rank r: how many bytes r sends us and at which offset of r's
  // input they start (2 r, 2 r + 1).
  std::vector<uint64_t> incoming;
  bool fast_everywhere = false;  // every rank passed fast_here
  bool mpi_failed = false;       // the returned error is an MPI failure, not a verdict
};

// Collective over `comm` (size ranks): one byte count per rank on both sides;
// every rank's counts are checked against what its peers send, pointers
// against null, totals against MPI's int counts; a failed check is the same
// kInvalidArgument / kUnimplemented on every rank. `fast_here`: this rank can
// take the communicator's fast path; agreed->fast_everywhere says whether all
// can. `capturing_here`: this rank's stream captures a CUDA graph, which an
// alltoallv (host waits) cannot join: kInvalidArgument on every rank.
Status AgreeAlltoallv(MPI_Comm comm, int size, const void* in, const std::vector<size_t>& send_bytes,
                      const void* out, const std::vector<size_t>& recv_bytes, bool fast_here,
                      bool capturing_here, AlltoallvAgreement* agreed);

// MPI's int counts and displacements of consecutive parts of `bytes[r]` bytes
// (the caller has checked that the total fits an int).
void MpiCountsAndDisplacements(const std::vector<size_t>& bytes, std::vector<int>* counts,
                               std::vector<int>* displacements);

}  // namespace nvgroup
