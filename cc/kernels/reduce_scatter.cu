// Row reduce-scatter: the NV-group reduce-scatter phase with the caller's row
// split (Horovod's: rank r gets its rows, consecutive in rank order, counts
// uneven), used by CudaCommunicator::ReduceScatter when all ranks form one
// NV-group. Each GPU reduces exactly its own elements, loading every member's
// registered buffer over CUDA IPC, and writes them straight into the caller's
// output; nothing is allocated per call. Over several NV-groups the same
// kernel is the group step of the hierarchical reduce-scatter
// (cc/algorithms/hierarchical_reduce_scatter.h): group rank l folds one range
// per group j (the rows of rank (j, l) in the chunk) into its send buffer.
//
// One launch per piece of the message (a piece fits the registered buffer;
// element 0 of a piece lies 16-byte aligned at the start of every member's
// registered data); several groups: several per piece, one per chunk and
// batch of kMaxRowRanges groups, the first one copying in. Grid, piece size
// and launch sequence are the same on every member; only the ranges [lo, hi)
// differ, and no two members' ranges overlap. Stages of a launch on rank r:
//   copy-in (when the input is not already in the registered buffer): global
//     thread t copies units t, t + step, t + 2 step, ... (16-byte units of the
//     piece; step = threads in the grid) of its input into its own registered
//     data;
//   start barrier (GroupBarrier, Note [Barrier protocol] in p2p_allreduce.cuh);
//   fold, for each range [lo, hi) in turn: global thread t folds the units
//     u = t, t + step, ... that intersect [lo, hi): element i of the unit over members 0..G-1 in group_rank order
//     (FoldUnit, the accumulation type, rounded once; the same order as the
//     CPU path's ReduceFold and the allreduce kernels, so every element gets
//     the allreduce's bits), stored to the range's out[i - lo] (local memory);
//   end barrier.
// Memory ordering, and what each step rests on:
//   * the fold of unit u on rank r reads member p's unit u only after the start
//     barrier of its block b; the unit was copied in by member p's thread with
//     the same global index t, i.e. by block b of member p before its arrival.
//     Note [Barrier protocol]: p's __syncthreads + st.release.sys of the flag,
//     r's ld.acquire.sys of it + __syncthreads make every write of p's block b
//     before the arrival visible to r's block b after the wait (the release is
//     cumulative over the writes bar.sync ordered before it). When the input
//     already lay in the registered buffer it was written by earlier work on
//     p's stream, complete before p's kernel started and so before its
//     arrival (the rule the two-shot pull path rests on as well).
//   * a later launch of the same piece (no copy-in) reads what the first one
//     copied in: every block b of r passed the first launch's end barrier only
//     after member p's block b arrived there, after its copy-in (acquire of
//     that release), and r's later launch follows on r's stream, so the
//     copy-in happens before its loads (causality is transitive).
//   * the end barrier orders every member's loads of r's registered data (the
//     fold) before r's next stores into it: r's later writes (the next piece's
//     copy-in, the next call, the engine's fusion copy) are in later kernels on
//     r's stream, which start only after every block of this kernel passed the
//     end barrier, i.e. after every block of every member arrived there, which
//     each does after its fold (program order + __syncthreads before the
//     release). The loads use ld.global.cg (L2, never a stale L1 line) for
//     whole units; the scalar head/tail loads come after the acquire of the
//     same thread's block, as in the one-shot kernel's tail.
//   * the previous communicator call: every call that reads or writes peers'
//     registered data ends in a barrier of the members (kernel end barrier, or
//     an MPI barrier after the stream drained), so its accesses are done before
//     this kernel's copy-in writes r's registered data.
//   * out is this rank's own memory and read by no other member.
// Dead peers: spins give up on abort or past the call's deadline exactly as in
// Note [Dead peers] (p2p_allreduce.cuh); the host then fails the call.
// Residency: every block must be resident at once on every member (with the
// other members' grids in the one-GPU group mode); the communicator caps the
// grid at ResidentRowScatterBlocks / members per GPU, the launcher rejects more
// than this kernel's occupancy allows.
#include "kernels/reduce_scatter.h"

