// The hierarchical reduce-scatter over several NV-groups, written once for the
// CPU (HostScatterPrimitives, cc/cpu/host_primitives.h) and the GPU
// (DeviceScatterPrimitives, cc/device/device_primitives.h): the allreduce
// skeleton's first two steps (cc/algorithms/hierarchical_allreduce.h) with the
// caller's row split instead of equal slices, and no allgather anywhere.
//
// What it computes. Communicator::ReduceScatter: counts[r] elements (Horovod's
// uneven dim-0 split, consecutive in global rank order) go to rank r. Let the
// rank with group_index j and group_rank l own the rows R(j, l) (its counts
// entry; where it sits in global rank order comes from the owner table that
// Init gathers, RowOwners, never from rank arithmetic: under jsrun or with
// ranks mapped round-robin over nodes a group's ranks are not consecutive).
// Every element gets the allreduce's bits: the left fold over the members of
// a group in group_rank order (rounded to the element type once), then the
// left fold of those results over the groups in group_index order (Average
// divides by the global size there), exactly the two folds of the allreduce.
//
// How (the words: Note [Vocabulary], cc/algorithms/hierarchical_allreduce.h).
// The message is cut into *pieces* of at most the registered capacity (a
// group copies its inputs into the registered buffers piece by piece), each
// piece into K *chunks* (K the same on every rank: RowScatterPlan). In chunk k
// of a piece, for every group j, *part* (j, l) is the k-th of K near-equal
// cuts of R(j, l) intersected with the piece (possibly empty). A chunk goes
// through two steps on group rank l of group g:
//   1. GroupFold(chunk): fold parts (j, l) for every j -- the rows every rank
//      of group rank l needs -- over the G members' registered buffers in
//      group_rank order, into the chunk's send buffer (parts consecutive in j
//      order; buffers by chunk.index % 2). CPU: ReduceFold over the
//      shared-memory buffers; GPU: the row reduce-scatter kernel with one row
//      range per group (cc/kernels/reduce_scatter.cu). G == 1: a copy.
//   2. CrossStart(chunk) / CrossFinish(chunk): a reduce-scatter among the
//      peers (the ranks of group rank l, one per group, the allreduce's cross
//      communicator ordered by group_index): part (j, l) goes to peer j, which
//      folds the P copies of its part in group_index order straight into its
//      output (CrossExchange::StartReduceScatter; through pinned host memory
//      when MPI is not CUDA-aware). No allgather: each rank sends the parts of
//      the other groups once, sum over j != g of |R(j, l)| elements in all.
// Pipelining as in the allreduce: two chunks in the cross step at a time, the
// call order RS(0) CS(0) RS(1) CS(1) | CF(0) RS(2) CS(2) | CF(1) ... across
// piece boundaries too (the cross step reads only the send buffers, never the
// registered buffers).
//
// Barriers and what ordering rests on (the primitives implement them):
//   * piece start (CPU: shm barrier "inputs in place" after the copy-in; GPU:
//     the first kernel of the piece copies in, then its start barrier): every
//     member's piece is in its registered buffer before anyone folds it;
//   * piece end (CPU: barrier "reads done" before the next piece's copy-in and
//     at the end of the call; GPU: every kernel's end barrier, and the next
//     piece's copy-in is a later kernel on the same stream): every member's
//     reads of our buffer are done before we overwrite it. The registered
//     buffers are only read by the group step (nobody writes them but the
//     copy-in), so `in` in the registered buffer is left unchanged;
//   * send/recv buffers of parity k: chunk c + 2 reuses those of chunk c only
//     after CrossFinish(c) returned (the skeleton's order), and on the GPU the
//     fold kernel of c + 2 also waits for the staging copy of c (event);
//   * MPI: every peer posts the same jobs in the same order on the cross
//     communicator's duplicates (same plan, same chunk order), also jobs with
//     nothing to send for this group rank are skipped by all its peers alike.
//
// The primitives type P provides, for the call being run:
//   Status GroupFold(const RowChunk& chunk);    // incl. the piece-start work
//   Status CrossStart(const RowChunk& chunk);
//   Status CrossFinish(const RowChunk& chunk);
//   Status Finish();                            // after the last chunk finished
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "common/checks.h"
#include "nvgroup/communicator.h"
#include "nvgroup/status.h"

namespace nvgroup {

// Which global rank has which place in the groups: rank_of[j * group_size + l]
// is the rank with group_index j and group_rank l. Collective over `comm`
// (the communicator's own), at creation.
struct RowOwners {
  int group_size = 1;
  int group_count = 1;
  std::vector<int> rank_of;

