// cross_step_bench: the cross-group step of the CUDA communicator (CrossExchange:
// reduce-scatter + allgather among the peers, or allgather + fold for small
// slices; host-staged through double-buffered pinned memory unless MPI is
// CUDA-aware) checked and timed against the naive host-staged allreduce of the
// same bytes (D2H, MPI_Allreduce, H2D).
//
// Meant for one GPU shared by 2-4 ranks as groups of one, so every byte goes
// through the cross step:
//   NVGROUP_GROUP_SIZE=1 mpirun -np 4 -x NVGROUP_GROUP_SIZE build/tools/cross_step_bench
// (works on any layout: with several GPUs per group it times the whole hierarchy).
//
// Per size (float32 Sum, 64 KiB .. --max_bytes, x --step) and per configuration of
// the communicator, in one run:
//   nvgroup        the settings as given (NVGROUP_CROSS_ALLGATHER_MAX_BYTES,
//                  NVGROUP_PIPELINE_MIN_CHUNK, NVGROUP_PIPELINE_CHUNK)
//   rsag           the same, reduce-scatter + allgather at every size
//   allgather      the same, allgather + fold at every size (with rsag: where
//                  the one round pays, to set NVGROUP_CROSS_ALLGATHER_MAX_BYTES)
//   whole-chunks   the same, chunks of NVGROUP_PIPELINE_CHUNK (no quarter
//                  chunks: a message up to the chunk is one serial chunk)
//   min-chunk-x4   the same, NVGROUP_PIPELINE_MIN_CHUNK four times larger
//                  (at most the chunk): where quarter chunks stop paying
// Sizes from 64 KiB, times --step (4) up to --max_bytes.
// random inputs regenerated from a hash, the result checked EVERY element
// bitwise against the host fold in the communicator's order (tool_common.h
// ExpectedResult) and against a float64 reference within the float32 rounding
// bound; all ranks' results hashed and compared; the bytes the process posted
// in cross exchanges compared with each chunk's ideal (2 (P-1)/P of its slice
// by reduce-scatter + allgather, (P-1) slices by allgather + fold). Then the
// mean time of --iters calls after --warmup calls (stream-synchronized, max
// over ranks; the median of 3 rounds in which the variants take turns) of
// each configuration and of `staged-mpi` (D2H into pinned memory,
// MPI_Allreduce in place, H2D). One table line per size and optional
// JSON (--json FILE, with machine, date and --commit). Exit code 0 only if
// every check passed.
#include <cuda_runtime.h>
#include <mpi.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>
#endif

#include "algorithms/cross_exchange.h"
#include "algorithms/hierarchical_allreduce.h"
#include "device/cuda_communicator.h"
#include "tools/tool_common.h"
#include "topology/topology.h"

