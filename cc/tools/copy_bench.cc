// copy_bench: the fusion copy kernel (LaunchBatchedScaledCopy,
// cc/kernels/batched_copy.cu) against cudaMemcpyAsync of the same bytes, on
// one GPU, for a model's gradient set (one descriptor per gradient, each
// tensor 256-byte aligned as TF allocates them).
//
// Timed per launch with CUDA events on one stream, REPS launches per mode
// after one warm-up, median and minimum in microseconds; bandwidth is the
// bytes copied per second (each byte is read once and written once):
//   memcpy       one cudaMemcpyAsync of the whole arena (the copy engine's
//                ceiling for this many bytes; includes the alignment gaps)
//   memcpy_each  one cudaMemcpyAsync per gradient
//   batched      one batched copy of every gradient, scale 1 (bits moved)
//   scaled       the same with scale 0.5 on fp32 (the postscale of Average)
// Checks: after `batched` every byte of every gradient equals its source;
// after `scaled` every element equals the float product src * 0.5f computed
// here (finite random inputs); `wrong` counts mismatches.
// Usage: copy_bench GRADIENT_TABLE [reps]    (no MPI: one process, cuda:0)
#include <cuda_runtime.h>
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "tools/tool_common.h"

namespace {

using namespace nvgroup;
using namespace nvgroup::tools;

struct Times {
  double median_us, min_us;
};

template <typename F>
Times TimeLaunches(int reps, cudaStream_t stream, F launch) {
  cudaEvent_t start, stop;
  CheckCuda(cudaEventCreate(&start), "cudaEventCreate");
  CheckCuda(cudaEventCreate(&stop), "cudaEventCreate");
  launch();  // warm-up (and the kernel's resident-grid query)
  CheckCuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  std::vector<double> us;
  for (int r = 0; r < reps; ++r) {
    CheckCuda(cudaEventRecord(start, stream), "cudaEventRecord");
    launch();
    CheckCuda(cudaEventRecord(stop, stream), "cudaEventRecord");
    CheckCuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    CheckCuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    us.push_back(ms * 1e3);
  }
  CheckCuda(cudaEventDestroy(start), "cudaEventDestroy");
  CheckCuda(cudaEventDestroy(stop), "cudaEventDestroy");
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], us.front()};
}

}  // namespace

