// NV-group allreduce kernels: every GPU of a group loads its peers' registered
// buffers directly (CUDA IPC mappings, over NVLink between GPUs) and reduces in
// a fixed order. Two kernels: OneShotKernel (small messages) and TwoShotKernel
// (large messages and the hierarchy's group steps: one chunked implementation;
// un-pipelined is one chunk).
//
// Memory. Each member owns one cudaMalloc'd IPC allocation
// (cc/device/ipc_cuda.cc): | BarrierFlags | data | staging half 0 | half 1 |.
// Every member maps every other member's allocation, so a kernel on rank r
// holds plain device pointers (GroupPeers) to all G copies and dereferences
// them. Loads of registered memory use ld.global.cg (L2 only: an L1 line could
// be stale, peers change the memory).
//
// Note [Barrier protocol]. A barrier is per block: block b of every member
// meets block b of every other member (all ranks launch identical grids for a
// call, and every block of a grid is resident at once: the launcher caps the
// grid at the kernels' occupancy, p2p_allreduce.cu). Thread p < G of block b
// on rank r:
//   * increments its private counter[b][p] (in r's own BarrierFlags) to v;
//   * stores v into member p's arrived[v & 1][b][r] with st.release.sys;
//   * spins with ld.acquire.sys until its own arrived[v & 1][b][p] == v.
// What correctness rests on: the block's writes before the barrier precede
// thread p's release through the __syncthreads before it (bar.sync orders
// the block's memory operations for its threads, and a release is cumulative:
// it publishes every write that the releasing thread has observed, including
// those of other threads of the block ordered before it by bar.sync -- PTX
// memory model, release patterns / causality order). After the acquire of
// thread p, a __syncthreads extends member p's published writes to the whole
// block. So a value written by any thread of block b on member p before its
// arrival is visible to every thread of block b here after the wait. Every
// phase keeps the stricter rule anyway: a thread reads only the units that
// the same-numbered thread wrote on the other side (thread mapping below).
// Two parities: member p may already be at barrier v + 1 and write
// arrived[(v + 1) & 1] while this rank still waits for v; it cannot reach
// v + 2 before this rank arrived at v + 1. Counters live in device memory,
// start at 0 and are never reset, so graph capture and replay need nothing
// from the host. The end barrier also uses release/acquire: it orders the
// peers' *loads* of this rank's memory before this rank's later stores.
//
// Note [One-shot staging epoch]. One-shot: copy-in (own input -> own staging
// half), barrier, every rank folds unit u of all G staging halves in
// group_rank order into out[u]. No end barrier: the half alternates between
// consecutive one-shot calls, so a member writes a half again two calls later,
// after it passed the barrier of the call in between, which every peer reaches
// only after its kernel of this call has completed (stream order). The half is
// chosen on the device: every block reads the epoch word in its own
// BarrierFlags at kernel start (half = epoch & 1) and the last block to finish
// (an atomic count of finished blocks) advances it, so every block of a launch
// uses one half and the next launch the other one, whether the launches come
// from eager calls or from replays of a captured CUDA graph, in any mix. All
// ranks run the same sequence of one-shot calls, so their epochs agree.
//
// Two-shot. The region is cut into G *slices* (slice p owned by group rank p;
// the slice stride is a multiple of one 16-byte *unit*, so every full unit is
// aligned); the last unit of the last slice may be partial (scalar tail).
// Stages per chunk of units (phases of P2pLaunch):
//   push (kPhasePushScatter, input not in the registered buffer): rank r
//     stores slice p of its input into member p's *slot* r (at r * stride in
//     p's data), p != r;
//   fold (kPhaseReduceScatter): rank r folds unit u of slice r in group_rank
//     order -- push: from its own slots and its own input (local loads); pull:
//     from every member's data (the input already lies in the registered
//     buffers) -- and stores the result to slice r of its data, of out (full
//     allreduce) and, in place on the registered data (kPhasePushResult, pull
//     only), of every member's data (the units it has just loaded, read by no
//     one else);
//   gather (kPhaseAllgather): rank r copies slice p from member p's data into
//     out, p != r.
// Note [Two-shot schedule]. A start barrier (push: every member
// has entered the call, so its registered data is free -- the engine copies
// results out of it between calls; pull: every member's data is complete),
// then steps k = 0 .. last: wait for the barrier arrived at in step k - 1;
// fold chunk k - o_fold; gather chunk k - o_gather; arrive; push chunk k.
// o_fold = 2 with push (chunk c is pushed after the arrival of step c, so
// it is released by the arrival of step c + 1 and folded in step c + 2),
// else 0; o_gather = o_fold + 1. The last arrival, after the last gather, is
// the end barrier: every member finished reading this rank's slots and data
// before the next call writes them. Why pipelining is race-free: every chunk
// has its own slots and result units, so work of different chunks in one step
// never touches the same memory; a member is at most one barrier ahead (it
// arrives at k + 1 only after waiting for k), and push(c) / fold(c - 1) /
// gather(c - 2) of neighbouring steps touch distinct chunks. The fold writes
// slot r's place (own slice), which no peer pushes into. Un-pipelined =
// one chunk: push, fold, gather with a barrier between stages.
// The hierarchy (cc/algorithms/hierarchical_allreduce.h) runs {fold} per
// chunk, the fold over groups, then {gather}.
// Thread mapping: global thread t handles units t, t + step, t + 2 step, ...
// (step = threads in the grid) of every slice in every stage; chunks start at
// multiples of step, so the thread that reads a unit on one GPU has the same
// index as the thread that wrote it on the other. Full aligned units go in
// batches of TwoShotBatch<G>() units per thread (all loads first, then the
// stores), covering the same units t, t + step, ...
//
// Note [Dead peers]. Spin loops poll the host-mapped abort word and the
// %globaltimer every kPollsPerCheck polls. The deadline covers the whole call:
// the first kernel of a call sets it (start + timeout_ns, kept in the own
// BarrierFlags for the call's later kernels). On abort or past the deadline
// the spinning thread records the failure (kind, member, block) in the mapped
// DeviceControl and its block returns; other blocks give up the same way, so
// the kernel ends and the stream moves on. Results of that call are garbage
// and the members' counters are out of step: the host fails that and every
// later call (CudaCommunicator::CheckHealthy), naming the member, and does not
// free its own region while a peer kernel may still write flags into it.
//
// Determinism: element i is always folded members 0..G-1 in order, in the
// accumulation type (fp32 for fp16/bf16, the type itself otherwise), and
// rounded once when written, whichever rank computes it, so all ranks get the
// same bits (and the same as cc/cpu/host_reduce.h for the same inputs).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/kernels.h"

