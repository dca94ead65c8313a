#include "cpu/ordered_allreduce.h"

#include <algorithm>

#include "algorithms/hierarchical_allreduce.h"
#include "common/checks.h"
#include "cpu/host_reduce.h"

namespace nvgroup {

Status OrderedAllreduce(MPI_Comm comm, const void* in, void* out, size_t count, DataType dtype,
                        ReduceOp op, int average_divisor, size_t piece_bytes,
                        std::vector<char>* scratch) {
  int n = 1, me = 0;
  NVG_MPI_CHECK(MPI_Comm_size(comm, &n));
  NVG_MPI_CHECK(MPI_Comm_rank(comm, &me));
  const size_t esize = DataTypeSize(dtype);
  // MPI counts are int: pieces of at most 1 GiB keep every count and displacement in range.
  piece_bytes = std::min(piece_bytes, size_t{1} << 30);
  // Whole units per slice, as the skeleton's chunks.
  const size_t unit = AlignUnitElements(esize) * n;
  const size_t piece_elems = PieceElements(piece_bytes, esize, unit);
  // n received copies of our slice: at most n * (piece/n rounded up to a unit).
  scratch->resize((piece_elems + unit) * esize);
  std::vector<int> send_counts(n), send_displs(n), recv_counts(n), recv_displs(n);
  std::vector<const void*> sources(n);

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
      sources[k] = scratch->data() + k * mine;
    }
    const char* piece_in = static_cast<const char*>(in) + offset * esize;
    char* piece_out = static_cast<char*>(out) + offset * esize;
    NVG_MPI_CHECK(MPI_Alltoallv(piece_in, send_counts.data(), send_displs.data(), MPI_BYTE,
                                scratch->data(), recv_counts.data(), recv_displs.data(), MPI_BYTE,
                                comm));
    if (mine > 0)
      NVG_RETURN_IF_ERROR(ReduceFold(dtype, op, sources.data(), n,
                                     piece_out + piece.SliceOffset(me) * esize, mine / esize,
                                     average_divisor));
    NVG_MPI_CHECK(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, piece_out, send_counts.data(),
                                 send_displs.data(), MPI_BYTE, comm));
  }
  return Status::Ok();
}

}  // namespace nvgroup
