// NV-group allreduce kernels: every GPU of a group loads its peers' registered
// buffers directly over NVLink (CUDA IPC mappings) and reduces in a fixed order.
//
// How it works.
//
// Memory. Each member of a group owns one cudaMalloc'd IPC allocation
// (cc/device/ipc_cuda.cc): | BarrierFlags | data | staging half 0 | half 1 |.
// Every member maps every other member's allocation, so a kernel on rank r
// holds plain device pointers (GroupPeers) to all G copies and dereferences
// them: loads of a peer pointer travel over NVLink.
//
// One-shot (small messages, one barrier):
//   1. copy-in: this rank copies its input into its staging half;
//   2. barrier (release/acquire): every member's input is in its staging half;
//   3. every rank reads unit u of all G staging halves, folds them in
//      group_rank order and writes out[u].
//   The staging half alternates per call (the host's call parity), so no end
//   barrier is needed: a member writes a half again two calls later, by which
//   time every member has passed the barrier of the call in between, which it
//   can only reach after its kernel of this call completed (stream order).
//
// Two-shot (large messages, reduce-scatter + allgather, all over NVLink):
//   The region is cut into G *slices* (slice p owned by group rank p; the
//   slice stride is a multiple of one 16-byte *unit*, so every full unit is
//   aligned), each slice into units of 16 bytes (the last unit of the last
//   slice may be partial: the scalar tail). Two ways to reduce-scatter:
//   * pull (the input already lies in the registered buffer, the engine's
//     fused path): after a barrier (every member's data is complete), rank r
//     folds unit u of slice r over all members' data in group_rank order,
//     loading the peers' units over NVLink;
//   * push (any other input; kPhasePushScatter): rank r first stores slice p of
//     its input into member p's *slot* r (at r * stride in p's data) over
//     NVLink, for every p != r; after a barrier (every slot is filled) it folds
//     unit u of slice r from its own slots (local loads) and its own input, in
//     group_rank order. No copy-in pass, no remote loads in this phase.
//   Either way the result goes to slice r of this rank's data (and of out);
//   nobody else reads that place during the phase. In place on the registered
//   data (kPhasePushResult, pull only: the engine's fused buffer) the thread
//   also stores the result into slice r of every member's data -- the units it
//   has just loaded, which no one else reads -- and an end barrier finishes the
//   call: no allgather phase. Otherwise a barrier (every member's reduced
//   slice is complete), then the allgather (kPhaseAllgather): rank r copies
//   unit u of slice p from member p's data into out, for every p != r (loads
//   over NVLink), then an end barrier: every member has finished reading this
//   rank's data, so the next call may overwrite it. Push mode also starts
//   with a barrier: a member's registered data is still in use between its
//   calls (the engine copies fused results out of it, a test reads it), so a
//   peer may push into it only once the member has entered this call (stream
//   order: its earlier copies are done). Without it, compute-sanitizer's
//   slowed-down racecheck run of allreduce_check found in-place registered
//   results overwritten by the peer's next push (2xH200, 09:03 UTC).
//   Thread mapping: global thread t handles units t, t + step, t + 2 step, ...
//   (step = threads in the grid) of every slice in every phase, so the thread
//   that reads a value on one GPU has the same index as the thread that wrote
//   it on the other (vLLM's rule: cross-GPU visibility is reasoned about per
//   thread; with release/acquire plus __syncthreads it also holds block-wide,
//   and we keep the stricter mapping). Full aligned units go in batches of
//   TwoShotBatch<G>() units per thread (all loads first, then the stores);
//   the batch covers the same units t, t + step, ... so the mapping holds.
//   The hierarchical allreduce (cc/algorithms/hierarchical_allreduce.h) runs
//   the phases separately: {reduce-scatter} per chunk, then the fold over
//   groups, then {allgather}.
//
// Note [Pipelined two-shot]. On user buffers the two-shot kernel above runs
// push, fold and gather one after the other over the whole message, so the
// local fold (HBM only: read the pushed slot and the own input, write own data
// and out) leaves NVLink idle. The pipelined kernel (TwoShotPipelinedKernel,
// P2pLaunch::chunk_units > 0) cuts every slice into chunks of chunk_units
// units (rounded up to the grid's thread count) and runs, per block, step
// k = 0 .. chunks + 2:
//   wait barrier k - 1; fold chunk k - 2; gather chunk k - 3;
//   arrive at barrier k; push chunk k.
// So a block pushes chunk k while its fold of k - 2 and gather of k - 3 are
// still draining, and HBM work overlaps NVLink work. Why it is race-free:
//   * fold(c) reads the slots of chunk c, written by the peers' push(c) in
//     their step c before their arrival at barrier c + 1; fold(c) runs in step
//     c + 2, after waiting for barrier c + 1 (release/acquire as below);
//   * gather(c) reads member p's reduced chunk c, written by p's fold(c) in
//     step c + 2 before p's arrival at barrier c + 2; gather(c) runs in step
//     c + 3 after waiting for it;
//   * within a call every chunk has its own slots and result units, so a push
//     or fold never touches what another step still reads; across calls the
//     last barrier (chunks + 2, arrival after the last gather) orders every
//     member's reads of this rank's slots and data before the next call's
//     pushes and folds (as the plain kernel's end barrier), and a start
//     barrier (as the plain kernel's in push mode) keeps pushes out of a
//     member's registered data until it has entered the call;
//   * the push after an arrival is released by the next arrival: a barrier is
//     split into BarrierArrive / BarrierWait so the push runs while the flags
//     travel. A member can still be at most one barrier ahead (it arrives at
//     k + 1 only after waiting for k, which needs this rank's arrival at k),
//     so the two flag parities suffice.
// Thread mapping as in the plain kernel (chunks start at multiples of the
// grid's thread count), the same fold order (bitwise identical results), and
// chunks + 3 barriers per call instead of 4.
//
// Note [Barrier protocol]. A barrier is per block: block b of every member
// meets block b of every other member (all ranks launch identical grids, so
// block b exists everywhere). Thread p < G of block b on rank r:
//   * increments its private counter[b][p] (in r's own BarrierFlags) to v;
//   * stores v into member p's arrived[v & 1][b][r] with st.release.sys, which
//     orders everything block b wrote before the barrier (the __syncthreads
//     before it makes the block's writes precede thread p's release);
//   * spins with ld.acquire.sys until its own arrived[v & 1][b][p] == v, so
//     everything member p's block b wrote before arriving is visible here; a
//     __syncthreads then extends that to the whole block. (Measured on 2x
//     H200: polling with relaxed loads plus one fence.acq_rel.sys after the
//     wait cost ~0.4-0.9 us more per barrier than acquire loads.)
// Two parities: member p may already be at the next barrier (v + 1) and write
// arrived[(v + 1) & 1] while this rank still waits for v; it cannot reach v + 2
// before this rank arrived at v + 1. Counters live in device memory, start at 0
// and are never reset, so a captured CUDA graph replays correctly.
// Every barrier uses release/acquire, also the end barrier: it must order the
// peers' *loads* of this rank's data before this rank's later stores, which a
// relaxed flag does not promise.
//
// Note [Dead peers]. Spin loops poll the host-mapped abort word and the
// %globaltimer every 1024 polls. On abort or after `timeout_ns` the spinning
// thread records the failure (kind, member, block) in the mapped DeviceControl,
// and its block returns at once; other blocks give up the same way, so the
// kernel ends within about the timeout and the stream moves on. Results of
// that call are garbage and the counters of the members are out of step: the
// host reads DeviceControl before every launch and in Synchronize and fails
// that and every later call with kUnavailable (timeout) or kAborted naming the
// member. Tested: a peer that never enters the call (allreduce_check's dead
// peer case: kUnavailable after the 2 s timeout, later calls fail the same
// way). Not tested: a peer process that exits while its memory is mapped here
// (what loads from that mapping then do is up to the driver).
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

