// allreduce_perf: nccl-tests-style allreduce benchmark of the NV-group CUDA
// communicator against NCCL and host-staged MPI, in the same run, under mpirun
// (one rank per GPU; any number of ranks).
//
// Implementations (one nccl-tests table each):
//   nccl        ncclAllReduce (C API, dlopen'ed libnccl.so.2; the unique id is
//               broadcast over MPI), on user buffers;
//   nvgroup     Communicator::Allreduce on user buffers (the copy into the
//               registered buffer is fused into the kernel);
//   nvgroup-reg Communicator::Allreduce in place on registered_buffer(): what
//               the engine runs after fusing tensors there (in-place column);
//   mpi-host    D2H, MPI_Allreduce on the host, H2D (up to --mpi_max_bytes).
// Columns as nccl-tests: time is the mean per iteration after warmup (CUDA
// events on the stream), averaged over ranks; algbw = bytes / time (GB = 1e9
// bytes); busbw = algbw * 2 (n - 1) / n. #wrong counts elements off the float64
// host reference by more than the float32 rounding bound (inputs in [-1, 1));
// JSON also records, for nvgroup, the elements that differ bitwise from NCCL's
// result (0 expected for 2 ranks, where both compute a single rounded add).
//
// --sweep: instead of the tables, times nvgroup (out of place) for one-shot and
// two-shot at grid caps 4..128 over 8 B..64 MiB: the data behind the defaults
// in cc/device/communicator_setup_cuda.cc.
// --pipeline_sweep: instead of the tables, times the two-shot kernel on user
// buffers un-pipelined (chunk 0) against the pipelined kernel at chunks of
// 1..32 MiB per slice, grid caps 64/128/192, and NCCL, 16 MiB..--max_bytes;
// every configuration's result is checked element by element once (#wrong).
// --twoshot_chunk BYTES: the pipeline chunk for the tables (default: the
// communicator's; 0 = un-pipelined).
// --resnet FILE: also times the engine's data path for the gradient set in FILE
// (benchmarks/resnet50_gradients.txt): BatchedScaledCopy into the registered
// buffer, Average allreduce, BatchedScaledCopy out -- against one NCCL
// allreduce of the same bytes.
//
// Usage: mpirun -np 2 allreduce_perf [--min_bytes 8] [--max_bytes 1G]
//   [--nccl_lib libnccl.so.2] [--mpi_max_bytes 64M] [--json out.json]
//   [--sweep] [--pipeline_sweep] [--twoshot_chunk BYTES] [--resnet FILE]
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "device/cuda_communicator.h"
#include "tools/tool_common.h"
#include "topology/topology.h"

namespace nvgroup {
namespace tools {
namespace {

// ------------------------------------------------------------------ NCCL (dlopen)
// The few NCCL entry points and enum values we need, from nccl.h (2.x ABI).
struct NcclUniqueId {
  char internal[128];
};
using NcclComm = void*;
constexpr int kNcclFloat32 = 7;
constexpr int kNcclSum = 0;
constexpr int kNcclAvg = 4;

struct Nccl {
  int (*GetVersion)(int*) = nullptr;
  int (*GetUniqueId)(NcclUniqueId*) = nullptr;
  int (*CommInitRank)(NcclComm*, int, NcclUniqueId, int) = nullptr;
  int (*AllReduce)(const void*, void*, size_t, int, int, NcclComm, cudaStream_t) = nullptr;
  int (*CommDestroy)(NcclComm) = nullptr;
  const char* (*GetErrorString)(int) = nullptr;
  NcclComm comm = nullptr;
  int version = 0;

