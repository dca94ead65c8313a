// p2p_bandwidth: raw NVLink bandwidth between GPU 0 and GPU 1 of one process,
// one way and both ways at once, for the three ways the allreduce kernels can
// move data: copy engine (cudaMemcpyPeerAsync), SM stores to the peer (push),
// SM loads from the peer (pull). The both-ways figure is the ceiling of a
// 2-GPU allreduce's busbw (each GPU sends and receives S bytes, see
// docs/PERFORMANCE.md "Pipelined two-shot"). Prints GB/s per direction.
// Usage: p2p_bandwidth [MiB per direction, default 256]
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

constexpr int kThreads = 512;
constexpr int kBatch = 4;  // 16-byte units in flight per thread, as the two-shot kernel

// dst[i] = src[i] in 16-byte units; either pointer may be the peer's.
__global__ void __launch_bounds__(kThreads) CopyKernel(const uint4* src, uint4* dst, size_t units) {
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t u = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  for (; u + (kBatch - 1) * step < units; u += kBatch * step) {
    uint4 v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) v[j] = __ldcg(src + u + j * step);
#pragma unroll
    for (int j = 0; j < kBatch; ++j) dst[u + j * step] = v[j];
  }
  for (; u < units; u += step) dst[u] = __ldcg(src + u);
}

}  // namespace

int main(int argc, char** argv) {
  const size_t bytes = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 256) << 20;
  const size_t units = bytes / 16;
  uint4 *a[2], *b[2];
  cudaStream_t s[2];
  for (int d = 0; d < 2; ++d) {
    Check(cudaSetDevice(d), "set device");
    Check(cudaDeviceEnablePeerAccess(1 - d, 0), "peer access");
    Check(cudaMalloc(&a[d], bytes), "malloc");
    Check(cudaMalloc(&b[d], bytes), "malloc");
    Check(cudaMemset(a[d], d + 1, bytes), "memset");
    Check(cudaStreamCreateWithFlags(&s[d], cudaStreamNonBlocking), "stream");
  }
  // op(d): device d's part of one transfer (d = 0 only for one way).
  auto run = [&](const char* name, int ways, int blocks, int mode) {
    auto op = [&](int d) {
      Check(cudaSetDevice(d), "set device");
      const int p = 1 - d;
      if (mode == 0) Check(cudaMemcpyPeerAsync(b[p], p, a[d], d, bytes, s[d]), "peer copy");
      else if (mode == 1) CopyKernel<<<blocks, kThreads, 0, s[d]>>>(a[d], b[p], units);   // push
      else CopyKernel<<<blocks, kThreads, 0, s[d]>>>(a[p], b[d], units);                  // pull
    };
    auto sync = [&] {
      for (int d = 0; d < 2; ++d) Check(cudaStreamSynchronize(s[d]), "sync");
    };
    for (int i = 0; i < 3; ++i)
      for (int d = 0; d < ways; ++d) op(d);
    sync();
    const int iters = 10;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i)
      for (int d = 0; d < ways; ++d) op(d);
    sync();
    Check(cudaGetLastError(), "launch");
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%-6s %-9s blocks %4d: %7.1f GB/s per direction\n", name, ways == 1 ? "one-way" : "both-ways",
                blocks, bytes * iters / sec / 1e9);
  };
  std::printf("# p2p_bandwidth: %zu MiB per direction, GPU 0 <-> GPU 1\n", bytes >> 20);
  for (int ways = 1; ways <= 2; ++ways) {
    run("copy", ways, 0, 0);
    for (int blocks : {64, 132, 264}) run("push", ways, blocks, 1);
    for (int blocks : {64, 132, 264}) run("pull", ways, blocks, 2);
  }
  return 0;
}