// a (op) b. Integers wrap (two's complement) instead of overflowing into UB.
// Min/Max: `b < a ? b : a`, like the CPU path.
template <typename A, bool kIntegral = std::is_integral_v<A>>
struct WrapOf {
  using type = A;
};
template <typename A>
struct WrapOf<A, true> {
  using type = std::make_unsigned_t<A>;
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
// truncate toward zero, as C++ division does).
template <typename A>
__device__ __forceinline__ A Finish(ReduceOp op, int divisor, A x) {
  return (op == ReduceOp::kAverage && divisor > 1) ? x / static_cast<A>(divisor) : x;
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

template <typename T>
__device__ __forceinline__ void StoreUnit(T* p, int n, bool vec,
                                          const typename AccumulatorOf<T>::type* acc) {
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

// Bit-exact copy of one unit. Loads of registered memory use ld.global.cg
// (cached in L2 only, never in a possibly stale L1 line: peers change it).
template <typename T>
__device__ __forceinline__ void CopyUnit(const T* src, T* dst, int n, bool vec) {
  if (vec && n == Unit<T>::kElems) {
    *reinterpret_cast<uint4*>(dst) = __ldcg(reinterpret_cast<const uint4*>(src));
  } else {
    for (int k = 0; k < n; ++k) dst[k] = src[k];
  }
}

// Folds unit `elem` (n elements) of the G member arrays into acc, member order.
// All G loads are issued before the fold so they are in flight together.
template <typename T, int G>
__device__ __forceinline__ void FoldMembers(T* const* src, size_t elem, int n, ReduceOp op,
                                            typename AccumulatorOf<T>::type* acc) {
  using A = typename AccumulatorOf<T>::type;
  constexpr int kE = Unit<T>::kElems;
  if (n == kE) {  // member data is always 16-byte aligned (registered memory)
    uint4 raw[G];
#pragma unroll
    for (int p = 0; p < G; ++p) raw[p] = __ldcg(reinterpret_cast<const uint4*>(src[p] + elem));
    const T* e0 = reinterpret_cast<const T*>(&raw[0]);
#pragma unroll
    for (int k = 0; k < kE; ++k) acc[k] = Widen<T>(e0[k]);
#pragma unroll
    for (int p = 1; p < G; ++p) {
      const T* e = reinterpret_cast<const T*>(&raw[p]);
#pragma unroll
      for (int k = 0; k < kE; ++k) acc[k] = Apply<A>(op, acc[k], Widen<T>(e[k]));
    }
  } else {
    for (int k = 0; k < n; ++k) acc[k] = Widen<T>(src[0][elem + k]);
#pragma unroll
    for (int p = 1; p < G; ++p)
      for (int k = 0; k < n; ++k) acc[k] = Apply<A>(op, acc[k], Widen<T>(src[p][elem + k]));
  }
}

// Push variant of the fold: slot[q] is member q's contribution in this rank's
// registered memory (aligned), except q == r, which is read from `own_in`.
template <typename T, int G>
__device__ __forceinline__ void FoldPushed(T* const* slot, const T* own_in, bool in_vec, int r,
                                           int n, ReduceOp op,
                                           typename AccumulatorOf<T>::type* acc) {
  using A = typename AccumulatorOf<T>::type;
  constexpr int kE = Unit<T>::kElems;
  if (n == kE && in_vec) {
    uint4 raw[G];
#pragma unroll
    for (int q = 0; q < G; ++q)
      raw[q] = __ldcg(reinterpret_cast<const uint4*>(q == r ? own_in : slot[q]));
    const T* e0 = reinterpret_cast<const T*>(&raw[0]);
#pragma unroll
    for (int k = 0; k < kE; ++k) acc[k] = Widen<T>(e0[k]);
#pragma unroll
    for (int q = 1; q < G; ++q) {
      const T* e = reinterpret_cast<const T*>(&raw[q]);
#pragma unroll
      for (int k = 0; k < kE; ++k) acc[k] = Apply<A>(op, acc[k], Widen<T>(e[k]));
    }
  } else {
    for (int k = 0; k < n; ++k) acc[k] = Widen<T>(r == 0 ? own_in[k] : slot[0][k]);
#pragma unroll
    for (int q = 1; q < G; ++q)
      for (int k = 0; k < n; ++k)
        acc[k] = Apply<A>(op, acc[k], Widen<T>(q == r ? own_in[k] : slot[q][k]));
  }
}

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

// See Note [Barrier protocol] and Note [Dead peers]. A barrier is split in
// two halves so that the pipelined kernel can do independent work in between:
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

// Returns false when the block must stop (abort or timeout); `failed` is the
// block's shared flag.
template <int G>
__device__ __forceinline__ bool BarrierWait(const P2pLaunch& a, uint32_t v, int* failed) {
  if (threadIdx.x < G) {
    const int p = threadIdx.x;
    const uint32_t* mine = &a.peers.flags[a.group_rank]->arrived[v & 1][blockIdx.x][p];
    uint64_t deadline = 0;
    uint32_t polls = 0;
    while (LoadAcquire(mine) != v) {
      if (++polls % kPollsPerCheck != 0) continue;
      int why = 0;
      if (a.control->abort) {
        why = kFailureAborted;
      } else {
        const uint64_t now = GlobalTimerNs();
        if (deadline == 0) deadline = now + a.timeout_ns;
        else if (now > deadline) why = kFailureTimeout;
      }
      if (why != 0) {
        a.control->failed_peer = p;
        a.control->failed_block = blockIdx.x;
        a.control->failure = why;
        __threadfence_system();
        *failed = 1;
        break;
      }
    }
  }
  __syncthreads();  // the acquire above (thread p) now covers the whole block
  return *failed == 0;
}

template <int G>
__device__ __forceinline__ bool GroupBarrier(const P2pLaunch& a, int* failed) {
  return BarrierWait<G>(a, BarrierArrive<G>(a), failed);
}

// ---------------------------------------------------------------- kernels

// One-shot: copy-in, barrier, fold all members into out. See "How it works".
template <typename T, int G>
__global__ void __launch_bounds__(kThreadsPerBlock, 2) OneShotCopyInFoldKernel(P2pLaunch a) {
  using A = typename AccumulatorOf<T>::type;
  constexpr int kE = Unit<T>::kElems;
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;

  T* src[G];
#pragma unroll
  for (int p = 0; p < G; ++p) src[p] = reinterpret_cast<T*>(a.peers.data[p]);
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  const bool in_vec = Aligned16(in), out_vec = Aligned16(out);
  const size_t units = (a.count + kE - 1) / kE;
  const size_t first = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x;

  for (size_t u = first; u < units; u += step) {
    const size_t e = u * kE;
    CopyUnit<T>(in + e, src[a.group_rank] + e, static_cast<int>(MinSize(kE, a.count - e)),
                in_vec);
  }
  if (!GroupBarrier<G>(a, &failed)) return;  // orders: every member's staging is complete
  for (size_t u = first; u < units; u += step) {
    const size_t e = u * kE;
    const int n = static_cast<int>(MinSize(kE, a.count - e));
    A acc[kE];
    FoldMembers<T, G>(src, e, n, a.op, acc);
#pragma unroll
    for (int k = 0; k < kE; ++k) acc[k] = Finish<A>(a.op, a.divisor, acc[k]);
    StoreUnit<T>(out + e, n, out_vec, acc);
  }
}

// Units a thread moves per batch in the two-shot phases: all loads of a batch
// are issued before its stores, so kBatch * G 16-byte loads are in flight per
// thread (NVLink latency x bandwidth needs ~1 MB in flight per GPU). Bounded by
// the 64 registers of 2 blocks/SM: G = 2 moves 4 units, G <= 4 two, else one.
template <int G>
__host__ __device__ constexpr int TwoShotBatch() {
  return G <= 2 ? 4 : (G <= 4 ? 2 : 1);
}

// Two-shot phases. See "How it works" for the order and the barriers. Thread t
// handles units t, t + step, ... of every slice in every phase; a batch covers
// kB of those units (t, t + step, ..., t + (kB - 1) step), so the mapping is
// the same in the batched fast path (full, aligned units) and the per-unit path.
template <typename T, int G>
__global__ void __launch_bounds__(kThreadsPerBlock, 2) TwoShotKernel(P2pLaunch a) {
  using A = typename AccumulatorOf<T>::type;
  constexpr int kE = Unit<T>::kElems;
  constexpr int kB = TwoShotBatch<G>();
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;

  T* src[G];
#pragma unroll
  for (int p = 0; p < G; ++p) src[p] = reinterpret_cast<T*>(a.peers.data[p]);
  const int r = a.group_rank;
  T* own = src[r];
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  const bool in_vec = Aligned16(in), out_vec = Aligned16(out);
  const bool push = (a.phases & kPhasePushScatter) != 0;
  // Slice geometry: stride is ceil(count / G) rounded up to whole units. The
  // last slice is the shortest: units below `full` are full in every slice.
  const size_t stride = ((a.count + G - 1) / G + kE - 1) / kE * kE;
  const size_t units_per_slice = stride / kE;
  auto slice_begin = [&](int p) { return MinSize(a.count, p * stride); };
  auto slice_end = [&](int p) { return MinSize(a.count, (p + 1) * stride); };
  const size_t full = (slice_end(G - 1) - slice_begin(G - 1)) / kE;
  const size_t first = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t batch_span = (kB - 1) * step;  // last unit of a batch, relative

  if (push) {
    // orders: every member has entered this call, so it is done with its
    // registered data (see "How it works": push mode)
    if (!GroupBarrier<G>(a, &failed)) return;
    // Slice p of the input goes to member p's slot r, at r * stride (slots are
    // unclamped: the registered buffer holds G * stride elements).
    size_t u = first;
    if (in_vec) {
      for (; u + batch_span < full; u += kB * step) {
        uint4 v[kB][G];
#pragma unroll
        for (int j = 0; j < kB; ++j)
#pragma unroll
          for (int p = 0; p < G; ++p)
            if (p != r)
              v[j][p] = __ldcg(reinterpret_cast<const uint4*>(in + p * stride + (u + j * step) * kE));
#pragma unroll
        for (int j = 0; j < kB; ++j)
#pragma unroll
          for (int p = 0; p < G; ++p)
            if (p != r) *reinterpret_cast<uint4*>(src[p] + r * stride + (u + j * step) * kE) = v[j][p];
      }
    }
    for (; u < units_per_slice; u += step) {
#pragma unroll
      for (int p = 0; p < G; ++p) {
        const size_t e = slice_begin(p) + u * kE;
        if (p != r && e < slice_end(p))
          CopyUnit<T>(in + e, src[p] + r * stride + u * kE,
                      static_cast<int>(MinSize(kE, slice_end(p) - e)), in_vec);
      }
    }
  }
  // orders: pushed slots (push) or every member's data (pull) are complete
  if (!GroupBarrier<G>(a, &failed)) return;

  if (a.phases & kPhaseReduceScatter) {
    const bool also_out = (a.phases & kPhaseAllgather) != 0 && out != own;
    // In place on the registered data (pull only): member p's slice r is read
    // by this rank alone, by this very thread, just before it is overwritten.
    const bool push_result = (a.phases & kPhasePushResult) != 0;
    // Unit e of slice r: fold (push: own slots + own input; pull: members' data),
    // store to own data and, for a full allreduce, to out.
    auto reduce_unit = [&](size_t u, const uint4* raw, int n, bool vec) {
      const size_t e = slice_begin(r) + u * kE;
      A acc[kE];
      if (vec) {
        const T* e0 = reinterpret_cast<const T*>(&raw[0]);
#pragma unroll
        for (int k = 0; k < kE; ++k) acc[k] = Widen<T>(e0[k]);
#pragma unroll
        for (int q = 1; q < G; ++q) {
          const T* eq = reinterpret_cast<const T*>(&raw[q]);
#pragma unroll
          for (int k = 0; k < kE; ++k) acc[k] = Apply<A>(a.op, acc[k], Widen<T>(eq[k]));
        }
      } else if (push) {
        T* slot[G];
#pragma unroll
        for (int q = 0; q < G; ++q) slot[q] = own + q * stride + u * kE;
        FoldPushed<T, G>(slot, in + e, in_vec, r, n, a.op, acc);
      } else {
        FoldMembers<T, G>(src, e, n, a.op, acc);
      }
#pragma unroll
      for (int k = 0; k < kE; ++k) acc[k] = Finish<A>(a.op, a.divisor, acc[k]);
      StoreUnit<T>(own + e, n, true, acc);
      if (also_out) StoreUnit<T>(out + e, n, out_vec, acc);
      if (push_result)
#pragma unroll
        for (int p = 0; p < G; ++p)
          if (p != r) StoreUnit<T>(src[p] + e, n, true, acc);
    };
    auto load_unit = [&](size_t u, uint4* raw) {
      const size_t e = slice_begin(r) + u * kE;
#pragma unroll
      for (int q = 0; q < G; ++q) {
        const T* from = push ? (q == r ? in + e : own + q * stride + u * kE) : src[q] + e;
        raw[q] = __ldcg(reinterpret_cast<const uint4*>(from));
      }
    };
    size_t u = first;
    if ((!push || in_vec) && (!also_out || out_vec)) {
      for (; u + batch_span < full; u += kB * step) {
        uint4 raw[kB][G];
#pragma unroll
        for (int j = 0; j < kB; ++j) load_unit(u + j * step, raw[j]);
#pragma unroll
        for (int j = 0; j < kB; ++j) reduce_unit(u + j * step, raw[j], kE, true);
      }
    }
    for (; u < units_per_slice; u += step) {
      const size_t e = slice_begin(r) + u * kE;
      if (e >= slice_end(r)) break;
      const int n = static_cast<int>(MinSize(kE, slice_end(r) - e));
      uint4 raw[G];
      const bool vec = n == kE && (!push || in_vec);
      if (vec) load_unit(u, raw);
      reduce_unit(u, raw, n, vec);
    }
    // orders: every member's reduced slice is complete before anyone gathers it
    if ((a.phases & kPhaseAllgather) && !GroupBarrier<G>(a, &failed)) return;
    // orders (push_result, the end): every pushed result has landed, and every
    // member finished reading this rank's data before it is reused
    if (push_result) GroupBarrier<G>(a, &failed);
  }

  if (a.phases & kPhaseAllgather) {
    // Own slice: already written by the reduce-scatter above, or (allgather
    // only) copied here unless out is the registered data itself.
    const bool copy_own = (a.phases & kPhaseReduceScatter) == 0 && own != out;
    size_t u = first;
    if (out_vec) {
      for (; u + batch_span < full; u += kB * step) {
        uint4 v[kB][G];
#pragma unroll
        for (int j = 0; j < kB; ++j)
#pragma unroll
          for (int p = 0; p < G; ++p)
            if (p != r || copy_own)
              v[j][p] = __ldcg(reinterpret_cast<const uint4*>(src[p] + p * stride + (u + j * step) * kE));
#pragma unroll
        for (int j = 0; j < kB; ++j)
#pragma unroll
          for (int p = 0; p < G; ++p)
            if (p != r || copy_own) *reinterpret_cast<uint4*>(out + p * stride + (u + j * step) * kE) = v[j][p];
      }
    }
    for (; u < units_per_slice; u += step) {
#pragma unroll
      for (int p = 0; p < G; ++p) {
        const size_t e = slice_begin(p) + u * kE;
        if (e < slice_end(p) && (p != r || copy_own))
          CopyUnit<T>(src[p] + e, out + e, static_cast<int>(MinSize(kE, slice_end(p) - e)),
                      out_vec);
      }
    }
    // orders: every member finished reading this rank's data before it is reused
    GroupBarrier<G>(a, &failed);
  }
}

// Pipelined two-shot on user buffers (phases push + reduce-scatter +
// allgather, out not the registered data; a.chunk_units > 0). See Note
// [Pipelined two-shot]. The phase bodies below are TwoShotKernel's push path
// restricted to units [lo, hi) of every slice (lo a multiple of step, so thread
// t keeps the units congruent to t in every phase and chunk, as there).
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
  g.full = (a.count - MinSize(a.count, (G - 1) * g.stride)) / kE;
  g.first = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  g.step = static_cast<size_t>(gridDim.x) * blockDim.x;
  return g;
}

// Slice p of the input, units [lo, hi) -> member p's slot r (p != r).
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
          if (p != r)
            v[j][p] = __ldcg(reinterpret_cast<const uint4*>(in + p * g.stride + (u + j * g.step) * kE));
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

// Slice r, units [lo, hi): fold own slots + own input in group_rank order,
// store to own data (the peers gather it) and to out.
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
  const bool in_vec = Aligned16(in), out_vec = Aligned16(out);
  const size_t begin = MinSize(a.count, r * g.stride), end = MinSize(a.count, (r + 1) * g.stride);
  auto finish_store = [&](size_t e, int n, A* acc) {
#pragma unroll
    for (int k = 0; k < kE; ++k) acc[k] = Finish<A>(a.op, a.divisor, acc[k]);
    StoreUnit<T>(own + e, n, true, acc);
    StoreUnit<T>(out + e, n, out_vec, acc);
  };
  size_t u = lo + g.first;
  if (in_vec && out_vec) {
    for (; u + (kB - 1) * g.step < MinSize(hi, g.full); u += kB * g.step) {
      uint4 raw[kB][G];
#pragma unroll
      for (int j = 0; j < kB; ++j)
#pragma unroll
        for (int q = 0; q < G; ++q) {
          const size_t uj = u + j * g.step;
          const T* from = q == r ? in + begin + uj * kE : own + q * g.stride + uj * kE;
          raw[j][q] = __ldcg(reinterpret_cast<const uint4*>(from));
        }
#pragma unroll
      for (int j = 0; j < kB; ++j) {
        A acc[kE];
        const T* e0 = reinterpret_cast<const T*>(&raw[j][0]);
#pragma unroll
        for (int k = 0; k < kE; ++k) acc[k] = Widen<T>(e0[k]);
#pragma unroll
        for (int q = 1; q < G; ++q) {
          const T* eq = reinterpret_cast<const T*>(&raw[j][q]);
#pragma unroll
          for (int k = 0; k < kE; ++k) acc[k] = Apply<A>(a.op, acc[k], Widen<T>(eq[k]));
        }
        finish_store(begin + (u + j * g.step) * kE, kE, acc);
      }
    }
  }
  for (; u < hi; u += g.step) {
    const size_t e = begin + u * kE;
    if (e >= end) break;
    const int n = static_cast<int>(MinSize(kE, end - e));
    T* slot[G];
#pragma unroll
    for (int q = 0; q < G; ++q) slot[q] = own + q * g.stride + u * kE;
    A acc[kE];
    FoldPushed<T, G>(slot, in + e, in_vec, r, n, a.op, acc);
    finish_store(e, n, acc);
  }
}

// Slices p != r, units [lo, hi): member p's reduced data -> out.
template <typename T, int G>
__device__ __forceinline__ void GatherChunk(const P2pLaunch& a, const TwoShotGeometry& g,
                                            size_t lo, size_t hi) {
  constexpr int kE = Unit<T>::kElems;
  constexpr int kB = TwoShotBatch<G>();
  const int r = a.group_rank;
  T* out = static_cast<T*>(a.out);
  const bool out_vec = Aligned16(out);
  auto src = [&](int p) { return reinterpret_cast<const T*>(a.peers.data[p]); };
  size_t u = lo + g.first;
  if (out_vec) {
    for (; u + (kB - 1) * g.step < MinSize(hi, g.full); u += kB * g.step) {
      uint4 v[kB][G];
#pragma unroll
      for (int j = 0; j < kB; ++j)
#pragma unroll
        for (int p = 0; p < G; ++p)
          if (p != r)
            v[j][p] = __ldcg(reinterpret_cast<const uint4*>(src(p) + p * g.stride + (u + j * g.step) * kE));
#pragma unroll
      for (int j = 0; j < kB; ++j)
#pragma unroll
        for (int p = 0; p < G; ++p)
          if (p != r) *reinterpret_cast<uint4*>(out + p * g.stride + (u + j * g.step) * kE) = v[j][p];
    }
  }
  for (; u < hi; u += g.step) {
#pragma unroll
    for (int p = 0; p < G; ++p) {
      const size_t e = MinSize(a.count, p * g.stride) + u * kE;
      const size_t end = MinSize(a.count, (p + 1) * g.stride);
      if (p != r && e < end)
        CopyUnit<T>(src(p) + e, out + e, static_cast<int>(MinSize(kE, end - e)), out_vec);
    }
  }
}

template <typename T, int G>
__global__ void __launch_bounds__(kThreadsPerBlock, 2) TwoShotPipelinedKernel(P2pLaunch a) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  const TwoShotGeometry g = MakeTwoShotGeometry<T, G>(a);
  // Chunk: a multiple of the grid's step, so every chunk starts at a multiple
  // of step and thread t keeps the units congruent to t in every phase and chunk.
  const size_t chunk = (a.chunk_units + g.step - 1) / g.step * g.step;
  const size_t chunks = (g.units_per_slice + chunk - 1) / chunk;
  auto lo = [&](size_t c) { return c * chunk; };
  auto hi = [&](size_t c) { return MinSize(g.units_per_slice, (c + 1) * chunk); };

