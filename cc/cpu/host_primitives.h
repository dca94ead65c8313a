// HostPrimitives: the CPU implementation of the primitives the hierarchical
// allreduce skeleton (cc/algorithms/hierarchical_allreduce.h) calls, over the
// group's shared-memory registered buffers (cc/transport/shm_group.h) and MPI.
//
// How it works (the CPU analogue of the NV-group kernels). Before the skeleton
// runs, every member's input lies at the start of its registered buffer and the
// caller has passed a group barrier; after it, the caller passes another one
// before any registered buffer is written again (see CpuCommunicator).
//  * GroupReduceScatter(chunk): group rank r folds slice r of the chunk over
//    all members' buffers, read directly from shared memory in group_rank
//    order, and writes the result over slice r of its own buffer. No one else
//    reads or writes that slice before the allgather barrier, and the other
//    slices r reads belong to members who only overwrite their own slice, so
//    no barrier is needed inside the chunk.
//  * CrossStart(chunk) / CrossFinish(chunk): slice r is allreduced in place
//    with the peers by the communicator's CrossExchange (reduce-scatter +
//    allgather, folded in group_index order, progressed off this thread; see
//    cc/algorithms/cross_exchange.h), its scratch double-buffered by chunk
//    parity. Only slice r of our own buffer is touched, which no member reads
//    before the allgather barrier, so the next chunk's GroupReduceScatter runs
//    meanwhile. With a single group there is nothing to do.
//  * GroupAllgather(chunk, out): barrier (orders every member's final slice of
//    the chunk before the reads, and every member's reads of the chunk's inputs
//    in GroupReduceScatter before `out`, which may be the registered buffer, is
//    written), then copy all slices of the chunk into `out`.
//  * GroupAllreduce(count, out) (one group, not forced): the reduce-scatter of
//    the whole message, a barrier (final slices before reads), the allgather.
//  * GroupAllreduceMembers(members, ...) (FusedAllreduce with one group of
//    G > 1 members, the auto algorithm): the same fold, barrier and gather over
//    a fused bucket whose members' inputs and outputs are the message, with the
//    copy-in and the barriers around it (Note [Fused bucket on one group]
//    below). GroupAllreduce is this mode with one member: the message in our
//    registered buffer, `out` its output.
//
// Note [Fused bucket on one group]
// The reference of a fused bucket (every member copied into the registered
// buffer, GroupAllreduce in place, every member copied out) moves each byte
// through memory four times. Members' buffers are read by the group only for
// the slices other members own, and the gathered result is needed only in the
// outputs, so GroupAllreduceMembers does:
//   copy in   the parts of each member that lie outside our own slice (all of
//             it when prescale != 1), scaled, to its offset in our buffer;
//   barrier "allreduce: inputs in place"   -- every member's copy-in before
//             the reads;
//   reduce    our slice, member by member, folding the G sources in
//             group_rank order (ours read straight from the input when
//             prescale == 1: the bits the copy would have held) into our
//             buffer, the only slice of it anyone writes;
//   barrier "group allreduce: slices reduced"   -- every member's slice
//             before the gathers;
//   copy out  every member's result from the owning member's buffer straight
//             into its output, postscaled;
//   barrier "allreduce: reads done"   -- every member's reads of our buffer
//             before the next call writes it.
// The fold and both scalings are the reference's operations on the same bits
// (ReduceFold, ScaledCopy), so outputs are bitwise the reference's. An output
// equal to its input is written only after the reduce read it (same thread).
// Average divides in the fold that produces the final value: the group fold
// when there is one group, else the fold over groups.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <vector>

#include "algorithms/cross_exchange.h"
#include "algorithms/hierarchical_allreduce.h"
#include "algorithms/hierarchical_reduce_scatter.h"
#include "nvgroup/communicator.h"
#include "nvgroup/status.h"
#include "nvgroup/types.h"
#include "transport/shm_group.h"

namespace nvgroup {

class HostPrimitives {
 public:
  // One per Allreduce piece. `cross` (null with one group) and the two
  // scratch buffers `cross_scratch[0..1]` belong to the communicator.
  HostPrimitives(const Topology& topo, ShmGroup* shm, CrossExchange* cross, DataType dtype, ReduceOp op,
                 std::vector<char>* cross_scratch);