namespace nvgroup {
namespace kernels {

// ---------------------------------------------------------------- arithmetic

template <typename T>
struct AccumulatorOf {
  using type = T;
};
template <>
struct AccumulatorOf<__half> {
  using type = float;
};
template <>
struct AccumulatorOf<__nv_bfloat16> {
  using type = float;
};

template <typename T>
__device__ __forceinline__ typename AccumulatorOf<T>::type Widen(T x) {
  return x;
}
template <>
__device__ __forceinline__ float Widen<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float Widen<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T Narrow(typename AccumulatorOf<T>::type x) {
  return x;
}
template <>
__device__ __forceinline__ __half Narrow<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 Narrow<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// a (op) b. Integers wrap (two's complement) instead of overflowing into UB:
// + and * in an unsigned type at least as wide as `unsigned` (8/16-bit types
// would otherwise promote to a signed int, whose product can overflow), then
// narrowed -- cc/cpu/host_reduce.cc's WrapType. Min/Max: `b < a ? b : a`,
// like the CPU path.
template <typename A, bool kIntegral = std::is_integral_v<A>>
struct WrapOf {
  using type = A;
};
template <typename A>
struct WrapOf<A, true> {
  using type = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, std::make_unsigned_t<A>>;
};

template <typename A>
__device__ __forceinline__ A Apply(ReduceOp op, A a, A b) {
  using U = typename WrapOf<A>::type;
  switch (op) {
    case ReduceOp::kMin: return b < a ? b : a;
    case ReduceOp::kMax: return a < b ? b : a;
    case ReduceOp::kProduct: return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
    default: return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));  // Sum, Average
  }
}

// The final write of an Average divides by the number of ranks (integers
// truncate toward zero, as C++ division does; in int64 like the CPU path, since
// an 8-bit type cannot hold every divisor).
template <typename A>
__device__ __forceinline__ A Finish(ReduceOp op, int divisor, A x) {
  if (op != ReduceOp::kAverage || divisor <= 1) return x;
  if constexpr (std::is_integral_v<A>) return static_cast<A>(static_cast<int64_t>(x) / divisor);
  else return x / static_cast<A>(divisor);
}