  void Check(int rc, const char* what) const {
    if (rc != 0) Die(std::string(what) + ": " + (GetErrorString ? GetErrorString(rc) : "?"));
  }
  void Load(const std::string& path) {
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (h == nullptr) Die("dlopen " + path + ": " + dlerror());
    auto sym = [&](const char* name) {
      void* p = dlsym(h, name);
      if (p == nullptr) Die(std::string("dlsym ") + name);
      return p;
    };
    GetVersion = reinterpret_cast<int (*)(int*)>(sym("ncclGetVersion"));
    GetUniqueId = reinterpret_cast<int (*)(NcclUniqueId*)>(sym("ncclGetUniqueId"));
    CommInitRank = reinterpret_cast<int (*)(NcclComm*, int, NcclUniqueId, int)>(sym("ncclCommInitRank"));
    AllReduce = reinterpret_cast<int (*)(const void*, void*, size_t, int, int, NcclComm, cudaStream_t)>(
        sym("ncclAllReduce"));
    CommDestroy = reinterpret_cast<int (*)(NcclComm)>(sym("ncclCommDestroy"));
    GetErrorString = reinterpret_cast<const char* (*)(int)>(sym("ncclGetErrorString"));
    Check(GetVersion(&version), "ncclGetVersion");
  }
  void Init(int rank, int size) {
    NcclUniqueId id;
    if (rank == 0) Check(GetUniqueId(&id), "ncclGetUniqueId");
    NVG_TOOL_MPI(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD));
    Check(CommInitRank(&comm, size, id, rank), "ncclCommInitRank");
  }
};

// ------------------------------------------------------------------ arguments

size_t ParseBytes(const std::string& s) {
  size_t mult = 1;
  std::string num = s;
  const char last = s.empty() ? '\0' : s.back();
  if (last == 'K' || last == 'M' || last == 'G') {
    mult = last == 'K' ? 1u << 10 : last == 'M' ? 1u << 20 : 1u << 30;
    num = s.substr(0, s.size() - 1);
  }
  return std::stoull(num) * mult;
}

struct Args {
  size_t min_bytes = 8;
  size_t max_bytes = 1u << 30;
  size_t mpi_max_bytes = 64u << 20;
  std::string nccl_lib = "libnccl.so.2";
  std::string json;
  std::string resnet;
  bool sweep = false;
  bool pipeline_sweep = false;
  long long twoshot_chunk = -1;  // -1: the communicator's default
};

Args ParseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) Die("missing value after " + s);
      return argv[++i];
    };
    if (s == "--min_bytes") a.min_bytes = ParseBytes(next());
    else if (s == "--max_bytes") a.max_bytes = ParseBytes(next());
    else if (s == "--mpi_max_bytes") a.mpi_max_bytes = ParseBytes(next());
    else if (s == "--nccl_lib") a.nccl_lib = next();
    else if (s == "--json") a.json = next();
    else if (s == "--resnet") a.resnet = next();
    else if (s == "--sweep") a.sweep = true;
    else if (s == "--pipeline_sweep") a.pipeline_sweep = true;
    else if (s == "--twoshot_chunk") a.twoshot_chunk = std::stoll(next());
    else Die("unknown argument " + s);
  }
  if (a.min_bytes < 4 || a.max_bytes < a.min_bytes) Die("need 4 <= min_bytes <= max_bytes");
  return a;
}

// ------------------------------------------------------------------ timing

struct Bench {
  int rank = 0, size = 1;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  Communicator* comm = nullptr;
  Nccl nccl;
};

// Iterations by size: enough to average out launch jitter, few for huge sizes.
void Iterations(size_t bytes, int* warmup, int* iters) {
  if (bytes <= (1u << 20)) {
    *warmup = 20;
    *iters = 200;
  } else if (bytes <= (64u << 20)) {
    *warmup = 5;
    *iters = 40;
  } else {
    *warmup = 2;
    *iters = 10;
  }
}

