// cross_step_bench: the cross-group step of the CUDA communicator (CrossExchange:
// reduce-scatter + allgather among the peers, host-staged through double-buffered
// pinned memory unless MPI is CUDA-aware) checked and timed against the naive
// host-staged allreduce of the same bytes (D2H, MPI_Allreduce, H2D).
//
// Meant for one GPU shared by 2-4 ranks as groups of one, so every byte goes
// through the cross step:
//   NVGROUP_GROUP_SIZE=1 mpirun -np 4 -x NVGROUP_GROUP_SIZE build/tools/cross_step_bench
// (works on any layout: with several GPUs per group it times the whole hierarchy).
//
// Per size (float32 Sum, 1 MiB .. --max_bytes): random inputs regenerated from a
// hash, the result checked EVERY element bitwise against the host fold in the
// communicator's order (tool_common.h ExpectedResult) and against a float64
// reference within the float32 rounding bound; all ranks' results hashed and
// compared; the bytes the process posted in cross exchanges compared with the
// reduce-scatter + allgather ideal 2 (P-1)/P of each slice. Then the mean time
// of --iters calls after --warmup calls (stream-synchronized, max over ranks)
// for `nvgroup` (Communicator::Allreduce, out of place) and `staged-mpi` (D2H
// into pinned memory, MPI_Allreduce in place, H2D). One table line per size and
// optional JSON (--json FILE). Exit code 0 only if every check passed.
#include <cuda_runtime.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>
#endif

#include "algorithms/cross_exchange.h"
#include "device/cuda_communicator.h"
#include "tools/tool_common.h"
#include "topology/topology.h"