// ---------------------------------------------------------------- 16-byte units

template <typename T>
struct Unit {
  static constexpr int kElems = 16 / sizeof(T);
};

__device__ __forceinline__ size_t MinSize(size_t a, size_t b) { return a < b ? a : b; }

__device__ __forceinline__ bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

__device__ __forceinline__ uint4 LoadUnit(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

template <typename T>
__device__ __forceinline__ void StoreUnit(T* p, int n, bool vec, const typename AccumulatorOf<T>::type* acc) {
  constexpr int kE = Unit<T>::kElems;
  if (vec && n == kE) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int k = 0; k < kE; ++k) e[k] = Narrow<T>(acc[k]);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
    for (int k = 0; k < n; ++k) p[k] = Narrow<T>(acc[k]);
  }
}

// Bit-exact copy of one unit (n elements).
template <typename T>
__device__ __forceinline__ void CopyUnit(const T* src, T* dst, int n, bool vec) {
  if (vec && n == Unit<T>::kElems) {
    *reinterpret_cast<uint4*>(dst) = LoadUnit(src);
  } else {
    for (int k = 0; k < n; ++k) dst[k] = src[k];
  }
}

// The fold, written once: acc[k] = elem(0, k) (op) elem(1, k) ... (op)
// elem(G - 1, k) for k < n, in member order and the accumulation type, then
// the final division of an Average. `elem(q, k)` returns element k of member
// q's unit (from registers in the vector paths, from memory in the tails).
template <typename T, int G, typename Elem>
__device__ __forceinline__ void FoldUnit(const Elem& elem, int n, ReduceOp op, int divisor,
                                         typename AccumulatorOf<T>::type* acc) {
  using A = typename AccumulatorOf<T>::type;
  constexpr int kE = Unit<T>::kElems;
#pragma unroll
  for (int k = 0; k < kE; ++k)
    if (k < n) acc[k] = Widen<T>(elem(0, k));
#pragma unroll
  for (int q = 1; q < G; ++q)
#pragma unroll
    for (int k = 0; k < kE; ++k)
      if (k < n) acc[k] = Apply<A>(op, acc[k], Widen<T>(elem(q, k)));
#pragma unroll
  for (int k = 0; k < kE; ++k) acc[k] = Finish<A>(op, divisor, acc[k]);
}

// elem(q, k) over G units loaded into registers.
template <typename T>
struct RegisterUnits {
  const uint4* raw;
  __device__ __forceinline__ T operator()(int q, int k) const {
    return reinterpret_cast<const T*>(&raw[q])[k];
  }
};

// ---------------------------------------------------------------- barrier