namespace nvgroup {
namespace tools {
namespace {

// The configurations of the communicator timed side by side.
struct Config {
  const char* name;
  Knobs knobs;
  std::unique_ptr<Communicator> comm;
};

struct Measured {
  double us = 0;
  long long wrong = 0, not_bitwise = 0, ranks_differ = 0;
  double cross_bytes = 0, ideal_cross_bytes = 0;
  bool bytes_ok = true;
};

struct Row {
  size_t bytes = 0;
  double staged_us = 0;
  std::vector<Measured> configs;
};

// What one allreduce of `count` float32 elements should post in cross steps:
// per chunk of the skeleton (pieces of the registered capacity, chunks by
// PipelineChunking), our slice's ideal by its variant. *chunks: how many.
double IdealCrossBytes(const Topology& t, const Knobs& k, size_t capacity, size_t count, size_t* chunks) {
  const size_t es = sizeof(float);
  const double p = t.group_count;
  PipelineChunking chunking;
  chunking.max_bytes = k.pipeline_chunk;
  chunking.min_bytes = k.pipeline_min_chunk;
  const size_t unit = std::max<size_t>(1, 16 / es) * t.group_size;
  const size_t piece = std::max(unit, capacity / es / unit * unit);
  double ideal = 0;
  *chunks = 0;
  for (size_t first = 0; first < count; first += piece) {
    const size_t n = std::min(piece, count - first);
    const size_t step = chunking.ChunkElements(n, es, t.group_size);
    for (size_t c0 = 0; c0 < n; c0 += step) {
      ChunkSlices ch;
      ch.count = std::min(step, n - c0);
      ch.group_size = t.group_size;
      ch.element_size = es;
      const double slice = static_cast<double>(ch.SliceCount(t.group_rank) * es);
      ++*chunks;
      const size_t limit = CrossExchange::AllgatherLimitBytes(k.cross_allgather_max_bytes, t.group_count);
      if (k.cross_allgather_max_bytes > 0 && (p - 1) * slice <= static_cast<double>(limit))
        ideal += (p - 1) * slice;
      else ideal += 2 * (p - 1) / p * slice;
    }
  }
  return ideal;
}

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
  int iters = 20, warmup = 5, step = 4;
  std::string json, commit = "unknown";
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
    else if (s == "--commit") commit = next();
    else if (s == "--step") step = std::stoi(next());
    else Die("unknown flag " + s + " (--max_bytes N --step N --iters N --warmup N --json FILE --commit REV)");
  }
  if (step < 2) Die("--step must be at least 2");
  Topology host;
  TopologyComms comms;
  Check(SplitNodes(MPI_COMM_WORLD, &host, &comms), "SplitNodes");
  Knobs knobs = EnvironmentKnobs();
  knobs.peer_timeout_s = 60;
  CommunicatorOptions opt;
  opt.registered_bytes = 64u << 20;
  std::vector<Config> configs;
  configs.push_back({"nvgroup", knobs, nullptr});
  configs.push_back({"rsag", knobs, nullptr});
  configs.back().knobs.cross_allgather_max_bytes = 0;
  configs.push_back({"allgather", knobs, nullptr});
  configs.back().knobs.cross_allgather_max_bytes = 1u << 30;
  configs.push_back({"whole-chunks", knobs, nullptr});
  configs.back().knobs.pipeline_min_chunk = knobs.pipeline_chunk;
  configs.push_back({"min-chunk-x4", knobs, nullptr});
  configs.back().knobs.pipeline_min_chunk = std::min(knobs.pipeline_chunk, 4 * knobs.pipeline_min_chunk);
  for (Config& c : configs) {
    auto created = CreateCudaCommunicator(MPI_COMM_WORLD, -1, c.knobs, opt, host);
    Check(created.status(), "CreateCudaCommunicator");
    c.comm = created.consume();
  }
  const Topology& t = configs[0].comm->topology();
  const size_t capacity = configs[0].comm->registered_capacity();
  const Layout layout = GatherLayout(t);
  const bool hierarchical = t.group_count > 1;
  int cuda_aware = 0;  // the communicator's own test (MpiIsCudaAware in communicator_setup_cuda.cc)
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  cuda_aware = MPIX_Query_cuda_support();
#endif
  char machine[256] = "unknown";
  if (gethostname(machine, sizeof machine - 1) != 0) std::snprintf(machine, sizeof machine, "unknown");
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  constexpr int kRounds = 3;  // timing rounds (time_all below)
  if (t.rank == 0) {
    std::printf("# cross_step_bench: %d ranks, %d groups of %d, MPI_THREAD_MULTIPLE=%d, cross step %s\n",
                t.size, t.group_count, t.group_size, provided == MPI_THREAD_MULTIPLE,
                cuda_aware ? "on device buffers (CUDA-aware MPI)" : "host-staged (pinned, double-buffered)");
    std::printf(
        "# %s, %s, commit %s; chunk %zu B, min chunk %zu B, allgather of slices whose copies are at most "
        "%zu B\n",
        machine, date, commit.c_str(), knobs.pipeline_chunk, knobs.pipeline_min_chunk,
        CrossExchange::AllgatherLimitBytes(knobs.cross_allgather_max_bytes, t.group_count));
    std::printf("# mean us per call, max over ranks, median of %d rounds%12s", kRounds, "");
    for (const Config& c : configs) std::printf(" %12s", c.name);
    std::printf(" %12s  staged/nvgroup\n", "staged-mpi");
  }
  cudaStream_t stream = nullptr;
  CheckCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  float *d_in = nullptr, *d_out = nullptr, *pinned = nullptr;
  CheckCuda(cudaMalloc(&d_in, max_bytes), "cudaMalloc");
  CheckCuda(cudaMalloc(&d_out, max_bytes), "cudaMalloc");
  CheckCuda(cudaMallocHost(&pinned, max_bytes), "cudaMallocHost");