namespace nvgroup {
namespace tools {
namespace {

struct Row {
  size_t bytes = 0;
  double nvgroup_us = 0, staged_us = 0;
  long long wrong = 0, not_bitwise = 0, ranks_differ = 0;
  double cross_bytes = 0, ideal_cross_bytes = 0;
};

double MaxOverRanks(double v) {
  double m = 0;
  NVG_TOOL_MPI(MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
  return m;
}

}  // namespace
}  // namespace tools
}  // namespace nvgroup

int main(int argc, char** argv) {
  using namespace nvgroup;
  using namespace nvgroup::tools;
  int provided = 0;
  NVG_TOOL_MPI(MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided));
  size_t max_bytes = 256u << 20;
  int iters = 20, warmup = 5;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) Die("missing value after " + s);
      return argv[++i];
    };
    if (s == "--max_bytes") max_bytes = std::stoull(next());
    else if (s == "--iters") iters = std::stoi(next());
    else if (s == "--warmup") warmup = std::stoi(next());
    else if (s == "--json") json = next();
    else Die("unknown flag " + s + " (--max_bytes N --iters N --warmup N --json FILE)");
  }
  Topology host;
  TopologyComms comms;
  Check(SplitNodes(MPI_COMM_WORLD, &host, &comms), "SplitNodes");
  Knobs knobs = EnvironmentKnobs();
  knobs.peer_timeout_s = 60;
  CommunicatorOptions opt;
  opt.registered_bytes = 64u << 20;
  auto created = CreateCudaCommunicator(MPI_COMM_WORLD, -1, knobs, opt, host);
  Check(created.status(), "CreateCudaCommunicator");
  std::unique_ptr<Communicator> comm = created.consume();
  const Topology& t = comm->topology();
  const Layout layout = GatherLayout(t);
  const bool hierarchical = t.group_count > 1;
  int cuda_aware = 0;  // the communicator's own test (MpiIsCudaAware in cuda_communicator_setup_cuda.cc)
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  cuda_aware = MPIX_Query_cuda_support();
#endif
  if (t.rank == 0)
    std::printf("# cross_step_bench: %d ranks, %d groups of %d, MPI_THREAD_MULTIPLE=%d, cross step %s\n",
                t.size, t.group_count, t.group_size, provided == MPI_THREAD_MULTIPLE,
                cuda_aware ? "on device buffers (CUDA-aware MPI)" : "host-staged (pinned, double-buffered)");
  cudaStream_t stream = nullptr;
  CheckCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  float *d_in = nullptr, *d_out = nullptr, *pinned = nullptr;
  CheckCuda(cudaMalloc(&d_in, max_bytes), "cudaMalloc");
  CheckCuda(cudaMalloc(&d_out, max_bytes), "cudaMalloc");
  CheckCuda(cudaMallocHost(&pinned, max_bytes), "cudaMallocHost");
  const size_t chunk_bytes = knobs.pipeline_chunk;  // the communicator's chunk; only for the ideal count

  std::vector<Row> rows;
  bool ok = true;
  for (size_t bytes = 1u << 20; bytes <= max_bytes; bytes *= 4) {
    Row r;
    r.bytes = bytes;
    const size_t count = bytes / sizeof(float);
    std::vector<std::vector<char>> inputs(t.size, std::vector<char>(bytes));
    for (int k = 0; k < t.size; ++k)
      FillInput(14, k, DataType::kFloat32, ReduceOp::kSum, count, inputs[k].data());
    std::vector<char> expected;
    ExpectedResult(layout, hierarchical, DataType::kFloat32, ReduceOp::kSum, inputs, count, &expected);
    CheckCuda(cudaMemcpy(d_in, inputs[t.rank].data(), bytes, cudaMemcpyHostToDevice), "H2D input");
    CheckCuda(cudaMemset(d_out, 0xFF, bytes), "poison");
    const uint64_t before = CrossExchange::BytesSent();
    Check(comm->Allreduce(d_in, d_out, count, DataType::kFloat32, ReduceOp::kSum, stream), "Allreduce");
    CheckCuda(cudaStreamSynchronize(stream), "sync");
    r.cross_bytes = static_cast<double>(CrossExchange::BytesSent() - before);
    if (hierarchical) {  // per chunk: slice = chunk / G, 2 (P-1)/P of it
      const double p = t.group_count;
      r.ideal_cross_bytes = 2 * (p - 1) / p * static_cast<double>(bytes) / t.group_size;
    }
    std::vector<float> got(count);
    CheckCuda(cudaMemcpy(got.data(), d_out, bytes, cudaMemcpyDeviceToHost), "D2H result");
    const float* want = reinterpret_cast<const float*>(expected.data());
    for (size_t i = 0; i < count; ++i) {
      double ref = 0, mag = 0;
      for (int k = 0; k < t.size; ++k) {
        const double x = reinterpret_cast<const float*>(inputs[k].data())[i];
        ref += x;
        mag += std::fabs(x);
      }
      if (!(std::fabs(got[i] - ref) <= mag * (t.size + 1) * UnitRoundoff(DataType::kFloat32))) ++r.wrong;
      if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) ++r.not_bitwise;
    }
    uint64_t h = HashBytes(got.data(), bytes), h0 = h;
    NVG_TOOL_MPI(MPI_Bcast(&h0, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD));
    long long differs = h != h0, wrong = r.wrong, nb = r.not_bitwise;
    NVG_TOOL_MPI(MPI_Allreduce(&differs, &r.ranks_differ, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
    NVG_TOOL_MPI(MPI_Allreduce(&wrong, &r.wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
    NVG_TOOL_MPI(MPI_Allreduce(&nb, &r.not_bitwise, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
    const bool bytes_ok = !hierarchical || std::fabs(r.cross_bytes - r.ideal_cross_bytes) <=
                                               0.01 * r.ideal_cross_bytes + 64.0 * (bytes / chunk_bytes + 1);
    ok = ok && r.wrong == 0 && r.not_bitwise == 0 && r.ranks_differ == 0 && bytes_ok;

    auto time_it = [&](auto&& body) {
      for (int k = 0; k < warmup; ++k) body();
      CheckCuda(cudaStreamSynchronize(stream), "sync");
      NVG_TOOL_MPI(MPI_Barrier(MPI_COMM_WORLD));
      const double t0 = MPI_Wtime();
      for (int k = 0; k < iters; ++k) body();
      CheckCuda(cudaStreamSynchronize(stream), "sync");
      return MaxOverRanks((MPI_Wtime() - t0) / iters * 1e6);
    };
    r.nvgroup_us = time_it([&] {
      Check(comm->Allreduce(d_in, d_out, count, DataType::kFloat32, ReduceOp::kSum, stream), "Allreduce");
      CheckCuda(cudaStreamSynchronize(stream), "sync");
    });
    r.staged_us = time_it([&] {
      CheckCuda(cudaMemcpyAsync(pinned, d_in, bytes, cudaMemcpyDeviceToHost, stream), "D2H");
      CheckCuda(cudaStreamSynchronize(stream), "sync");
      NVG_TOOL_MPI(MPI_Allreduce(MPI_IN_PLACE, pinned, static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                                 MPI_COMM_WORLD));
      CheckCuda(cudaMemcpyAsync(d_out, pinned, bytes, cudaMemcpyHostToDevice, stream), "H2D");
      CheckCuda(cudaStreamSynchronize(stream), "sync");
    });
    if (t.rank == 0)
      std::printf("%12zu B  nvgroup %10.1f us  staged-mpi %10.1f us  ratio %5.2f  wrong %lld  "
                  "not-bitwise %lld  ranks-differ %lld  cross-bytes %.0f (ideal %.0f)%s\n",
                  bytes, r.nvgroup_us, r.staged_us, r.staged_us / r.nvgroup_us, r.wrong, r.not_bitwise,
                  r.ranks_differ, r.cross_bytes, r.ideal_cross_bytes, bytes_ok ? "" : "  BYTES MISMATCH");
    rows.push_back(r);
  }
  if (t.rank == 0 && !json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (f == nullptr) Die("cannot write " + json);
    cudaDeviceProp prop{};
    CheckCuda(cudaGetDeviceProperties(&prop, 0), "props");
    std::fprintf(f, "{\"tool\": \"cross_step_bench\", \"gpu\": \"%s\", \"ranks\": %d, \"group_count\": %d, "
                 "\"group_size\": %d, \"dtype\": \"float32\", \"op\": \"sum\", \"rows\": [\n",
                 prop.name, t.size, t.group_count, t.group_size);
    for (size_t k = 0; k < rows.size(); ++k) {
      const Row& r = rows[k];
      std::fprintf(f, "  {\"bytes\": %zu, \"nvgroup_us\": %.2f, \"staged_mpi_us\": %.2f, \"wrong\": %lld, "
                   "\"not_bitwise\": %lld, \"ranks_differ\": %lld, \"cross_bytes\": %.0f, "
                   "\"ideal_cross_bytes\": %.0f}%s\n",
                   r.bytes, r.nvgroup_us, r.staged_us, r.wrong, r.not_bitwise, r.ranks_differ,
                   r.cross_bytes, r.ideal_cross_bytes, k + 1 < rows.size() ? "," : "");
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  if (t.rank == 0) std::printf("cross_step_bench: %s\n", ok ? "all checks passed" : "CHECKS FAILED");
  comm.reset();
  CheckCuda(cudaFree(d_in), "free");
  CheckCuda(cudaFree(d_out), "free");
  CheckCuda(cudaFreeHost(pinned), "free");
  MPI_Finalize();
  return ok ? 0 : 1;
}