  const Topology& topology() const { return topo_; }
  size_t element_size() const { return esize_; }

  Status GroupAllreduce(size_t count, void* out);
  // `count` elements: the members' extent (their offsets are bytes into our
  // registered buffer). `observer` marks the copy-in, reduce and copy-out.
  Status GroupAllreduceMembers(const Communicator::FusedMember* members, size_t num_members, size_t count,
                               double prescale, double postscale,
                               const Communicator::PhaseObserver& observer);
  Status GroupReduceScatter(const ChunkSlices& chunk);
  Status CrossStart(const ChunkSlices& chunk);
  Status CrossFinish(const ChunkSlices& chunk);
  Status GroupAllgather(const ChunkSlices& chunk, void* out);

 private:
  // Folds slice `me` of `chunk` over the members into our own buffer.
  Status ReduceOwnSlice(const ChunkSlices& chunk, int average_divisor);
  // The group allreduce of `whole` (one chunk of the whole message) over
  // members: our slice folded (our own source read from the members' inputs
  // when `own_from_inputs`, else from our buffer), the barrier "group
  // allreduce: slices reduced", every slice copied into the members'
  // outputs, postscaled. Ends the observer's reduce and starts its copy-out.
  Status ReduceAndGatherMembers(const ChunkSlices& whole, const Communicator::FusedMember* members,
                                size_t num_members, bool own_from_inputs, double postscale,
                                const Communicator::PhaseObserver& observer);
  // Copies every member's slice of `chunk` into `out` (same element offsets).
  void GatherSlices(const ChunkSlices& chunk, void* out) const;

  const Topology& topo_;
  ShmGroup* shm_;
  CrossExchange* cross_;
  DataType dtype_;
  ReduceOp op_;
  size_t esize_;
  std::vector<char>* cross_scratch_;  // [2], by chunk parity
  int final_divisor_;  // divisor of the fold that produces the final value
  CrossJobs jobs_;
};

// The CPU primitives of the hierarchical reduce-scatter
// (cc/algorithms/hierarchical_reduce_scatter.h), one per ReduceScatter call:
//  * GroupFold(chunk): at a piece's first chunk, when G > 1: barrier "reads
//    done" (not before the first piece: the previous call ended with one),
//    our piece of `in` copied to the start of our registered buffer (unless
//    `in` is that buffer), barrier "inputs in place". Then our parts (j, l) of
//    the chunk, j in group_index order, folded over the members' buffers in
//    group_rank order (ReduceFold, no division) into send[index % 2]. Nobody
//    writes a registered buffer but its owner's copy-in, so no barrier is
//    needed between chunks. G == 1: the parts are copied from `in`.
//  * CrossStart(chunk): CrossExchange::StartReduceScatter of send[k] into
//    recv[k]; the fold over groups (ReduceFold, divisor size for Average)
//    writes our part straight into `out`. Skipped when the chunk has nothing
//    for our group rank (the same on every peer).
//  * CrossFinish(chunk): waits for the job.
//  * Finish(): G > 1: barrier "reads done" (our buffer's readers are done
//    before the next call writes it).
// The communicator's buffers of the hierarchical reduce-scatter, kept between
// calls (they only grow): send/receive buffers and part counts by chunk
// parity, one source pointer per member.
struct HostScatterBuffers {
  std::vector<char> send[2];
  std::vector<char> recv[2];
  std::vector<size_t> parts[2];
  std::vector<const void*> sources;
};

class HostScatterPrimitives {
 public:
  HostScatterPrimitives(const Topology& topo, ShmGroup* shm, CrossExchange* cross, const RowScatterPlan& plan,
                        const void* in, bool in_registered, void* out, DataType dtype, ReduceOp op,
                        HostScatterBuffers* buffers);

  Status GroupFold(const RowChunk& chunk);
  Status CrossStart(const RowChunk& chunk);
  Status CrossFinish(const RowChunk& chunk);
  Status Finish();

 private:
  const Topology& topo_;
  ShmGroup* shm_;
  CrossExchange* cross_;
  const RowScatterPlan& plan_;
  const char* in_;
  bool in_registered_;
  char* out_;
  DataType dtype_;
  ReduceOp op_;
  size_t esize_;
  HostScatterBuffers* buf_;
  CrossJobs jobs_;
};

}  // namespace nvgroup