__device__ __forceinline__ void StoreRelease(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t LoadAcquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Polls of the flag between two looks at the abort word and the clock: a look
// costs a PCIe read of host memory (~1 us), 1024 polls take longer than that.
constexpr uint32_t kPollsPerCheck = 1024;

// Per-block state of one launch: the failure flag shared by the block and the
// call's deadline (Note [Dead peers]).
struct BlockState {
  int* failed;        // __shared__
  uint64_t deadline;  // %globaltimer ns; valid in threads < G
};

// Threads < G read the call's deadline: set here by the call's first kernel
// (block 0 keeps it for the later kernels of the call), read otherwise.
template <int G>
__device__ __forceinline__ BlockState StartBlock(const P2pLaunch& a, int* failed) {
  if (threadIdx.x == 0) *failed = 0;
  BlockState s{failed, 0};
  if (threadIdx.x < G) {
    BarrierFlags* own = a.peers.flags[a.group_rank];
    if (a.starts_call) {
      s.deadline = GlobalTimerNs() + a.timeout_ns;
      if (blockIdx.x == 0 && threadIdx.x == 0) own->call_deadline_ns = s.deadline;
    } else {
      s.deadline = *reinterpret_cast<volatile uint64_t*>(&own->call_deadline_ns);
    }
  }
  return s;
}

// See Note [Barrier protocol] and Note [Dead peers]. A barrier is split in
// two halves so that the two-shot kernel can push while the flags travel:
// BarrierArrive publishes this block's arrival (thread p < G returns the
// counter value it stored), BarrierWait(v) waits for every member's arrival at
// v. GroupBarrier is both at once.
template <int G>
__device__ __forceinline__ uint32_t BarrierArrive(const P2pLaunch& a) {
  __syncthreads();  // the block's writes so far precede the release below
  uint32_t v = 0;
  if (threadIdx.x < G) {
    const int p = threadIdx.x;
    BarrierFlags* own = a.peers.flags[a.group_rank];
    v = own->counter[blockIdx.x][p] + 1;
    own->counter[blockIdx.x][p] = v;
    StoreRelease(&a.peers.flags[p]->arrived[v & 1][blockIdx.x][a.group_rank], v);
  }
  return v;
}

// Returns false when the block must stop (abort or deadline).
template <int G>
__device__ __forceinline__ bool BarrierWait(const P2pLaunch& a, uint32_t v, const BlockState& s) {
  if (threadIdx.x < G) {
    const int p = threadIdx.x;
    const uint32_t* mine = &a.peers.flags[a.group_rank]->arrived[v & 1][blockIdx.x][p];
    uint32_t polls = 0;
    while (LoadAcquire(mine) != v) {
      if (++polls % kPollsPerCheck != 0) continue;
      int why = 0;
      if (a.control->abort) why = kFailureAborted;
      else if (GlobalTimerNs() > s.deadline) why = kFailureTimeout;
      if (why != 0) {
        a.control->failed_peer = p;
        a.control->failed_block = blockIdx.x;
        a.control->failure = why;
        __threadfence_system();
        *s.failed = 1;
        break;
      }
    }
  }
  __syncthreads();  // the acquire above (thread p) now covers the whole block
  return *s.failed == 0;
}

template <int G>
__device__ __forceinline__ bool GroupBarrier(const P2pLaunch& a, const BlockState& s) {
  return BarrierWait<G>(a, BarrierArrive<G>(a), s);
}

// ---------------------------------------------------------------- one-shot

// Launch bounds, per kernel, from `nvcc -Xptxas -v` (docs/PERFORMANCE.md
// "Launch bounds"): the one-shot kernel fits 64 registers without spills, so
// two blocks of 512 threads per multiprocessor; the two-shot kernel's batches
// of G 16-byte loads need more (it spilled at 64), so one block per
// multiprocessor and up to 128 registers.
#ifndef NVGROUP_TWOSHOT_MIN_BLOCKS_PER_SM  // -D...=2: the old bound, for comparison builds
#define NVGROUP_TWOSHOT_MIN_BLOCKS_PER_SM 1
#endif
constexpr int kOneShotMinBlocksPerSm = 2;
constexpr int kTwoShotMinBlocksPerSm = NVGROUP_TWOSHOT_MIN_BLOCKS_PER_SM;

// One-shot: copy-in, barrier, fold all members into out. See Note [One-shot
// staging epoch]. a.peers.data[p] is member p's staging half 0; half 1 starts
// a.staging_half_bytes later.
template <typename T, int G>
__global__ void __launch_bounds__(kThreadsPerBlock, kOneShotMinBlocksPerSm) OneShotKernel(P2pLaunch a) {
  using A = typename AccumulatorOf<T>::type;
  constexpr int kE = Unit<T>::kElems;
  __shared__ int failed;
  __shared__ uint32_t epoch;
  BarrierFlags* own_flags = a.peers.flags[a.group_rank];
  if (threadIdx.x == 0) epoch = *reinterpret_cast<volatile uint32_t*>(&own_flags->oneshot_epoch);
  const BlockState bs = StartBlock<G>(a, &failed);
  __syncthreads();
  const size_t half = (epoch & 1) * a.staging_half_bytes;
  const T* src[G];
#pragma unroll
  for (int p = 0; p < G; ++p) src[p] = reinterpret_cast<const T*>(a.peers.data[p] + half);
  T* staged = reinterpret_cast<T*>(a.peers.data[a.group_rank] + half);
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  const bool in_vec = Aligned16(in), out_vec = Aligned16(out);
  const size_t units = (a.count + kE - 1) / kE;
  const size_t first = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x;

  for (size_t u = first; u < units; u += step) {
    const size_t e = u * kE;
    CopyUnit<T>(in + e, staged + e, static_cast<int>(MinSize(kE, a.count - e)), in_vec);
  }
  if (!GroupBarrier<G>(a, bs)) return;  // orders: every member's staging half is complete
  for (size_t u = first; u < units; u += step) {
    const size_t e = u * kE;
    const int n = static_cast<int>(MinSize(kE, a.count - e));
    A acc[kE];
    if (n == kE) {  // staging is 16-byte aligned
      uint4 raw[G];
#pragma unroll
      for (int p = 0; p < G; ++p) raw[p] = LoadUnit(src[p] + e);
      FoldUnit<T, G>(RegisterUnits<T>{raw}, kE, a.op, a.divisor, acc);
    } else {
      FoldUnit<T, G>([&](int q, int k) { return src[q][e + k]; }, n, a.op, a.divisor, acc);
    }
    StoreUnit<T>(out + e, n, out_vec, acc);
  }
  // The last block to finish advances the epoch: every block has read it by
  // then (its read precedes its count, fenced), and the next launch on this
  // stream sees the new value (kernel boundary).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&own_flags->oneshot_blocks_done, 1u) == gridDim.x - 1) {
      own_flags->oneshot_blocks_done = 0;
      own_flags->oneshot_epoch = epoch + 1;
    }
  }
}