// Mean microseconds per call after warmup, averaged over ranks.
double Time(Bench& b, size_t bytes, const std::function<void()>& op, int iters_override = 0) {
  int warmup, iters;
  Iterations(bytes, &warmup, &iters);
  if (iters_override > 0) {
    iters = iters_override;
    warmup = std::min(warmup, 2);
  }
  for (int i = 0; i < warmup; ++i) op();
  CheckCuda(cudaStreamSynchronize(b.stream), "sync");
  NVG_TOOL_MPI(MPI_Barrier(MPI_COMM_WORLD));
  CheckCuda(cudaEventRecord(b.start, b.stream), "event");
  for (int i = 0; i < iters; ++i) op();
  CheckCuda(cudaEventRecord(b.stop, b.stream), "event");
  CheckCuda(cudaEventSynchronize(b.stop), "event sync");
  float ms = 0;
  CheckCuda(cudaEventElapsedTime(&ms, b.start, b.stop), "elapsed");
  double us = 1000.0 * ms / iters, sum = 0;
  NVG_TOOL_MPI(MPI_Allreduce(&us, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
  return sum / b.size;
}

// Calls per captured CUDA graph (even: keeps the one-shot staging parity).
constexpr int kGraphCalls = 20;

// Like Time, but `op` is captured kGraphCalls times into a CUDA graph that is
// replayed: the GPU-side latency without host launch overhead (nccl-tests -G).
double TimeGraph(Bench& b, size_t bytes, const std::function<void()>& op) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CheckCuda(cudaStreamBeginCapture(b.stream, cudaStreamCaptureModeRelaxed), "begin capture");
  for (int i = 0; i < kGraphCalls; ++i) op();
  CheckCuda(cudaStreamEndCapture(b.stream, &graph), "end capture");
  CheckCuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  const double us = Time(b, bytes, [&] { CheckCuda(cudaGraphLaunch(exec, b.stream), "graph launch"); }, 100);
  CheckCuda(cudaGraphExecDestroy(exec), "destroy");
  CheckCuda(cudaGraphDestroy(graph), "destroy");
  return us / kGraphCalls;
}

struct Row {
  std::string impl;
  size_t bytes = 0;
  double oop_us = -1, ip_us = -1;
  long long oop_wrong = 0, ip_wrong = 0;
  long long diff_vs_nccl = -1;
};

double AlgBw(size_t bytes, double us) { return us > 0 ? bytes / (us * 1e3) : 0; }
double BusBw(int n, size_t bytes, double us) { return AlgBw(bytes, us) * 2.0 * (n - 1) / n; }

// ------------------------------------------------------------------ data

// Input of `rank`, element i: float32 in [-1, 1) from the stateless hash.
float InputValue(int rank, size_t i) { return static_cast<float>(2.0 * Uniform(7, rank, i) - 1.0); }

struct Data {
  size_t max_count = 0;
  float* d_in = nullptr;
  float* d_out = nullptr;
  float* d_ref = nullptr;       // NCCL's out-of-place result of the current size
  std::vector<double> ref;      // float64 sum over ranks
  std::vector<float> host_in;   // own input
  std::vector<float> got, got_nccl;
  float* pinned = nullptr;      // mpi-host staging
};

void InitData(Bench& b, Data& d, size_t max_bytes) {
  d.max_count = max_bytes / sizeof(float);
  d.host_in.resize(d.max_count);
  d.ref.assign(d.max_count, 0.0);
  for (int r = 0; r < b.size; ++r)
    for (size_t i = 0; i < d.max_count; ++i) {
      const float x = InputValue(r, i);
      d.ref[i] += x;
      if (r == b.rank) d.host_in[i] = x;
    }
  CheckCuda(cudaMalloc(&d.d_in, max_bytes), "cudaMalloc");
  CheckCuda(cudaMalloc(&d.d_out, max_bytes), "cudaMalloc");
  CheckCuda(cudaMalloc(&d.d_ref, max_bytes), "cudaMalloc");
  CheckCuda(cudaMemcpy(d.d_in, d.host_in.data(), max_bytes, cudaMemcpyHostToDevice), "H2D");
  CheckCuda(cudaMallocHost(&d.pinned, max_bytes), "cudaMallocHost");
  CheckCuda(cudaDeviceSynchronize(), "sync");  // the pageable H2D may still be in flight
}

// Elements of `dev` (count floats) off the float64 reference by more than the
// bound of n-1 float32 adds of values in [-1, 1): (n + 1) * n * 2^-24.
long long CountWrong(Bench& b, Data& d, const float* dev, size_t count, std::vector<float>* host) {
  host->resize(count);
  CheckCuda(cudaMemcpy(host->data(), dev, count * sizeof(float), cudaMemcpyDeviceToHost), "D2H");
  const double bound = (b.size + 1.0) * b.size * std::ldexp(1.0, -24);
  long long wrong = 0;
  for (size_t i = 0; i < count; ++i)
    if (!(std::fabs((*host)[i] - d.ref[i]) <= bound)) ++wrong;
  long long sum = 0;
  NVG_TOOL_MPI(MPI_Allreduce(&wrong, &sum, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
  return sum;
}

void PrintHeader(const std::string& impl) {
  std::printf("#\n# %s\n", impl.c_str());
  std::printf(
      "#                                                      out-of-place                       in-place          \n");
  std::printf(
      "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n");
  std::printf(
      "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       \n");
}

void PrintRow(const Bench& b, const Row& r) {
  auto part = [&](double us, long long wrong) {
    if (us < 0) return std::string("        -       -       -      -");
    char buf[64];
    std::snprintf(buf, sizeof(buf), " %8.2f %7.2f %7.2f %6lld", us, AlgBw(r.bytes, us),
                  BusBw(b.size, r.bytes, us), wrong);
    return std::string(buf);
  };
  std::printf("%12zu  %12zu  %8s  %6s  %6d%s %s\n", r.bytes, r.bytes / 4, "float", "sum", -1,
              part(r.oop_us, r.oop_wrong).c_str(), part(r.ip_us, r.ip_wrong).c_str());
  std::fflush(stdout);
}

std::vector<size_t> Sizes(size_t lo, size_t hi) {
  std::vector<size_t> s;
  for (size_t x = lo; x <= hi; x *= 2) s.push_back(x);
  return s;
}

// ------------------------------------------------------------------ runs

std::vector<Row> RunTables(Bench& b, Data& d, const Args& a) {
  std::vector<Row> rows;
  const std::vector<size_t> sizes = Sizes(a.min_bytes, a.max_bytes);
  auto nv = [&](const void* in, void* out, size_t n) {
    Check(b.comm->Allreduce(in, out, n, DataType::kFloat32, ReduceOp::kSum, b.stream), "nvgroup allreduce");
  };
  auto nc = [&](const void* in, void* out, size_t n) {
    b.nccl.Check(b.nccl.AllReduce(in, out, n, kNcclFloat32, kNcclSum, b.nccl.comm, b.stream),
                 "ncclAllReduce");
  };
  // Fresh input in `buf` for an in-place verification run.
  auto restore = [&](void* buf, size_t bytes) {
    CheckCuda(cudaMemcpyAsync(buf, d.d_in, bytes, cudaMemcpyDeviceToDevice, b.stream), "D2D");
  };
  auto sync = [&]() { CheckCuda(cudaStreamSynchronize(b.stream), "sync"); };

  const char* impls[] = {"nccl", "nvgroup", "nvgroup-reg", "nccl-graph", "nvgroup-graph", "mpi-host"};
  for (const char* impl : impls) {
    const std::string name = impl;
    if (b.rank == 0) PrintHeader(name);
    for (size_t bytes : sizes) {
      const size_t n = bytes / 4;
      Row r;
      r.impl = name;
      r.bytes = bytes;
      if (name == "nccl") {
        r.oop_us = Time(b, bytes, [&] { nc(d.d_in, d.d_out, n); });
        nc(d.d_in, d.d_out, n);
        sync();
        r.oop_wrong = CountWrong(b, d, d.d_out, n, &d.got);
        r.ip_us = Time(b, bytes, [&] { nc(d.d_out, d.d_out, n); });
        restore(d.d_out, bytes);
        nc(d.d_out, d.d_out, n);
        sync();
        r.ip_wrong = CountWrong(b, d, d.d_out, n, &d.got);
      } else if (name == "nvgroup") {
        r.oop_us = Time(b, bytes, [&] { nv(d.d_in, d.d_out, n); });
        nv(d.d_in, d.d_out, n);
        nc(d.d_in, d.d_ref, n);
        sync();
        r.oop_wrong = CountWrong(b, d, d.d_out, n, &d.got);
        d.got_nccl.resize(n);
        CheckCuda(cudaMemcpy(d.got_nccl.data(), d.d_ref, bytes, cudaMemcpyDeviceToHost), "D2H");
        long long diff = 0;
        for (size_t i = 0; i < n; ++i) diff += std::memcmp(&d.got[i], &d.got_nccl[i], 4) != 0;
        NVG_TOOL_MPI(MPI_Allreduce(&diff, &r.diff_vs_nccl, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
        r.ip_us = Time(b, bytes, [&] { nv(d.d_out, d.d_out, n); });
        restore(d.d_out, bytes);
        nv(d.d_out, d.d_out, n);
        sync();
        r.ip_wrong = CountWrong(b, d, d.d_out, n, &d.got);
      } else if (name == "nvgroup-reg") {
        if (bytes > b.comm->registered_capacity()) continue;
        void* reg = b.comm->registered_buffer();
        r.ip_us = Time(b, bytes, [&] { nv(reg, reg, n); });
        restore(reg, bytes);
        nv(reg, reg, n);
        sync();
        r.ip_wrong = CountWrong(b, d, static_cast<float*>(reg), n, &d.got);
      } else if (name == "nccl-graph" || name == "nvgroup-graph") {
        if (bytes > (1u << 20)) continue;  // the latency band
        const bool ours = name == "nvgroup-graph";
        r.oop_us = TimeGraph(b, bytes, [&] { ours ? nv(d.d_in, d.d_out, n) : nc(d.d_in, d.d_out, n); });
        sync();
        r.oop_wrong = CountWrong(b, d, d.d_out, n, &d.got);  // the graph's last call
      } else {  // mpi-host
        if (bytes > a.mpi_max_bytes) continue;
        auto op = [&] {
          CheckCuda(cudaMemcpyAsync(d.pinned, d.d_in, bytes, cudaMemcpyDeviceToHost, b.stream), "D2H");
          CheckCuda(cudaStreamSynchronize(b.stream), "sync");
          NVG_TOOL_MPI(MPI_Allreduce(MPI_IN_PLACE, d.pinned, static_cast<int>(n), MPI_FLOAT, MPI_SUM,
                                     MPI_COMM_WORLD));
          CheckCuda(cudaMemcpyAsync(d.d_out, d.pinned, bytes, cudaMemcpyHostToDevice, b.stream), "H2D");
        };
        r.oop_us = Time(b, bytes, op, bytes > (1u << 20) ? 5 : 0);
        op();
        sync();
        r.oop_wrong = CountWrong(b, d, d.d_out, n, &d.got);
      }
      if (b.rank == 0) PrintRow(b, r);
      rows.push_back(r);
    }
  }
  return rows;
}

struct SweepPoint {
  size_t bytes;
  std::string kernel;
  int blocks;
  double us;
  size_t chunk_bytes = 0;  // pipeline sweep: two-shot chunk per slice
  long long wrong = 0;     // pipeline sweep: elements off the reference
};

std::vector<SweepPoint> RunSweep(Bench& b, Data& d) {
  std::vector<SweepPoint> pts;
  const int blocks[] = {8, 16, 32, 48, 64, 96, 128, 192, 256};
  if (b.rank == 0) std::printf("# sweep: nvgroup out-of-place, us per call\n#%11s %8s", "bytes", "kernel");
  if (b.rank == 0)
    for (int bl : blocks) std::printf(" %7d", bl);
  if (b.rank == 0) std::printf("\n");
  for (size_t bytes : Sizes(8, 256u << 20)) {
    if ((bytes & (bytes - 1)) != 0) continue;
    const bool dense = bytes >= (256u << 10) && bytes <= (64u << 20);  // elsewhere every 16x
    if (!dense && bytes != 8 && bytes != 128 && bytes != 2048 && bytes != 32768 && bytes != (256u << 20))
      continue;
    for (int one = 1; one >= 0; --one) {
      if (one && bytes > (16u << 20)) continue;
      if (b.rank == 0) std::printf("%12zu %8s", bytes, one ? "one" : "two");
      for (int bl : blocks) {
        Check(SetCudaKernelTuning(b.comm, one ? (16u << 20) : 0, bl, bl), "tuning");
        const size_t n = bytes / 4;
        const double us = Time(b, bytes, [&] {
          Check(b.comm->Allreduce(d.d_in, d.d_out, n, DataType::kFloat32, ReduceOp::kSum, b.stream),
                "allreduce");
        });
        pts.push_back({bytes, one ? "oneshot" : "twoshot", bl, us});
        if (b.rank == 0) std::printf(" %7.2f", us);
      }
      if (b.rank == 0) std::printf("\n");
      std::fflush(stdout);
    }
  }
  return pts;
}

// Two-shot on user buffers, un-pipelined vs pipelined chunks, and NCCL. Leaves
// the communicator's tuning at its defaults for the grid and one-shot limit.
std::vector<SweepPoint> RunPipelineSweep(Bench& b, Data& d, const Args& a, long long* wrong) {
  std::vector<SweepPoint> pts;
  const size_t chunks[] = {0, 1u << 20, 2u << 20, 4u << 20, 8u << 20, 16u << 20, 32u << 20};
  const int blocks[] = {64, 128, 192};
  if (b.rank == 0) {
    std::printf("# pipeline sweep: two-shot on user buffers, us per call (busbw GB/s); chunk per slice\n");
    std::printf("#%11s %9s %10s", "bytes", "nccl", "chunk");
    for (int bl : blocks) std::printf("  %7s@%-3d", "us", bl);
    std::printf("  best_bw  wrong\n");
  }
  for (size_t bytes = 16u << 20; bytes <= a.max_bytes; bytes *= 2) {
    const size_t n = bytes / 4;
    const double nccl_us = Time(b, bytes, [&] {
      b.nccl.Check(b.nccl.AllReduce(d.d_in, d.d_out, n, kNcclFloat32, kNcclSum, b.nccl.comm, b.stream),
                   "ncclAllReduce");
    });
    pts.push_back({bytes, "nccl", 0, nccl_us});
    for (size_t chunk : chunks) {
      if (b.rank == 0) std::printf("%12zu %9.2f %9zuK", bytes, nccl_us, chunk >> 10);
      double best = 1e30;
      long long row_wrong = 0;
      for (int bl : blocks) {
        Check(SetCudaKernelTuning(b.comm, 0, bl, bl), "tuning");
        Check(SetCudaTwoShotChunk(b.comm, chunk), "chunk");
        auto op = [&] {
          Check(b.comm->Allreduce(d.d_in, d.d_out, n, DataType::kFloat32, ReduceOp::kSum, b.stream),
                "allreduce");
        };
        const double us = Time(b, bytes, op);
        CheckCuda(cudaMemsetAsync(d.d_out, 0xff, bytes, b.stream), "poison");
        op();
        CheckCuda(cudaStreamSynchronize(b.stream), "sync");
        const long long w = CountWrong(b, d, d.d_out, n, &d.got);
        row_wrong += w;
        best = std::min(best, us);
        pts.push_back({bytes, chunk == 0 ? "twoshot" : "pipelined", bl, us, chunk, w});
        if (b.rank == 0) std::printf("  %11.2f", us);
      }
      *wrong += row_wrong;
      if (b.rank == 0) std::printf("  %7.1f  %5lld\n", BusBw(b.size, bytes, best), row_wrong);
      std::fflush(stdout);
    }
  }
  return pts;
}

struct ResnetResult {
  int tensors = 0;
  size_t elements = 0;
  double fused_us = 0, allreduce_only_us = 0, nccl_us = 0;
  long long wrong = 0;
};

// Engine data path on the gradient set: copy in (one launch) + Average + copy out.
ResnetResult RunResnet(Bench& b, Data& d, const std::string& file) {
  ResnetResult res;
  std::ifstream in(file);
  if (!in) Die("cannot read " + file);
  std::vector<size_t> counts;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ss(line);
    size_t idx, n;
    ss >> idx >> n;
    counts.push_back(n);
  }
  res.tensors = static_cast<int>(counts.size());
  std::vector<size_t> offsets;
  size_t total = 0;
  for (size_t n : counts) {
    offsets.push_back(total);
    total += (n + 3) / 4 * 4;  // 16-byte padding per tensor, as Horovod fuses
    res.elements += n;
  }
  if (total * 4 > b.comm->registered_capacity() || total > d.max_count) Die("gradient set too large");
  char* reg = static_cast<char*>(b.comm->registered_buffer());
  std::vector<Communicator::CopySpec> in_specs, out_specs;
  // Tensors: consecutive slices of the input / output buffers, at their padded
  // offsets (distinct allocations would not change the copy kernel's work).
  for (size_t t = 0; t < counts.size(); ++t) {
    in_specs.push_back({d.d_in + offsets[t], reg + offsets[t] * 4, counts[t]});
    out_specs.push_back({reg + offsets[t] * 4, d.d_out + offsets[t], counts[t]});
  }
  const size_t bytes = total * 4;
  auto step = [&] {
    Check(b.comm->BatchedScaledCopy(in_specs.data(), in_specs.size(), DataType::kFloat32, 1.0, b.stream),
          "copy in");
    Check(b.comm->Allreduce(reg, reg, total, DataType::kFloat32, ReduceOp::kAverage, b.stream), "allreduce");
    Check(b.comm->BatchedScaledCopy(out_specs.data(), out_specs.size(), DataType::kFloat32, 1.0, b.stream),
          "copy out");
  };
  res.fused_us = Time(b, bytes, step, 50);
  res.allreduce_only_us = Time(b, bytes, [&] {
    Check(b.comm->Allreduce(reg, reg, total, DataType::kFloat32, ReduceOp::kAverage, b.stream), "allreduce");
  }, 50);
  res.nccl_us = Time(b, bytes, [&] {
    b.nccl.Check(b.nccl.AllReduce(d.d_in, d.d_ref, total, kNcclFloat32, kNcclAvg, b.nccl.comm, b.stream),
                 "nccl");
  }, 50);
  // Verify one step: every tensor's elements against the float64 reference / n.
  CheckCuda(cudaMemset(d.d_out, 0xff, bytes), "poison");
  step();
  CheckCuda(cudaStreamSynchronize(b.stream), "sync");
  std::vector<float> got(total);
  CheckCuda(cudaMemcpy(got.data(), d.d_out, bytes, cudaMemcpyDeviceToHost), "D2H");
  const double bound = (b.size + 2.0) * std::ldexp(1.0, -24);
  long long wrong = 0;
  for (size_t t = 0; t < counts.size(); ++t)
    for (size_t i = offsets[t]; i < offsets[t] + counts[t]; ++i)
      if (!(std::fabs(got[i] - d.ref[i] / b.size) <= bound)) ++wrong;
  NVG_TOOL_MPI(MPI_Allreduce(&wrong, &res.wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
  return res;
}

void WriteJson(const Bench& b, const Args& a, const std::string& gpu, const std::vector<Row>& rows,
               const std::vector<SweepPoint>& sweep, const ResnetResult* resnet) {
  std::ofstream o(a.json);
  char date[64];
  std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const Topology& t = b.comm->topology();
  o << "{\n  \"date\": \"" << date << "\",\n  \"gpu\": \"" << gpu << "\",\n  \"nranks\": " << b.size
    << ",\n  \"group_size\": " << t.group_size << ",\n  \"group_count\": " << t.group_count
    << ",\n  \"nccl_version\": " << b.nccl.version << ",\n  \"dtype\": \"float32\", \"op\": \"sum\",\n";
  o << "  \"results\": [\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    o << "    {\"impl\": \"" << r.impl << "\", \"bytes\": " << r.bytes << ", \"oop_us\": " << r.oop_us
      << ", \"oop_busbw\": " << (r.oop_us > 0 ? BusBw(b.size, r.bytes, r.oop_us) : 0)
      << ", \"oop_wrong\": " << r.oop_wrong << ", \"ip_us\": " << r.ip_us
      << ", \"ip_busbw\": " << (r.ip_us > 0 ? BusBw(b.size, r.bytes, r.ip_us) : 0)
      << ", \"ip_wrong\": " << r.ip_wrong << ", \"diff_vs_nccl\": " << r.diff_vs_nccl << "}"
      << (i + 1 < rows.size() ? "," : "") << "\n";
  }
  o << "  ],\n  \"sweep\": [\n";
  for (size_t i = 0; i < sweep.size(); ++i)
    o << "    {\"bytes\": " << sweep[i].bytes << ", \"kernel\": \"" << sweep[i].kernel
      << "\", \"blocks\": " << sweep[i].blocks << ", \"us\": " << sweep[i].us
      << ", \"chunk_bytes\": " << sweep[i].chunk_bytes << ", \"wrong\": " << sweep[i].wrong << "}"
      << (i + 1 < sweep.size() ? "," : "") << "\n";
  o << "  ]";
  if (resnet != nullptr)
    o << ",\n  \"resnet50\": {\"tensors\": " << resnet->tensors << ", \"elements\": " << resnet->elements
      << ", \"fused_step_us\": " << resnet->fused_us
      << ", \"allreduce_only_us\": " << resnet->allreduce_only_us << ", \"nccl_us\": " << resnet->nccl_us
      << ", \"wrong\": " << resnet->wrong << "}";
  o << "\n}\n";
}

}  // namespace
}  // namespace tools
}  // namespace nvgroup

int main(int argc, char** argv) {
  using namespace nvgroup;
  using namespace nvgroup::tools;
  int provided = 0;
  NVG_TOOL_MPI(MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided));
  Args a = ParseArgs(argc, argv);
  Bench b;
  NVG_TOOL_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &b.rank));
  NVG_TOOL_MPI(MPI_Comm_size(MPI_COMM_WORLD, &b.size));
  Topology host;
  TopologyComms comms;
  Check(SplitNodes(MPI_COMM_WORLD, &host, &comms), "SplitNodes");
  CommunicatorOptions opt;
  opt.registered_bytes = std::max<size_t>(a.max_bytes, 64u << 20);
  auto created = CreateCudaCommunicator(MPI_COMM_WORLD, -1, EnvironmentKnobs(), opt, host);
  Check(created.status(), "CreateCudaCommunicator");
  std::unique_ptr<Communicator> comm = created.consume();
  b.comm = comm.get();
  CheckCuda(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking), "stream");
  CheckCuda(cudaEventCreate(&b.start), "event");
  CheckCuda(cudaEventCreate(&b.stop), "event");
  b.nccl.Load(a.nccl_lib);
  b.nccl.Init(b.rank, b.size);

  const int dev = comm->device().ordinal;
  cudaDeviceProp prop;
  CheckCuda(cudaGetDeviceProperties(&prop, dev), "props");
  char bus[32] = {}, host_name[64] = {};
  cudaDeviceGetPCIBusId(bus, sizeof(bus), dev);
  gethostname(host_name, sizeof(host_name) - 1);
  const Topology& t = comm->topology();
  if (b.rank == 0)
    std::printf("# nvgroup allreduce_perf: nranks %d, %d NV-group(s) of %d, NCCL %d, float32 sum\n", b.size,
                t.group_count, t.group_size, b.nccl.version);
  NVG_TOOL_MPI(MPI_Barrier(MPI_COMM_WORLD));
  for (int r = 0; r < b.size; ++r) {
    if (r == b.rank)
      std::printf("#  Rank %2d Group %2d Pid %6d on %10s device %2d [%s] %s\n", b.rank, t.group_index,
                  static_cast<int>(getpid()), host_name, dev, bus, prop.name);
    std::fflush(stdout);
    NVG_TOOL_MPI(MPI_Barrier(MPI_COMM_WORLD));
  }

  Data d;
  InitData(b, d, a.max_bytes);
  std::vector<Row> rows;
  std::vector<SweepPoint> sweep;
  ResnetResult resnet;
  const bool have_resnet = !a.resnet.empty();
  long long wrong = 0;
  if (a.twoshot_chunk >= 0) Check(SetCudaTwoShotChunk(b.comm, static_cast<size_t>(a.twoshot_chunk)), "chunk");
  if (a.sweep) {
    sweep = RunSweep(b, d);
  } else if (a.pipeline_sweep) {
    sweep = RunPipelineSweep(b, d, a, &wrong);
    if (b.rank == 0)
      std::printf("# pipeline sweep: %lld wrong elements %s\n", wrong, wrong == 0 ? "OK" : "FAILED");
  } else {
    rows = RunTables(b, d, a);
    if (have_resnet) resnet = RunResnet(b, d, a.resnet);
    for (const Row& r : rows) wrong += r.oop_wrong + r.ip_wrong;
    wrong += resnet.wrong;
    if (b.rank == 0) {
      std::printf("# Out of bounds values : %lld %s\n", wrong, wrong == 0 ? "OK" : "FAILED");
      // Summary: NV-group against NCCL, same run.
      std::printf(
          "#\n# summary (out-of-place, float32 sum): time us, busbw GB/s, ratio = NCCL/nvgroup time\n");
      std::printf("#%11s %9s %9s %6s %8s %8s %8s %8s %8s %10s\n", "bytes", "nccl_us", "nvg_us", "ratio",
                  "ncclG_us", "nvgG_us", "nccl_bw", "nvg_bw", "nvgreg_bw", "diff_nccl");
      for (const Row& r : rows) {
        if (r.impl != "nvgroup") continue;
        const Row* n = nullptr;
        const Row* g = nullptr;
        double ng = -1, vg = -1;
        for (const Row& x : rows) {
          if (x.bytes != r.bytes) continue;
          if (x.impl == "nccl") n = &x;
          if (x.impl == "nvgroup-reg") g = &x;
          if (x.impl == "nccl-graph") ng = x.oop_us;
          if (x.impl == "nvgroup-graph") vg = x.oop_us;
        }
        if (n == nullptr) continue;
        std::printf("%12zu %9.2f %9.2f %6.2f %8.2f %8.2f %8.1f %8.1f %8.1f %10lld\n", r.bytes, n->oop_us,
                    r.oop_us, n->oop_us / r.oop_us, ng, vg, BusBw(b.size, r.bytes, n->oop_us),
                    BusBw(b.size, r.bytes, r.oop_us), g != nullptr ? BusBw(b.size, r.bytes, g->ip_us) : 0.0,
                    r.diff_vs_nccl);
      }
      if (have_resnet)
        std::printf(
            "# resnet50 gradients (%d tensors, %zu floats): fused step %.1f us (allreduce %.1f us) "
            "vs NCCL %.1f us, wrong %lld\n",
            resnet.tensors, resnet.elements, resnet.fused_us, resnet.allreduce_only_us, resnet.nccl_us,
            resnet.wrong);
    }
  }
  if (b.rank == 0 && !a.json.empty())
    WriteJson(b, a, prop.name, rows, sweep, have_resnet ? &resnet : nullptr);
  comm.reset();
  b.nccl.Check(b.nccl.CommDestroy(b.nccl.comm), "ncclCommDestroy");
  NVG_TOOL_MPI(MPI_Finalize());
  return wrong == 0 ? 0 : 1;
}