  // Mean us per call of `iters` back-to-back calls (after `warmup` in the
  // first round; fewer above 16 MiB, below), max over ranks; the median of kRounds rounds, the bodies
  // taking turns round by round so load drifts hit them alike.
  // Above 16 MiB the calls per round shrink with the size (at least 3), so the
  // sweep to 256 MiB fits one device call.
  auto time_all = [&](std::vector<std::function<void()>>& bodies, size_t bytes) {
    const int n = static_cast<int>(std::max<size_t>(3, std::min<size_t>(iters, iters * (16u << 20) / bytes)));
    const int w_n = std::min(warmup, n);
    std::vector<std::vector<double>> us(bodies.size());
    for (int round = 0; round < kRounds; ++round) {
      for (size_t b = 0; b < bodies.size(); ++b) {
        const size_t k = (b + round) % bodies.size();
        for (int w = 0; round == 0 && w < w_n; ++w) bodies[k]();
        CheckCuda(cudaStreamSynchronize(stream), "sync");
        NVG_TOOL_MPI(MPI_Barrier(MPI_COMM_WORLD));
        const double t0 = MPI_Wtime();
        for (int i = 0; i < n; ++i) bodies[k]();
        CheckCuda(cudaStreamSynchronize(stream), "sync");
        us[k].push_back(MaxOverRanks((MPI_Wtime() - t0) / n * 1e6));
      }
    }
    std::vector<double> median;
    for (auto& v : us) {
      std::sort(v.begin(), v.end());
      median.push_back(v[v.size() / 2]);
    }
    return median;
  };
  std::vector<Row> rows;
  bool ok = true;
  for (size_t bytes = 64u << 10; bytes <= max_bytes; bytes *= static_cast<size_t>(step)) {
    Row r;
    r.bytes = bytes;
    const size_t count = bytes / sizeof(float);
    std::vector<std::vector<char>> inputs(t.size, std::vector<char>(bytes));
    for (int k = 0; k < t.size; ++k)
      FillInput(14, k, DataType::kFloat32, ReduceOp::kSum, count, inputs[k].data());
    std::vector<char> expected;
    ExpectedResult(layout, hierarchical, DataType::kFloat32, ReduceOp::kSum, inputs, count, &expected);
    CheckCuda(cudaMemcpy(d_in, inputs[t.rank].data(), bytes, cudaMemcpyHostToDevice), "H2D input");
    const float* want = reinterpret_cast<const float*>(expected.data());
    std::vector<float> got(count);
    for (Config& c : configs) {
      Measured m;
      CheckCuda(cudaMemset(d_out, 0xFF, bytes), "poison");
      const uint64_t before = CrossExchange::BytesSent();
      Check(c.comm->Allreduce(d_in, d_out, count, DataType::kFloat32, ReduceOp::kSum, stream), "Allreduce");
      CheckCuda(cudaStreamSynchronize(stream), "sync");
      m.cross_bytes = static_cast<double>(CrossExchange::BytesSent() - before);
      size_t chunks = 0;
      if (hierarchical) m.ideal_cross_bytes = IdealCrossBytes(t, c.knobs, capacity, count, &chunks);
      CheckCuda(cudaMemcpy(got.data(), d_out, bytes, cudaMemcpyDeviceToHost), "D2H result");
      for (size_t i = 0; i < count; ++i) {
        double ref = 0, mag = 0;
        for (int k = 0; k < t.size; ++k) {
          const double x = reinterpret_cast<const float*>(inputs[k].data())[i];
          ref += x;
          mag += std::fabs(x);
        }
        if (!(std::fabs(got[i] - ref) <= mag * (t.size + 1) * UnitRoundoff(DataType::kFloat32))) ++m.wrong;
        if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) ++m.not_bitwise;
      }
      uint64_t h = HashBytes(got.data(), bytes), h0 = h;
      NVG_TOOL_MPI(MPI_Bcast(&h0, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD));
      long long differs = h != h0, wrong = m.wrong, nb = m.not_bitwise;
      NVG_TOOL_MPI(MPI_Allreduce(&differs, &m.ranks_differ, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
      NVG_TOOL_MPI(MPI_Allreduce(&wrong, &m.wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
      NVG_TOOL_MPI(MPI_Allreduce(&nb, &m.not_bitwise, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
      m.bytes_ok = !hierarchical || std::fabs(m.cross_bytes - m.ideal_cross_bytes) <=
                                        0.01 * m.ideal_cross_bytes + 64.0 * chunks;
      ok = ok && m.wrong == 0 && m.not_bitwise == 0 && m.ranks_differ == 0 && m.bytes_ok;
      r.configs.push_back(m);
    }
    std::vector<std::function<void()>> bodies;
    for (Config& c : configs)
      bodies.push_back([&, comm = c.comm.get()] {
        Check(comm->Allreduce(d_in, d_out, count, DataType::kFloat32, ReduceOp::kSum, stream), "Allreduce");
        CheckCuda(cudaStreamSynchronize(stream), "sync");
      });
    bodies.push_back([&] {  // staged-mpi
      CheckCuda(cudaMemcpyAsync(pinned, d_in, bytes, cudaMemcpyDeviceToHost, stream), "D2H");
      CheckCuda(cudaStreamSynchronize(stream), "sync");
      NVG_TOOL_MPI(MPI_Allreduce(MPI_IN_PLACE, pinned, static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                                 MPI_COMM_WORLD));
      CheckCuda(cudaMemcpyAsync(d_out, pinned, bytes, cudaMemcpyHostToDevice, stream), "H2D");
      CheckCuda(cudaStreamSynchronize(stream), "sync");
    });
    const std::vector<double> us = time_all(bodies, bytes);
    for (size_t c = 0; c < configs.size(); ++c) r.configs[c].us = us[c];
    r.staged_us = us.back();
    if (t.rank == 0) {
      std::printf("%12zu B %24s", bytes, "");
      for (const Measured& m : r.configs) std::printf(" %12.1f", m.us);
      std::printf(" %12.1f  %5.2f", r.staged_us, r.staged_us / r.configs[0].us);
      for (size_t k = 0; k < r.configs.size(); ++k) {
        const Measured& m = r.configs[k];
        if (m.wrong || m.not_bitwise || m.ranks_differ || !m.bytes_ok)
          std::printf("  %s: wrong %lld not-bitwise %lld ranks-differ %lld cross-bytes %.0f (ideal %.0f)",
                      configs[k].name, m.wrong, m.not_bitwise, m.ranks_differ, m.cross_bytes,
                      m.ideal_cross_bytes);
      }
      std::printf("\n");
    }
    rows.push_back(r);
  }
  if (t.rank == 0 && !json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (f == nullptr) Die("cannot write " + json);
    cudaDeviceProp prop{};
    CheckCuda(cudaGetDeviceProperties(&prop, 0), "props");
    std::fprintf(
        f,
        "{\"tool\": \"cross_step_bench\", \"machine\": \"%s\", \"date\": \"%s\", \"commit\": \"%s\", "
        "\"gpu\": \"%s\", \"ranks\": %d, \"group_count\": %d, \"group_size\": %d, \"cuda_aware_mpi\": %d, "
        "\"dtype\": \"float32\", \"op\": \"sum\", \"pipeline_chunk\": %zu, \"pipeline_min_chunk\": %zu, "
        "\"cross_allgather_max_bytes\": %zu, \"iters\": %d, \"warmup\": %d, \"rows\": [\n",
        machine, date, commit.c_str(), prop.name, t.size, t.group_count, t.group_size, cuda_aware,
        knobs.pipeline_chunk, knobs.pipeline_min_chunk, knobs.cross_allgather_max_bytes, iters, warmup);
    for (size_t k = 0; k < rows.size(); ++k) {
      const Row& r = rows[k];
      std::fprintf(f, "  {\"bytes\": %zu, \"staged_mpi_us\": %.2f", r.bytes, r.staged_us);
      for (size_t c = 0; c < r.configs.size(); ++c) {
        const Measured& m = r.configs[c];
        std::fprintf(
            f,
            ", \"%s\": {\"us\": %.2f, \"wrong\": %lld, \"not_bitwise\": %lld, \"ranks_differ\": %lld, "
            "\"cross_bytes\": %.0f, \"ideal_cross_bytes\": %.0f}",
            configs[c].name, m.us, m.wrong, m.not_bitwise, m.ranks_differ, m.cross_bytes,
            m.ideal_cross_bytes);
      }
      std::fprintf(f, "}%s\n", k + 1 < rows.size() ? "," : "");
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  if (t.rank == 0) std::printf("cross_step_bench: %s\n", ok ? "all checks passed" : "CHECKS FAILED");
  configs.clear();
  CheckCuda(cudaFree(d_in), "free");
  CheckCuda(cudaFree(d_out), "free");
  CheckCuda(cudaFreeHost(pinned), "free");
  MPI_Finalize();
  return ok ? 0 : 1;
}