// ---------------------------------------------------------------- two-shot

// Units a thread moves per batch in the two-shot stages: all loads of a batch
// are issued before its stores, so kBatch * G 16-byte loads are in flight per
// thread (NVLink latency x bandwidth needs ~1 MB in flight per GPU).
template <int G>
__host__ __device__ constexpr int TwoShotBatch() {
  return G <= 2 ? 4 : (G <= 4 ? 2 : 1);
}

struct TwoShotGeometry {
  size_t stride;           // slice stride, elements (whole units)
  size_t units_per_slice;  // stride / units
  size_t full;             // units below this are full in every slice
  size_t first, step;      // this thread's first unit, threads in the grid
};

template <typename T, int G>
__device__ __forceinline__ TwoShotGeometry MakeTwoShotGeometry(const P2pLaunch& a) {
  constexpr int kE = Unit<T>::kElems;
  TwoShotGeometry g;
  g.stride = ((a.count + G - 1) / G + kE - 1) / kE * kE;
  g.units_per_slice = g.stride / kE;
  // The last slice is the shortest: units below `full` are full in every slice.
  g.full = (a.count - MinSize(a.count, (G - 1) * g.stride)) / kE;
  g.first = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  g.step = static_cast<size_t>(gridDim.x) * blockDim.x;
  return g;
}

// Push stage: slice p of the input, units [lo, hi) -> member p's slot r (p != r).
template <typename T, int G>
__device__ __forceinline__ void PushChunk(const P2pLaunch& a, const TwoShotGeometry& g, size_t lo,
                                          size_t hi) {
  constexpr int kE = Unit<T>::kElems;
  constexpr int kB = TwoShotBatch<G>();
  const int r = a.group_rank;
  const T* in = static_cast<const T*>(a.in);
  const bool in_vec = Aligned16(in);
  auto dst = [&](int p) { return reinterpret_cast<T*>(a.peers.data[p]) + r * g.stride; };
  size_t u = lo + g.first;
  if (in_vec) {
    for (; u + (kB - 1) * g.step < MinSize(hi, g.full); u += kB * g.step) {
      uint4 v[kB][G];
#pragma unroll
      for (int j = 0; j < kB; ++j)
#pragma unroll
        for (int p = 0; p < G; ++p)
          if (p != r) v[j][p] = LoadUnit(in + p * g.stride + (u + j * g.step) * kE);
#pragma unroll
      for (int j = 0; j < kB; ++j)
#pragma unroll
        for (int p = 0; p < G; ++p)
          if (p != r) *reinterpret_cast<uint4*>(dst(p) + (u + j * g.step) * kE) = v[j][p];
    }
  }
  for (; u < hi; u += g.step) {
#pragma unroll
    for (int p = 0; p < G; ++p) {
      const size_t e = MinSize(a.count, p * g.stride) + u * kE;
      const size_t end = MinSize(a.count, (p + 1) * g.stride);
      if (p != r && e < end)
        CopyUnit<T>(in + e, dst(p) + u * kE, static_cast<int>(MinSize(kE, end - e)), in_vec);
    }
  }
}

