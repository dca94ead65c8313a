// OrderedAllreduce: an MPI allreduce whose reduction order is fixed (rank order
// of `comm`) and independent of where an element sits in the buffer. It is the
// flat path of the CPU communicator (over all ranks) and the cross-group step
// of HostPrimitives (over the peers, ordered by group_index).
//
// How it works. The message is cut into *pieces* of at most `piece_bytes`, and
// each piece into n slices (ChunkSlices, so slices stay 16-byte aligned). Per
// piece: MPI_Alltoallv sends slice r of every rank to rank r; rank r folds the n
// copies in rank order 0..n-1 (ReduceFold, cc/cpu/host_reduce.h) straight into
// its slice of `out`; MPI_Allgatherv (in place) shares the slices. MPI's own
// reduction order is never used for data. Each collective is blocking, so it
// also orders the buffer reuse: Alltoallv returns only after our part of `in`
// was sent, so writing `out` (which may equal `in`) afterwards is safe.
// Traffic per rank: 2 (n-1)/n of the piece, like a ring allreduce.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <vector>

#include "nvgroup/status.h"
#include "nvgroup/types.h"

namespace nvgroup {

// `average_divisor`: see ReduceFold (the number of ranks of the whole
// communicator when this fold produces the final Average, else 1).
// `scratch` grows to about piece_bytes and is reused across calls.
Status OrderedAllreduce(MPI_Comm comm, const void* in, void* out, size_t count, DataType dtype,
                        ReduceOp op, int average_divisor, size_t piece_bytes,
                        std::vector<char>* scratch);

}  // namespace nvgroup