  // Step k: wait for barrier k - 1, fold chunk k - 2, gather chunk k - 3,
  // arrive at barrier k, push chunk k (each phase has one call site, so it is
  // inlined once). Chunk c is pushed in step c before barrier c + 1, folded in
  // step c + 2 after it, gathered in step c + 3 after barrier c + 2, which the
  // peers pass only after their fold of c. The push after the arrival runs
  // while the barrier's flags travel.
  // orders: every member has entered this call, so it is done with its
  // registered data (see "How it works": push mode)
  if (!GroupBarrier<G>(a, &failed)) return;
  uint32_t v = 0;
  for (size_t k = 0; k <= chunks + 2; ++k) {
    // barrier k - 1: the peers' PushChunk(k - 2) and FoldChunk(k - 3) are visible
    if (k >= 2 && !BarrierWait<G>(a, v, &failed)) return;
    if (k >= 2 && k - 2 < chunks) FoldChunk<T, G>(a, g, lo(k - 2), hi(k - 2));
    if (k >= 3) GatherChunk<T, G>(a, g, lo(k - 3), hi(k - 3));
    // barrier k releases PushChunk(k - 1) and FoldChunk(k - 2); the last one
    // (k = chunks + 2) ends the call: every member finished reading this
    // rank's slots and data before the next call writes them
    if (k >= 1) v = BarrierArrive<G>(a);
    if (k < chunks) PushChunk<T, G>(a, g, lo(k), hi(k));
  }
  BarrierWait<G>(a, v, &failed);
}

// Fold over groups (hierarchy step 2, after the exchange): local only.
template <typename T>
__global__ void __launch_bounds__(kThreadsPerBlock)
    FoldSourcesKernel(const T* src, int num_sources, T* dst, size_t count, ReduceOp op,
                      int divisor) {
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