  static Status Gather(MPI_Comm comm, const Topology& topo, RowOwners* owners) {
    std::vector<int> place(2 * static_cast<size_t>(topo.size));
    int mine[2] = {topo.group_index, topo.group_rank};
    NVG_MPI_CHECK(MPI_Allgather(mine, 2, MPI_INT, place.data(), 2, MPI_INT, comm));
    owners->group_size = topo.group_size;
    owners->group_count = topo.group_count;
    owners->rank_of.assign(static_cast<size_t>(topo.size), -1);
    for (int r = 0; r < topo.size; ++r) {
      const int j = place[2 * r], l = place[2 * r + 1];
      const size_t slot = static_cast<size_t>(j) * topo.group_size + l;
      if (j < 0 || j >= topo.group_count || l < 0 || l >= topo.group_size || owners->rank_of[slot] != -1)
        return Status::Internal("inconsistent group placement: rank " + std::to_string(r) +
                                " reports group " + std::to_string(j) + ", group rank " + std::to_string(l));
      owners->rank_of[slot] = r;
    }
    return Status::Ok();
  }
};

// One chunk of the plan (see the header comment).
struct RowChunk {
  size_t index = 0;        // chunk number within the call (buffers by index % 2)
  size_t piece_begin = 0;  // first element of the piece
  size_t piece_count = 0;  // elements of the piece
  size_t k = 0;            // chunk k of K within the piece
  size_t K = 1;
  bool first_of_piece() const { return k == 0; }
};

// The pure geometry of one ReduceScatter call for one rank: pieces, chunks and
// parts. Every rank builds it from the same counts, owner table, piece size
// and capacities, so all agree on the chunk count and on every part.
class RowScatterPlan {
 public:
  // counts: per global rank. piece_elems: elements per piece (> 0).
  // send_capacity: most elements a rank's parts of one chunk may hold in all
  // (its send buffer); recv_capacity: most elements P copies of one part may
  // hold (its receive buffer). K per piece is the smallest with both bounds
  // for every (j, l): K >= S_l / (send_capacity - P) bounds the parts' sum by
  // S_l / K + P, K >= n_jl / floor(recv_capacity / P) each part.
  Status Build(const std::vector<size_t>& counts, const RowOwners& owners, int group_rank, int group_index,
               size_t piece_elems, size_t send_capacity, size_t recv_capacity) {
    const int G = owners.group_size, P = owners.group_count;
    peers_ = P;
    me_ = group_index;
    if (static_cast<int>(counts.size()) != G * P || owners.rank_of.size() != counts.size())
      return Status::Internal("reducescatter plan: " + std::to_string(counts.size()) + " counts for " +
                              std::to_string(owners.rank_of.size()) + " placed ranks");
    if (send_capacity <= static_cast<size_t>(P) || recv_capacity < static_cast<size_t>(P) || piece_elems == 0)
      return Status::InvalidArgument("reducescatter over " + std::to_string(P) +
                                     " groups: the cross-step buffers (" + std::to_string(send_capacity) +
                                     " elements) are too small for one element per group; raise "
                                     "NVGROUP_PIPELINE_CHUNK");
    begin_.resize(counts.size());
    size_t total = 0;
    for (size_t r = 0; r < counts.size(); ++r) {
      begin_[r] = total;
      total += counts[r];
    }
    counts_ = &counts;
    owners_ = &owners;
    group_rank_ = group_rank;
    total_ = total;
    piece_ = piece_elems;
    const size_t per_part = recv_capacity / P, send_room = send_capacity - P;
    piece_chunks_.clear();
    piece_first_.clear();
    chunks_ = 0;
    for (size_t p0 = 0; p0 < total; p0 += piece_elems) {
      const size_t p1 = std::min(total, p0 + piece_elems);
      size_t K = 1;
      for (int l = 0; l < G; ++l) {
        size_t sum = 0;
        for (int j = 0; j < P; ++j) {
          const size_t n = Clip(RankOf(j, l), p0, p1, nullptr);
          sum += n;
          K = std::max(K, (n + per_part - 1) / per_part);
        }
        K = std::max(K, (sum + send_room - 1) / send_room);
      }
      piece_first_.push_back(chunks_);
      piece_chunks_.push_back(K);
      chunks_ += K;
    }
    return Status::Ok();
  }

  size_t num_chunks() const { return chunks_; }
  int peers() const { return peers_; }
  int me() const { return me_; }
  // This rank's first element of the message (its rows start there).
  size_t my_offset() const { return begin_[RankOf(me_, group_rank_)]; }