// Fold stage: slice r, units [lo, hi). Sources: push -- own slots q != r and
// own input (q == r); pull -- every member's data. Stores the result to own
// data, to out when `also_out`, and to every member's data when `push_result`.
template <typename T, int G>
__device__ __forceinline__ void FoldChunk(const P2pLaunch& a, const TwoShotGeometry& g, size_t lo,
                                          size_t hi) {
  using A = typename AccumulatorOf<T>::type;
  constexpr int kE = Unit<T>::kElems;
  constexpr int kB = TwoShotBatch<G>();
  const int r = a.group_rank;
  T* own = reinterpret_cast<T*>(a.peers.data[r]);
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  const bool push = (a.phases & kPhasePushScatter) != 0;
  const bool push_result = (a.phases & kPhasePushResult) != 0;
  const bool also_out = (a.phases & kPhaseAllgather) != 0 && out != own;
  const bool in_vec = !push || Aligned16(in);  // pull reads registered (aligned) memory only
  const bool out_vec = !also_out || Aligned16(out);
  const size_t begin = MinSize(a.count, r * g.stride), end = MinSize(a.count, (r + 1) * g.stride);
  // Member q's element e (= begin + u * kE + k) of slice r.
  auto source = [&](int q, size_t u) -> const T* {
    if (!push) return reinterpret_cast<const T*>(a.peers.data[q]) + begin + u * kE;
    return q == r ? in + begin + u * kE : own + q * g.stride + u * kE;
  };
  auto store = [&](size_t u, int n, const A* acc) {
    const size_t e = begin + u * kE;
    StoreUnit<T>(own + e, n, true, acc);
    if (also_out) StoreUnit<T>(out + e, n, out_vec, acc);
    if (push_result)
#pragma unroll
      for (int p = 0; p < G; ++p)
        if (p != r) StoreUnit<T>(reinterpret_cast<T*>(a.peers.data[p]) + e, n, true, acc);
  };
  size_t u = lo + g.first;
  if (in_vec && out_vec) {
    for (; u + (kB - 1) * g.step < MinSize(hi, g.full); u += kB * g.step) {
      uint4 raw[kB][G];
#pragma unroll
      for (int j = 0; j < kB; ++j)
#pragma unroll
        for (int q = 0; q < G; ++q) raw[j][q] = LoadUnit(source(q, u + j * g.step));
#pragma unroll
      for (int j = 0; j < kB; ++j) {
        A acc[kE];
        FoldUnit<T, G>(RegisterUnits<T>{raw[j]}, kE, a.op, a.divisor, acc);
        store(u + j * g.step, kE, acc);
      }
    }
  }
  for (; u < hi; u += g.step) {
    const size_t e = begin + u * kE;
    if (e >= end) break;
    const int n = static_cast<int>(MinSize(kE, end - e));
    A acc[kE];
    if (n == kE && in_vec) {
      uint4 raw[G];
#pragma unroll
      for (int q = 0; q < G; ++q) raw[q] = LoadUnit(source(q, u));
      FoldUnit<T, G>(RegisterUnits<T>{raw}, kE, a.op, a.divisor, acc);
    } else {
      FoldUnit<T, G>([&](int q, int k) { return source(q, u)[k]; }, n, a.op, a.divisor, acc);
    }
    store(u, n, acc);
  }
}

// Gather stage: slices p, units [lo, hi): member p's reduced data -> out, for
// p != r (and p == r when `copy_own`: allgather alone, out not own data).
template <typename T, int G>
__device__ __forceinline__ void GatherChunk(const P2pLaunch& a, const TwoShotGeometry& g, size_t lo,
                                            size_t hi) {
  constexpr int kE = Unit<T>::kElems;
  constexpr int kB = TwoShotBatch<G>();
  const int r = a.group_rank;
  T* out = static_cast<T*>(a.out);
  const bool out_vec = Aligned16(out);
  auto src = [&](int p) { return reinterpret_cast<const T*>(a.peers.data[p]); };
  const bool copy_own = (a.phases & kPhaseReduceScatter) == 0 && src(r) != out;
  size_t u = lo + g.first;
  if (out_vec) {
    for (; u + (kB - 1) * g.step < MinSize(hi, g.full); u += kB * g.step) {
      uint4 v[kB][G];
#pragma unroll
      for (int j = 0; j < kB; ++j)
#pragma unroll
        for (int p = 0; p < G; ++p)
          if (p != r || copy_own) v[j][p] = LoadUnit(src(p) + p * g.stride + (u + j * g.step) * kE);
#pragma unroll
      for (int j = 0; j < kB; ++j)
#pragma unroll
        for (int p = 0; p < G; ++p)
          if (p != r || copy_own)
            *reinterpret_cast<uint4*>(out + p * g.stride + (u + j * g.step) * kE) = v[j][p];
    }
  }
  for (; u < hi; u += g.step) {
#pragma unroll
    for (int p = 0; p < G; ++p) {
      const size_t e = MinSize(a.count, p * g.stride) + u * kE;
      const size_t end = MinSize(a.count, (p + 1) * g.stride);
      if (e < end && (p != r || copy_own))
        CopyUnit<T>(src(p) + e, out + e, static_cast<int>(MinSize(kE, end - e)), out_vec);
    }
  }
}