int main(int argc, char** argv) {
  // tool_common's Die reports through MPI; one process is its own world.
  NVG_TOOL_MPI(MPI_Init(&argc, &argv));
  if (argc < 2) Die("usage: copy_bench GRADIENT_TABLE [reps]");
  int reps = 50;
  if (argc > 2) {
    char* end = nullptr;
    const long parsed = std::strtol(argv[2], &end, 10);
    if (end == argv[2] || *end != '\0' || parsed < 1 || parsed > 100000)
      Die(std::string("reps must be a whole number in 1..100000, not '") + argv[2] + "'");
    reps = static_cast<int>(parsed);
  }
  std::ifstream table(argv[1]);
  if (!table) Die(std::string("cannot read ") + argv[1]);
  std::vector<size_t> counts;
  for (std::string line; std::getline(table, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    size_t index = 0, elements = 0;
    if (!(fields >> index >> elements)) Die("malformed line: " + line);
    counts.push_back(elements);
  }
  if (counts.empty()) Die("no gradients in the table");

  std::vector<size_t> offsets;  // bytes, 256-aligned
  size_t arena = 0, payload = 0;
  for (size_t c : counts) {
    offsets.push_back(arena);
    arena += (c * sizeof(float) + 255) / 256 * 256;
    payload += c * sizeof(float);
  }
  CheckCuda(cudaSetDevice(0), "cudaSetDevice");
  cudaStream_t stream;
  CheckCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  char *src = nullptr, *dst = nullptr;
  CheckCuda(cudaMalloc(&src, arena), "cudaMalloc");
  CheckCuda(cudaMalloc(&dst, arena), "cudaMalloc");

  // Finite random floats in [-1, 1) (the scaled check's reference is exact).
  std::vector<float> host(arena / sizeof(float));
  std::mt19937 gen(12345);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float& x : host) x = dist(gen);
  CheckCuda(cudaMemcpy(src, host.data(), arena, cudaMemcpyHostToDevice), "cudaMemcpy H2D");

  std::vector<DeviceCopySpec> specs;
  size_t ranges = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    specs.push_back({src + offsets[i], dst + offsets[i], counts[i], ranges});
    ranges += CopyBlocksFor(counts[i]);
  }
  DeviceCopySpec* device_specs = nullptr;
  CheckCuda(cudaMalloc(&device_specs, specs.size() * sizeof(DeviceCopySpec)), "cudaMalloc");
  CheckCuda(cudaMemcpy(device_specs, specs.data(), specs.size() * sizeof(DeviceCopySpec),
                       cudaMemcpyHostToDevice),
            "cudaMemcpy specs");

  const Times memcpy_all = TimeLaunches(reps, stream, [&] {
    CheckCuda(cudaMemcpyAsync(dst, src, arena, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
  });
  const Times memcpy_each = TimeLaunches(reps, stream, [&] {
    for (size_t i = 0; i < counts.size(); ++i)
      CheckCuda(cudaMemcpyAsync(dst + offsets[i], src + offsets[i], counts[i] * sizeof(float),
                                cudaMemcpyDeviceToDevice, stream),
                "cudaMemcpyAsync");
  });

  // The checks: bits after the unscaled copy, exact products after the scaled one.
  std::vector<float> back(host.size());
  long long wrong = 0;
  auto check = [&](float factor) {
    CheckCuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    CheckCuda(cudaMemcpy(back.data(), dst, arena, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    for (size_t i = 0; i < counts.size(); ++i) {
      const float* s = host.data() + offsets[i] / sizeof(float);
      const float* d = back.data() + offsets[i] / sizeof(float);
      for (size_t k = 0; k < counts[i]; ++k) {
        const float want = factor == 1.0f ? s[k] : s[k] * factor;
        if (std::memcmp(&want, &d[k], sizeof(float)) != 0) ++wrong;
      }
    }
  };
  CheckCuda(cudaMemset(dst, 0, arena), "cudaMemset");
  const Times batched = TimeLaunches(reps, stream, [&] {
    Check(LaunchBatchedScaledCopy(device_specs, specs.size(), ranges, DataType::kFloat32, 1.0, stream),
          "batched copy");
  });
  check(1.0f);
  CheckCuda(cudaMemset(dst, 0, arena), "cudaMemset");
  const Times scaled = TimeLaunches(reps, stream, [&] {
    Check(LaunchBatchedScaledCopy(device_specs, specs.size(), ranges, DataType::kFloat32, 0.5, stream),
          "scaled copy");
  });
  check(0.5f);

  cudaDeviceProp prop;
  CheckCuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  auto gbps = [&](size_t bytes, double us) { return bytes / us / 1e3; };
  std::printf("# copy_bench %s: %zu gradients, %zu bytes (%zu with alignment), %zu ranges, %d reps, %s\n",
              argv[1], counts.size(), payload, arena, ranges, reps, prop.name);
  std::printf("%-12s %10s %10s %10s\n", "mode", "median_us", "min_us", "GB/s");
  std::printf("%-12s %10.1f %10.1f %10.0f\n", "memcpy", memcpy_all.median_us, memcpy_all.min_us,
              gbps(arena, memcpy_all.median_us));
  std::printf("%-12s %10.1f %10.1f %10.0f\n", "memcpy_each", memcpy_each.median_us, memcpy_each.min_us,
              gbps(payload, memcpy_each.median_us));
  std::printf("%-12s %10.1f %10.1f %10.0f\n", "batched", batched.median_us, batched.min_us,
              gbps(payload, batched.median_us));
  std::printf("%-12s %10.1f %10.1f %10.0f\n", "scaled", scaled.median_us, scaled.min_us,
              gbps(payload, scaled.median_us));
  std::printf(
      "{\"bench\":\"copy_bench\",\"gpu\":\"%s\",\"bytes\":%zu,\"memcpy_us\":%.2f,\"memcpy_each_us\":%.2f,"
      "\"batched_us\":%.2f,\"scaled_us\":%.2f,\"wrong\":%lld}\n",
      prop.name, payload, memcpy_all.median_us, memcpy_each.median_us, batched.median_us, scaled.median_us,
      wrong);
  std::printf("wrong %lld\n", wrong);
  CheckCuda(cudaFree(device_specs), "cudaFree");
  CheckCuda(cudaFree(src), "cudaFree");
  CheckCuda(cudaFree(dst), "cudaFree");
  NVG_TOOL_MPI(MPI_Finalize());
  return wrong == 0 ? 0 : 1;
}