#include <algorithm>
#include <mutex>
#include <string>

#include "common/cuda_checks.h"
#include "kernels/p2p_allreduce.cuh"

namespace nvgroup {
namespace kernels {

template <typename T, int G>
__global__ void __launch_bounds__(kThreadsPerBlock, kTwoShotMinBlocksPerSm)
    RowReduceScatterKernel(RowScatterLaunch l) {
  using A = typename AccumulatorOf<T>::type;
  constexpr int kE = Unit<T>::kElems;
  const P2pLaunch& a = l.base;
  __shared__ int failed;
  const BlockState bs = StartBlock<G>(a, &failed);
  const T* src[G];
#pragma unroll
  for (int p = 0; p < G; ++p) src[p] = reinterpret_cast<const T*>(a.peers.data[p]);
  T* own = reinterpret_cast<T*>(a.peers.data[a.group_rank]);
  const size_t units = (a.count + kE - 1) / kE;
  const size_t first = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x;

  if (a.in != nullptr) {
    const T* in = static_cast<const T*>(a.in);
    const bool in_vec = Aligned16(in);
    for (size_t u = first; u < units; u += step) {
      const size_t e = u * kE;
      CopyUnit<T>(in + e, own + e, static_cast<int>(MinSize(kE, a.count - e)), in_vec);
    }
  }
  // orders: every member's piece is in its registered data
  if (!GroupBarrier<G>(a, bs)) return;

  for (int r = 0; r < l.num_ranges; ++r) {
    T* out = static_cast<T*>(l.ranges[r].out);
    const size_t lo = l.ranges[r].lo, hi = MinSize(l.ranges[r].hi, a.count);
    if (lo >= hi) continue;
    // The first unit >= lo / kE that this thread owns (u congruent to first mod step).
    const size_t u_lo = lo / kE, u_hi = (hi + kE - 1) / kE;
    size_t u = u_lo - u_lo % step + first;
    if (u < u_lo) u += step;
    for (; u < u_hi; u += step) {
      const size_t e0 = u * kE;
      const size_t b = e0 < lo ? lo : e0;
      const size_t e = MinSize(e0 + kE, hi);
      A acc[kE];
      if (b == e0 && e == e0 + kE) {
        uint4 raw[G];
#pragma unroll
        for (int p = 0; p < G; ++p) raw[p] = LoadUnit(src[p] + e0);
        FoldUnit<T, G>(RegisterUnits<T>{raw}, kE, a.op, a.divisor, acc);
        StoreUnit<T>(out + (e0 - lo), kE, Aligned16(out + (e0 - lo)), acc);
      } else {
        const int n = static_cast<int>(e - b);
        FoldUnit<T, G>([&](int q, int k) { return src[q][b + k]; }, n, a.op, a.divisor, acc);
        StoreUnit<T>(out + (b - lo), n, false, acc);
      }
    }
  }
  // orders: every member finished loading this rank's registered data before
  // this rank's next kernel writes it
  GroupBarrier<G>(a, bs);
}

}  // namespace kernels

namespace {

using RowKernel = void (*)(RowScatterLaunch);

template <typename T>
RowKernel ForGroupSize(int g) {
  switch (g) {
    case 2: return kernels::RowReduceScatterKernel<T, 2>;
    case 3: return kernels::RowReduceScatterKernel<T, 3>;
    case 4: return kernels::RowReduceScatterKernel<T, 4>;
    case 5: return kernels::RowReduceScatterKernel<T, 5>;
    case 6: return kernels::RowReduceScatterKernel<T, 6>;
    case 7: return kernels::RowReduceScatterKernel<T, 7>;
    case 8: return kernels::RowReduceScatterKernel<T, 8>;
    default: return nullptr;
  }
}

RowKernel KernelFor(DataType dtype, int g) {
  switch (dtype) {
    case DataType::kUint8: return ForGroupSize<uint8_t>(g);
    case DataType::kInt8: return ForGroupSize<int8_t>(g);
    case DataType::kUint16: return ForGroupSize<uint16_t>(g);
    case DataType::kInt16: return ForGroupSize<int16_t>(g);
    case DataType::kFloat16: return ForGroupSize<__half>(g);
    case DataType::kBFloat16: return ForGroupSize<__nv_bfloat16>(g);
    case DataType::kFloat32: return ForGroupSize<float>(g);
    case DataType::kFloat64: return ForGroupSize<double>(g);
    case DataType::kInt32: return ForGroupSize<int32_t>(g);
    case DataType::kInt64: return ForGroupSize<int64_t>(g);
    default: return nullptr;
  }
}

constexpr DataType kRowDtypes[] = {DataType::kUint8,   DataType::kInt8,    DataType::kUint16,
                                   DataType::kInt16,   DataType::kFloat16, DataType::kBFloat16,
                                   DataType::kFloat32, DataType::kFloat64, DataType::kInt32,
                                   DataType::kInt64};

StatusOr<int> ResidentCap(int device, int g) {
  static std::mutex mu;
  static int cached[64][kMaxGroupSize + 1] = {};
  if (device < 0 || device >= 64) return Status::InvalidArgument("device ordinal out of range");
  if (g < 2 || g > kMaxGroupSize)
    return Status::InvalidArgument("group size " + std::to_string(g) + " outside 2.." +
                                   std::to_string(kMaxGroupSize));
  std::lock_guard<std::mutex> lock(mu);
  if (cached[device][g] > 0) return cached[device][g];
  int sms = 0;
  NVG_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  int per_sm = 1 << 20;
  for (DataType d : kRowDtypes) {
    int n = 0;
    NVG_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, KernelFor(d, g), kThreadsPerBlock, 0));
    per_sm = std::min(per_sm, n);
  }
  if (per_sm < 1)
    return Status::Internal("the row reduce-scatter kernel for group size " + std::to_string(g) +
                            " cannot be resident on cuda:" + std::to_string(device));
  cached[device][g] = std::min(kMaxBlocks, per_sm * sms);
  return cached[device][g];
}

}  // namespace