  // Chunk c (c < num_chunks()).
  RowChunk Chunk(size_t c) const {
    size_t p = std::upper_bound(piece_first_.begin(), piece_first_.end(), c) - piece_first_.begin() - 1;
    RowChunk ch;
    ch.index = c;
    ch.piece_begin = p * piece_;
    ch.piece_count = std::min(piece_, total_ - ch.piece_begin);
    ch.k = c - piece_first_[p];
    ch.K = piece_chunks_[p];
    return ch;
  }

  // Part (j, group_rank) of `ch`: elements [PartBegin, PartBegin + PartCount) of the message.
  size_t PartBegin(const RowChunk& ch, int j) const {
    size_t a = 0;
    const size_t n = Clip(RankOf(j, group_rank_), ch.piece_begin, ch.piece_begin + ch.piece_count, &a);
    return a + n * ch.k / ch.K;
  }
  size_t PartCount(const RowChunk& ch, int j) const {
    const size_t n = Clip(RankOf(j, group_rank_), ch.piece_begin, ch.piece_begin + ch.piece_count, nullptr);
    return n * (ch.k + 1) / ch.K - n * ch.k / ch.K;
  }
  // All of this rank's parts of `ch` (its send buffer's elements).
  size_t SendCount(const RowChunk& ch) const {
    size_t s = 0;
    for (int j = 0; j < peers_; ++j) s += PartCount(ch, j);
    return s;
  }
  // PartCount(ch, j) for every peer j (the cross step's part counts).
  void PartCounts(const RowChunk& ch, std::vector<size_t>* parts) const {
    parts->resize(peers_);
    for (int j = 0; j < peers_; ++j) (*parts)[j] = PartCount(ch, j);
  }
  // Where our own part of `ch` (PartCount(ch, me())) lands in this rank's
  // output, elements.
  size_t MyPartOffset(const RowChunk& ch) const { return PartBegin(ch, me_) - my_offset(); }

 private:
  int RankOf(int j, int l) const {
    return owners_->rank_of[static_cast<size_t>(j) * owners_->group_size + l];
  }
  // Elements of rank r's rows inside [p0, p1); *first = where they start.
  size_t Clip(int r, size_t p0, size_t p1, size_t* first) const {
    const size_t a = std::max(begin_[r], p0), b = std::min(begin_[r] + (*counts_)[r], p1);
    if (first != nullptr) *first = a;
    return b > a ? b - a : 0;
  }

  const std::vector<size_t>* counts_ = nullptr;  // the call's, outlive the plan's use
  const RowOwners* owners_ = nullptr;
  std::vector<size_t> begin_;  // first element of each global rank's rows
  std::vector<size_t> piece_chunks_, piece_first_;  // K and first chunk of each piece
  size_t chunks_ = 0, total_ = 0, piece_ = 1;
  int peers_ = 1, me_ = 0, group_rank_ = 0;
};

template <class Primitives>
Status RunHierarchicalReduceScatter(Primitives& prims, const RowScatterPlan& plan) {
  const size_t num_chunks = plan.num_chunks();
  constexpr size_t kInFlight = 2;  // chunks in the cross step at a time (double buffering)
  auto issue = [&](size_t c) -> Status {
    const RowChunk ch = plan.Chunk(c);
    NVG_RETURN_IF_ERROR_CTX(prims.GroupFold(ch), "group fold of reducescatter chunk " + std::to_string(c));
    NVG_RETURN_IF_ERROR_CTX(prims.CrossStart(ch),
                            "starting the cross-group reduce-scatter of chunk " + std::to_string(c));
    return Status::Ok();
  };
  // A chunk started is always finished (its buffers stay in use until then),
  // also when a later step fails: the first error is returned after that.
  Status first;
  size_t started = 0;
  for (; started < std::min(kInFlight, num_chunks) && first.ok(); ++started) first = issue(started);
  if (!first.ok()) --started;  // the failed chunk queued nothing
  for (size_t c = 0; c < started; ++c) {
    Status s = prims.CrossFinish(plan.Chunk(c));
    if (!s.ok()) s = s.WithContext("cross-group reduce-scatter of chunk " + std::to_string(c));
    if (first.ok()) first = s;
    if (first.ok() && started < num_chunks) {
      first = issue(started);
      if (first.ok()) ++started;
    }
  }
  if (!first.ok()) return first;
  return prims.Finish();
}

}  // namespace nvgroup