// The two-shot kernel: the stages named in a.phases over chunks of
// a.chunk_units units per slice (0: one chunk), scheduled as in "Two-shot"
// above. Valid phase sets: push + fold + gather (user buffers), fold + gather
// or fold + push result (pull), fold alone, gather alone (the hierarchy).
template <typename T, int G>
__global__ void __launch_bounds__(kThreadsPerBlock, kTwoShotMinBlocksPerSm) TwoShotKernel(P2pLaunch a) {
  __shared__ int failed;
  const BlockState bs = StartBlock<G>(a, &failed);
  const TwoShotGeometry g = MakeTwoShotGeometry<T, G>(a);
  const bool push = (a.phases & kPhasePushScatter) != 0;
  const bool fold = (a.phases & kPhaseReduceScatter) != 0;
  const bool gather = (a.phases & kPhaseAllgather) != 0;
  // A chunk is a multiple of the grid's step, so every chunk starts at a
  // multiple of step and thread t keeps the units congruent to t everywhere.
  const size_t want = a.chunk_units == 0 ? g.units_per_slice : a.chunk_units;
  const size_t chunk = (want + g.step - 1) / g.step * g.step;
  const size_t chunks = (g.units_per_slice + chunk - 1) / chunk;
  const size_t o_fold = push ? 2 : 0;
  const size_t o_gather = fold ? o_fold + 1 : 0;
  const size_t last = chunks - 1 + (gather ? o_gather : o_fold);
  auto lo = [&](size_t c) { return c * chunk; };
  auto hi = [&](size_t c) { return MinSize(g.units_per_slice, (c + 1) * chunk); };

  // orders -- push: every member has entered this call, so it is done with
  // its registered data; pull/gather: every member's data is complete
  if (!GroupBarrier<G>(a, bs)) return;
  uint32_t v = 0;
  bool arrived = false;
  for (size_t k = 0; k <= last; ++k) {
    // the barrier of step k - 1: releases the peers' push(k - 2) (through
    // their arrival after it), fold(k - 1 - o_fold), gather(k - 1 - o_gather)
    if (arrived && !BarrierWait<G>(a, v, bs)) return;
    if (fold && k >= o_fold && k - o_fold < chunks) FoldChunk<T, G>(a, g, lo(k - o_fold), hi(k - o_fold));
    if (gather && k >= o_gather && k - o_gather < chunks)
      GatherChunk<T, G>(a, g, lo(k - o_gather), hi(k - o_gather));
    // With push, step 0 has nothing to release yet (push(0) follows).
    arrived = k >= 1 || !push;
    if (arrived) v = BarrierArrive<G>(a);
    if (push && k < chunks) PushChunk<T, G>(a, g, lo(k), hi(k));
  }
  // the end barrier: every member finished reading this rank's slots and data
  if (arrived) BarrierWait<G>(a, v, bs);
}

// Fold over groups (hierarchy step 2, after the exchange): local only.
template <typename T>
__global__ void __launch_bounds__(kThreadsPerBlock)
    FoldSourcesKernel(const T* src, int num_sources, T* dst, size_t count, ReduceOp op, int divisor) {
  using A = typename AccumulatorOf<T>::type;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    A acc = Widen<T>(src[i]);
    for (int g = 1; g < num_sources; ++g) acc = Apply<A>(op, acc, Widen<T>(src[g * count + i]));
    dst[i] = Narrow<T>(Finish<A>(op, divisor, acc));
  }
}

}  // namespace kernels
}  // namespace nvgroup