StatusOr<int> ResidentRowScatterBlocks(int device, int group_size) { return ResidentCap(device, group_size); }

Status LaunchRowReduceScatter(const RowScatterLaunch& l, cudaStream_t stream) {
  const P2pLaunch& a = l.base;
  if (a.count == 0) return Status::Ok();
  if (a.group_size < 2 || a.group_size > kMaxGroupSize)
    return Status::InvalidArgument("row reduce-scatter: group size " + std::to_string(a.group_size) +
                                   " outside 2.." + std::to_string(kMaxGroupSize));
  if (l.num_ranges < 0 || l.num_ranges > kMaxRowRanges)
    return Status::InvalidArgument("row reduce-scatter: " + std::to_string(l.num_ranges) +
                                   " ranges (at most " + std::to_string(kMaxRowRanges) + ")");
  for (int r = 0; r < l.num_ranges; ++r) {
    const RowRange& g = l.ranges[r];
    if (g.lo > g.hi || g.hi > a.count || (g.lo < g.hi && g.out == nullptr))
      return Status::InvalidArgument("row reduce-scatter: range [" + std::to_string(g.lo) + ", " +
                                     std::to_string(g.hi) + ") of a piece of " + std::to_string(a.count) +
                                     " elements, or no output");
  }
  RowKernel kernel = KernelFor(a.dtype, a.group_size);
  if (kernel == nullptr)
    return Status::Unimplemented(std::string("row reduce-scatter: no kernel for dtype ") +
                                 DataTypeName(a.dtype));
  int device = 0;
  NVG_CUDA_CHECK(cudaGetDevice(&device));
  auto cap = ResidentCap(device, a.group_size);
  if (!cap.ok()) return cap.status();
  // Every block must be resident at once (a block spinning on a barrier whose
  // partner block is not scheduled would wait forever).
  if (a.blocks < 1 || a.blocks > cap.value())
    return Status::InvalidArgument("row reduce-scatter: block count " + std::to_string(a.blocks) +
                                   " outside 1.." + std::to_string(cap.value()) +
                                   " (the blocks that can be resident on cuda:" + std::to_string(device) +
                                   ")");
  kernel<<<a.blocks, kThreadsPerBlock, 0, stream>>>(l);
  NVG_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace nvgroup
