// allreduce_check: GPU correctness suite of the CUDA communicator, run under
// mpirun (one rank per GPU, or more ranks than GPUs with NVGROUP_GROUP_SIZE to
// exercise the hierarchy on one machine).
//
// For every dtype x op x size (1 element to --max_elems, odd sizes, inputs and
// outputs misaligned on every other case) it allreduces random data (never
// zeros; any rank can regenerate any rank's input from a hash) out of place,
// in place, and in place on the registered buffer (the engine's path), and
// checks EVERY element:
//   * bitwise against the host fold in the communicator's order
//     (cc/cpu/host_reduce.h ReduceFold: group members by group_rank, then groups
//     by group_index), integers exact;
//   * that host fold against a float64 reference within a rounding bound;
//   * output poisoned (0xFF) before each run, so unwritten elements fail;
//   * results bitwise equal on all ranks (hash allgather).
// Then: many tensors fused through BatchedScaledCopy (prescale) -> in-place
// Allreduce on the registered buffer -> BatchedScaledCopy (postscale), as the
// engine does; Allgatherv; Broadcast; bad input (a clear error on every rank);
// and a dead peer (a barrier that times out, then Abort()).
// Streams and graphs: one-shot and two-shot allreduces captured in CUDA graphs
// (an odd number of calls per graph) replayed back to back and mixed with
// eager calls, every round checked; calls issued on two caller streams at
// once, every result checked. --peer_exit_test instead runs only this: the
// last rank exits with its memory mapped by the others while calls are in
// flight; the others must fail with kUnavailable naming it, within seconds.
//
// One GPU: --one_gpu_group (or NVGROUP_ONE_GPU_GROUP=1) lets the ranks share
// one GPU as one NV-group; run it under MPS (scripts/device/run_all.sh).
//
// Usage: allreduce_check [--mode auto|oneshot|twoshot] [--max_elems N]
//                        [--large] [--quick] [--no_timeout_test]
//                        [--twoshot_chunk BYTES]  (0: un-pipelined two-shot)
//                        [--twoshot_blocks N]     (grid cap of --mode twoshot, 64)
//                        [--one_gpu_group] [--only_streams] [--only_timeout]
//                        [--peer_exit_test]
//                        [--time BYTES]  (only: time float32 sums of BYTES)
// Exit code 0 only if every check passed; prints one summary line per section.
#include <cuda_runtime.h>
#include <mpi.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "device/cuda_communicator.h"
#include "tools/round_kernels.h"
#include "tools/tool_common.h"
#include "topology/topology.h"

namespace nvgroup {
namespace tools {
namespace {

struct Args {
  std::string mode = "auto";
  size_t max_elems = 3u << 20;
  bool large = false;
  bool quick = false;
  bool timeout_test = true;
  long long twoshot_chunk = -1;  // -1: the communicator's default
  int twoshot_blocks = 64;       // --mode twoshot: small caps give many chunks
  bool one_gpu_group = false;    // ranks share one GPU as one NV-group (MPS)
  bool only_streams = false;     // run only the graph and two-stream sections
  bool only_timeout = false;     // run only the dead-peer (timeout) case
  bool peer_exit_test = false;   // run only the peer-exit case
  size_t time_bytes = 0;         // > 0: only time allreduces of this size
};

Args ParseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) Die("missing value after " + s);
      return argv[++i];
    };
    if (s == "--mode") a.mode = next();
    else if (s == "--max_elems") a.max_elems = std::stoull(next());
    else if (s == "--large") a.large = true;
    else if (s == "--quick") a.quick = true;
    else if (s == "--no_timeout_test") a.timeout_test = false;
    else if (s == "--twoshot_chunk") a.twoshot_chunk = std::stoll(next());
    else if (s == "--twoshot_blocks") a.twoshot_blocks = std::stoi(next());
    else if (s == "--one_gpu_group") a.one_gpu_group = true;
    else if (s == "--only_streams") a.only_streams = true;
    else if (s == "--only_timeout") a.only_timeout = true;
    else if (s == "--peer_exit_test") a.peer_exit_test = true;
    else if (s == "--time") a.time_bytes = std::stoull(next());
    else Die("unknown argument " + s);
  }
  return a;
}

struct Suite {
  Communicator* comm;
  Layout layout;
  bool hierarchical;
  int rank;
  bool one_gpu_group = false;
  long long cases = 0;
  long long wrong = 0;  // elements (or checks) that failed on this rank
};

// cudaMemcpy from pageable memory and cudaMemset may still be in flight on the
// legacy stream when they return; the communicator's stream does not wait for
// it, so every setup step is followed by a device synchronize.
void ToDevice(void* dst, const void* src, size_t bytes) {
  CheckCuda(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "H2D");
  CheckCuda(cudaDeviceSynchronize(), "sync after H2D");
}
void Poison(void* dst, size_t bytes) {
  CheckCuda(cudaMemset(dst, 0xff, bytes), "poison");
  CheckCuda(cudaDeviceSynchronize(), "sync after poison");
}

void Report(const Suite& s, const char* what, long long wrong_here) {
  if (wrong_here > 0) std::fprintf(stderr, "[rank %d] %s: %lld wrong\n", s.rank, what, wrong_here);
}

// Compares `got` with `expected` element by element; prints the first few.
long long Compare(const Suite& s, const std::string& label, DataType dtype, const void* got,
                  const void* expected, size_t count) {
  const size_t es = DataTypeSize(dtype);
  long long bad = 0;
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(static_cast<const char*>(got) + i * es, static_cast<const char*>(expected) + i * es,
                    es) != 0) {
      if (bad < 3)
        std::fprintf(stderr, "[rank %d] %s: element %zu is %.9g, expected %.9g\n", s.rank, label.c_str(), i,
                     ToDouble(dtype, got, i), ToDouble(dtype, expected, i));
      ++bad;
    }
  }
  return bad;
}

// The host fold against float64: |fold - exact| within a rounding bound.
long long CheckAgainstFloat64(const Suite& s, const std::string& label, DataType dtype, ReduceOp op,
                              const std::vector<std::vector<char>>& inputs, const std::vector<char>& expected,
                              size_t count) {
  if (!IsFloatingPoint(dtype)) return 0;  // integers: the fold is exact modular arithmetic
  const double u = UnitRoundoff(dtype);
  const int n = s.layout.size;
  long long bad = 0;
  for (size_t i = 0; i < count; ++i) {
    double acc = ToDouble(dtype, inputs[0].data(), i), mag = std::fabs(acc);
    for (int r = 1; r < n; ++r) {
      const double x = ToDouble(dtype, inputs[r].data(), i);
      switch (op) {
        case ReduceOp::kMin: acc = std::min(acc, x); break;
        case ReduceOp::kMax: acc = std::max(acc, x); break;
        case ReduceOp::kProduct: acc *= x; break;
        default: acc += x;
      }
      mag += std::fabs(x);
    }
    double bound = 0;
    if (op == ReduceOp::kSum) bound = (n + 1) * u * mag;
    if (op == ReduceOp::kAverage) {
      acc /= n;
      bound = (n + 2) * u * mag / n;
    }
    if (op == ReduceOp::kProduct) bound = (2 * n + 1) * u * std::fabs(acc);
    const double got = ToDouble(dtype, expected.data(), i);
    if (!(std::fabs(got - acc) <= bound)) {
      if (bad < 3)
        std::fprintf(stderr, "[rank %d] %s: fold %.12g vs float64 %.12g (bound %.3g) at %zu\n", s.rank,
                     label.c_str(), got, acc, bound, i);
      ++bad;
    }
  }
  return bad;
}

// Bitwise equality of `bytes` across ranks.
long long CheckRanksEqual(const Suite& s, const void* data, size_t bytes) {
  uint64_t h = HashBytes(data, bytes);
  std::vector<uint64_t> all(s.layout.size);
  NVG_TOOL_MPI(MPI_Allgather(&h, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD));
  for (uint64_t x : all)
    if (x != all[0]) return 1;
  return 0;
}

void RunCase(Suite& s, DataType dtype, ReduceOp op, size_t count, uint64_t seed, bool misalign) {
  const size_t es = DataTypeSize(dtype), bytes = count * es;
  const std::string label = std::string(ShortName(dtype)) + " " + ReduceOpName(op) +
                            " n=" + std::to_string(count) + (misalign ? " misaligned" : "");
  std::vector<std::vector<char>> inputs(s.layout.size, std::vector<char>(bytes));
  for (int r = 0; r < s.layout.size; ++r) FillInput(seed, r, dtype, op, count, inputs[r].data());
  std::vector<char> expected, got(bytes);
  ExpectedResult(s.layout, s.hierarchical, dtype, op, inputs, count, &expected);
  long long bad = CheckAgainstFloat64(s, label + " (host fold)", dtype, op, inputs, expected, count);

  char *d_in = nullptr, *d_out = nullptr;
  CheckCuda(cudaMalloc(&d_in, bytes + 16), "cudaMalloc");
  CheckCuda(cudaMalloc(&d_out, bytes + 16), "cudaMalloc");
  char* in = d_in + (misalign ? es : 0);
  char* out = d_out + (misalign ? es : 0);
  const std::vector<char>& mine = inputs[s.rank];

  // Out of place.
  ToDevice(in, mine.data(), bytes);
  Poison(out, bytes);
  Check(s.comm->Allreduce(in, out, count, dtype, op, nullptr), label);
  Check(s.comm->Synchronize(nullptr), label);
  CheckCuda(cudaMemcpy(got.data(), out, bytes, cudaMemcpyDeviceToHost), "D2H");
  bad += Compare(s, label + " out-of-place", dtype, got.data(), expected.data(), count);
  bad += CheckRanksEqual(s, got.data(), bytes);
  // Input untouched by an out-of-place call.
  std::vector<char> in_after(bytes);
  CheckCuda(cudaMemcpy(in_after.data(), in, bytes, cudaMemcpyDeviceToHost), "D2H");
  bad += Compare(s, label + " input preserved", dtype, in_after.data(), mine.data(), count);

  // In place.
  ToDevice(out, mine.data(), bytes);
  Check(s.comm->Allreduce(out, out, count, dtype, op, nullptr), label);
  Check(s.comm->Synchronize(nullptr), label);
  CheckCuda(cudaMemcpy(got.data(), out, bytes, cudaMemcpyDeviceToHost), "D2H");
  bad += Compare(s, label + " in-place", dtype, got.data(), expected.data(), count);

  // In place on the registered buffer (what the engine does after fusing).
  if (bytes <= s.comm->registered_capacity()) {
    void* reg = s.comm->registered_buffer();
    ToDevice(reg, mine.data(), bytes);
    Check(s.comm->Allreduce(reg, reg, count, dtype, op, nullptr), label);
    Check(s.comm->Synchronize(nullptr), label);
    CheckCuda(cudaMemcpy(got.data(), reg, bytes, cudaMemcpyDeviceToHost), "D2H");
    bad += Compare(s, label + " registered", dtype, got.data(), expected.data(), count);
  }
  CheckCuda(cudaFree(d_in), "cudaFree");
  CheckCuda(cudaFree(d_out), "cudaFree");
  s.cases += 1;
  s.wrong += bad;
}

// Engine-style fused path: 161 tensors of odd sizes -> registered buffer with
// prescale (one launch), in-place Average, back out with postscale (one launch).
void RunFused(Suite& s, DataType dtype, uint64_t seed) {
  const int kTensors = 161;  // as many tensors as PyTorch ResNet-50 has gradients
  const size_t es = DataTypeSize(dtype);
  const double prescale = 0.5, postscale = 3.0;
  std::vector<size_t> counts(kTensors), offsets(kTensors);
  size_t total = 0;
  for (int t = 0; t < kTensors; ++t) {
    counts[t] = 1 + Mix(seed + t) % (t % 10 == 0 ? 200000 : 3000);
    offsets[t] = total;
    total += (counts[t] * es + 15) / 16 * 16 / es;  // Horovod pads each tensor to 16 bytes
  }
  if (total * es > s.comm->registered_capacity()) Die("fused test exceeds the registered buffer");
  // Every rank's whole fused input, scaled as the device will scale it.
  std::vector<std::vector<char>> fused(s.layout.size, std::vector<char>(total * es, 0));
  std::vector<std::vector<char>> tensors(kTensors);
  for (int r = 0; r < s.layout.size; ++r) {
    for (int t = 0; t < kTensors; ++t) {
      std::vector<char> raw(counts[t] * es);
      FillInput(seed * 31 + t, r, dtype, ReduceOp::kAverage, counts[t], raw.data());
      Check(ScaledCopy(dtype, raw.data(), fused[r].data() + offsets[t] * es, counts[t], prescale),
            "host scaled copy");
      if (r == s.rank) tensors[t] = raw;
    }
  }
  std::vector<char> reduced;
  ExpectedResult(s.layout, s.hierarchical, dtype, ReduceOp::kAverage, fused, total, &reduced);

  char* reg = static_cast<char*>(s.comm->registered_buffer());
  CheckCuda(cudaMemset(reg, 0, total * es), "memset");  // padding: defined values
  CheckCuda(cudaDeviceSynchronize(), "sync");
  std::vector<char*> d_in(kTensors), d_out(kTensors);
  std::vector<Communicator::CopySpec> in_specs(kTensors), out_specs(kTensors);
  for (int t = 0; t < kTensors; ++t) {
    CheckCuda(cudaMalloc(&d_in[t], counts[t] * es), "cudaMalloc");
    CheckCuda(cudaMalloc(&d_out[t], counts[t] * es), "cudaMalloc");
    ToDevice(d_in[t], tensors[t].data(), counts[t] * es);
    Poison(d_out[t], counts[t] * es);
    in_specs[t] = {d_in[t], reg + offsets[t] * es, counts[t]};
    out_specs[t] = {reg + offsets[t] * es, d_out[t], counts[t]};
  }
  const std::string label = std::string("fused ") + ShortName(dtype);
  Check(s.comm->BatchedScaledCopy(in_specs.data(), kTensors, dtype, prescale, nullptr), label);
  Check(s.comm->Allreduce(reg, reg, total, dtype, ReduceOp::kAverage, nullptr), label);
  Check(s.comm->BatchedScaledCopy(out_specs.data(), kTensors, dtype, postscale, nullptr), label);
  Check(s.comm->Synchronize(nullptr), label);
  long long bad = 0;
  for (int t = 0; t < kTensors; ++t) {
    std::vector<char> want(counts[t] * es), got(counts[t] * es);
    Check(ScaledCopy(dtype, reduced.data() + offsets[t] * es, want.data(), counts[t], postscale),
          "host scaled copy");
    CheckCuda(cudaMemcpy(got.data(), d_out[t], counts[t] * es, cudaMemcpyDeviceToHost), "D2H");
    bad += Compare(s, label + " tensor " + std::to_string(t), dtype, got.data(), want.data(), counts[t]);
    bad += CheckRanksEqual(s, got.data(), got.size());
    CheckCuda(cudaFree(d_in[t]), "cudaFree");
    CheckCuda(cudaFree(d_out[t]), "cudaFree");
  }
  Report(s, label.c_str(), bad);
  s.cases += 1;
  s.wrong += bad;
}

void RunAllgatherBroadcast(Suite& s) {
  const int n = s.layout.size;
  std::vector<size_t> sizes(n);
  size_t total = 0;
  for (int r = 0; r < n; ++r) total += (sizes[r] = 1000 * (r + 1) + 3 * r + 1);
  std::vector<char> want(total), mine(sizes[s.rank]);
  for (int r = 0, off = 0; r < n; off += sizes[r], ++r)
    for (size_t i = 0; i < sizes[r]; ++i) want[off + i] = static_cast<char>(Mix(r * 7919 + i));
  size_t my_off = 0;
  for (int r = 0; r < s.rank; ++r) my_off += sizes[r];
  std::memcpy(mine.data(), want.data() + my_off, sizes[s.rank]);
  const size_t bb = 12345;  // broadcast bytes, below
  char *d_in, *d_out;
  CheckCuda(cudaMalloc(&d_in, sizes[s.rank]), "cudaMalloc");
  CheckCuda(cudaMalloc(&d_out, std::max(total, bb)), "cudaMalloc");
  ToDevice(d_in, mine.data(), mine.size());
  Poison(d_out, total);
  Check(s.comm->Allgatherv(d_in, d_out, sizes, nullptr), "allgatherv");
  std::vector<char> got(total);
  CheckCuda(cudaMemcpy(got.data(), d_out, total, cudaMemcpyDeviceToHost), "D2H");
  long long bad = got == want ? 0 : 1;
  Report(s, "allgatherv", bad);

  const int root = n - 1;
  std::vector<char> bwant(bb);
  for (size_t i = 0; i < bb; ++i) bwant[i] = static_cast<char>(Mix(i + 17));
  if (s.rank == root) ToDevice(d_out, bwant.data(), bb);
  else Poison(d_out, bb);
  Check(s.comm->Broadcast(d_out, bb, root, nullptr), "broadcast");
  std::vector<char> bgot(bb);
  CheckCuda(cudaMemcpy(bgot.data(), d_out, bb, cudaMemcpyDeviceToHost), "D2H");
  long long bbad = bgot == bwant ? 0 : 1;
  Report(s, "broadcast", bbad);
  CheckCuda(cudaFree(d_in), "cudaFree");
  CheckCuda(cudaFree(d_out), "cudaFree");
  s.cases += 2;
  s.wrong += bad + bbad;
}

// Bad input must be a clear kInvalidArgument on every rank, never a crash.
void RunBadInput(Suite& s) {
  long long bad = 0;
  auto expect_invalid = [&](const Status& st, const char* what) {
    if (st.code() != StatusCode::kInvalidArgument) {
      std::fprintf(stderr, "[rank %d] bad input '%s' gave %s\n", s.rank, what, st.ToString().c_str());
      ++bad;
    } else if (s.rank == 0) {
      std::printf("#   bad input '%s' -> %s\n", what, st.ToString().c_str());
    }
  };
  char* d = nullptr;
  CheckCuda(cudaMalloc(&d, 1024), "cudaMalloc");
  std::vector<float> host(16);
  expect_invalid(s.comm->Allreduce(d, d, 16, DataType::kBool, ReduceOp::kSum, nullptr), "bool allreduce");
  // uint8/int8/uint16/int16 reduce on CUDA too (their results: scripts/device/new_collectives_check.py).
  expect_invalid(s.comm->Allreduce(host.data(), d, 16, DataType::kFloat32, ReduceOp::kSum, nullptr),
                 "host input pointer");
  expect_invalid(s.comm->Allreduce(nullptr, d, 16, DataType::kFloat32, ReduceOp::kSum, nullptr),
                 "null input");
  expect_invalid(s.comm->Allreduce(d, d, 16, DataType::kFloat32, static_cast<ReduceOp>(9), nullptr),
                 "unknown op");
  expect_invalid(s.comm->Broadcast(d, 16, s.layout.size, nullptr), "broadcast root out of range");
  expect_invalid(s.comm->Allgatherv(d, d, std::vector<size_t>(s.layout.size + 1, 4), nullptr),
                 "allgatherv with wrong rank count");
  Communicator::CopySpec spec{d, d, 4};
  expect_invalid(s.comm->BatchedScaledCopy(&spec, 1, DataType::kBool, 2.0, nullptr), "scaled bool copy");
  CheckCuda(cudaFree(d), "cudaFree");
  s.cases += 1;
  s.wrong += bad;
}

// Dead peer: on a second communicator with a 2 s timeout and a 1 MiB
// registered buffer, rank 0 enters a 4 MiB allreduce (4 pieces, 4 kernels)
// that nobody else joins. Its barriers must give up within about one timeout
// for the whole call (not one per kernel or barrier) and Synchronize must
// report kUnavailable naming the missing peer; the others then Abort() their
// communicator (so destruction skips the closing barrier).
void RunTimeout(Suite& s, const Topology& host) {
  Knobs knobs = EnvironmentKnobs();
  knobs.peer_timeout_s = 2.0;
  knobs.one_gpu_group = knobs.one_gpu_group || s.one_gpu_group;
  CommunicatorOptions opt;
  opt.registered_bytes = 1 << 20;
  auto c = CreateCudaCommunicator(MPI_COMM_WORLD, -1, knobs, opt, host);
  Check(c.status(), "second communicator");
  std::unique_ptr<Communicator> comm = c.consume();
  long long bad = 0;
  if (comm->topology().group_size < 2) return;  // no NVLink barrier to time out
  const size_t count = 1u << 20;  // 4 MiB: 4 pieces of the 1 MiB registered buffer
  float* d = nullptr;
  CheckCuda(cudaMalloc(&d, count * 4), "cudaMalloc");
  Poison(d, count * 4);
  int verdict = 0;
  if (s.rank == 0) {
    const double t0 = MPI_Wtime();
    Status st = comm->Allreduce(d, d, count, DataType::kFloat32, ReduceOp::kSum, nullptr);
    if (st.ok()) st = comm->Synchronize(nullptr);
    const double waited = MPI_Wtime() - t0;
    std::printf("#   dead peer -> after %.1f s (4 kernels, timeout %.0f s for the call): %s\n", waited,
                knobs.peer_timeout_s, st.ToString().c_str());
    verdict = st.code() == StatusCode::kUnavailable && waited < 1.5 * knobs.peer_timeout_s ? 1 : 0;
    if (!verdict) ++bad;
    Status again = comm->Allreduce(d, d, 1024, DataType::kFloat32, ReduceOp::kSum, nullptr);
    if (again.code() != StatusCode::kUnavailable) ++bad;  // poisoned for good
  }
  NVG_TOOL_MPI(MPI_Bcast(&verdict, 1, MPI_INT, 0, MPI_COMM_WORLD));
  comm->Abort();
  comm.reset();
  CheckCuda(cudaFree(d), "cudaFree");
  Report(s, "dead peer", bad);
  s.cases += 1;
  s.wrong += bad;
}


// --time: mean time of float32 sum allreduces of `bytes` (CUDA events on a
// caller stream, 5 warm-up calls, 20 timed), out of place on user buffers and
// in place on the registered buffer; printed by rank 0. For comparing builds
// of the kernels on one machine, not a benchmark of the product.
void RunTiming(Suite& s, size_t bytes) {
  const size_t count = bytes / 4;
  char *in, *out;
  CheckCuda(cudaMalloc(&in, bytes), "cudaMalloc");
  CheckCuda(cudaMalloc(&out, bytes), "cudaMalloc");
  std::vector<char> mine(bytes);
  FillInput(5, s.rank, DataType::kFloat32, ReduceOp::kSum, count, mine.data());
  ToDevice(in, mine.data(), bytes);
  cudaStream_t st;
  cudaEvent_t t0, t1;
  CheckCuda(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  CheckCuda(cudaEventCreate(&t0), "event");
  CheckCuda(cudaEventCreate(&t1), "event");
  void* reg = s.comm->registered_buffer();
  auto time_it = [&](const void* a, void* b) {
    for (int i = 0; i < 5; ++i)
      Check(s.comm->Allreduce(a, b, count, DataType::kFloat32, ReduceOp::kSum, st), "time");
    CheckCuda(cudaEventRecord(t0, st), "record");
    for (int i = 0; i < 20; ++i)
      Check(s.comm->Allreduce(a, b, count, DataType::kFloat32, ReduceOp::kSum, st), "time");
    CheckCuda(cudaEventRecord(t1, st), "record");
    Check(s.comm->Synchronize(st), "time");
    float ms = 0;
    CheckCuda(cudaEventElapsedTime(&ms, t0, t1), "elapsed");
    return ms * 1000.0 / 20;
  };
  const double user_us = time_it(in, out);
  const double reg_us = bytes <= s.comm->registered_capacity() ? time_it(reg, reg) : 0;
  if (s.rank == 0)
    std::printf(
        "# time %zu bytes: out of place %.1f us (%.1f GB/s algbw), registered in place "
        "%.1f us\n",
        bytes, user_us, bytes / user_us / 1e3, reg_us);
  CheckCuda(cudaFree(in), "cudaFree");
  CheckCuda(cudaFree(out), "cudaFree");
  CheckCuda(cudaStreamDestroy(st), "stream");
}

// A soft check: a failed call counts as wrong instead of ending the run, so
// the sections after it still report.
bool Soft(Suite& s, const Status& st, const std::string& what, long long* bad) {
  if (st.ok()) return true;
  std::fprintf(stderr, "[rank %d] %s: %s\n", s.rank, what.c_str(), st.ToString().c_str());
  ++*bad;
  return false;
}

std::unique_ptr<Communicator> SideCommunicator(const Suite& s, const Topology& host, double timeout_s,
                                               size_t registered) {
  Knobs knobs = EnvironmentKnobs();
  knobs.peer_timeout_s = timeout_s;
  knobs.one_gpu_group = knobs.one_gpu_group || s.one_gpu_group;
  CommunicatorOptions opt;
  opt.registered_bytes = registered;
  auto c = CreateCudaCommunicator(MPI_COMM_WORLD, -1, knobs, opt, host);
  Check(c.status(), "side communicator");
  return c.consume();
}

// CUDA graphs. A round: select this round's input by a device round counter,
// Allreduce(in -> out) on a caller stream, keep out as the round's result,
// advance the counter. Graph A holds one round (an odd number of allreduces),
// graph B three; the schedule replays them back to back and mixes them with
// eager rounds, with no host synchronization in between; then every round's
// result is compared bitwise with the host fold. Run with the one-shot kernel
// forced (its staging half must alternate between consecutive calls, whoever
// issues them) and with the two-shot kernel.
void RunGraphReplay(Suite& s, const Topology& host, bool oneshot, uint64_t seed) {
  const DataType dtype = DataType::kFloat32;
  const ReduceOp op = ReduceOp::kSum;
  const size_t count = (1u << 20) + 3, bytes = count * 4;
  const std::string schedule = "eAAAeAeeBAeBBAAAAeAeA";
  size_t rounds = 0;
  for (char c : schedule) rounds += c == 'B' ? 3 : 1;
  std::unique_ptr<Communicator> comm = SideCommunicator(s, host, 20.0, 16u << 20);
  if (oneshot) Check(SetCudaKernelTuning(comm.get(), 16u << 20, 32, 64), "tuning");
  else Check(SetCudaKernelTuning(comm.get(), 0, 32, 64), "tuning");
  const std::string label = std::string("graph replay ") + (oneshot ? "one-shot" : "two-shot");

  std::vector<std::vector<char>> expected(rounds);
  std::vector<char> bank_host(rounds * bytes);
  for (size_t k = 0; k < rounds; ++k) {
    std::vector<std::vector<char>> inputs(s.layout.size, std::vector<char>(bytes));
    for (int r = 0; r < s.layout.size; ++r) FillInput(seed * 1000 + k, r, dtype, op, count, inputs[r].data());
    ExpectedResult(s.layout, s.hierarchical, dtype, op, inputs, count, &expected[k]);
    std::memcpy(bank_host.data() + k * bytes, inputs[s.rank].data(), bytes);
  }
  char *bank, *history, *in, *out;
  uint32_t* round;
  CheckCuda(cudaMalloc(&bank, rounds * bytes), "cudaMalloc");
  CheckCuda(cudaMalloc(&history, rounds * bytes), "cudaMalloc");
  CheckCuda(cudaMalloc(&in, bytes), "cudaMalloc");
  CheckCuda(cudaMalloc(&out, bytes), "cudaMalloc");
  CheckCuda(cudaMalloc(&round, sizeof(uint32_t)), "cudaMalloc");
  ToDevice(bank, bank_host.data(), rounds * bytes);
  Poison(history, rounds * bytes);
  CheckCuda(cudaMemset(round, 0, sizeof(uint32_t)), "memset");
  CheckCuda(cudaDeviceSynchronize(), "sync");
  cudaStream_t stream;
  CheckCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  long long bad = 0;
  auto enqueue_round = [&]() {
    CheckCuda(LaunchSelectRound(bank, in, bytes, round, stream), "select round");
    Soft(s, comm->Allreduce(in, out, count, dtype, op, stream), label, &bad);
    CheckCuda(LaunchStoreRound(out, history, bytes, round, stream), "store round");
    CheckCuda(LaunchNextRound(round, stream), "next round");
  };
  auto capture = [&](int n) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CheckCuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
    for (int i = 0; i < n; ++i) enqueue_round();
    CheckCuda(cudaStreamEndCapture(stream, &graph), "end capture");
    CheckCuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    CheckCuda(cudaGraphDestroy(graph), "graph destroy");
    return exec;
  };
  // The first eager round also caches the pointer checks before capture.
  enqueue_round();
  Soft(s, comm->Synchronize(stream), label, &bad);
  CheckCuda(cudaStreamSynchronize(stream), "sync");
  cudaGraphExec_t graph_a = capture(1), graph_b = capture(3);
  for (size_t i = 1; i < schedule.size(); ++i) {
    if (schedule[i] == 'e') enqueue_round();
    else CheckCuda(cudaGraphLaunch(schedule[i] == 'A' ? graph_a : graph_b, stream), "graph launch");
  }
  CheckCuda(cudaStreamSynchronize(stream), "sync");
  Soft(s, comm->Synchronize(stream), label, &bad);
  uint32_t done = 0;
  CheckCuda(cudaMemcpy(&done, round, sizeof(done), cudaMemcpyDeviceToHost), "D2H");
  if (done != rounds) {
    std::fprintf(stderr, "[rank %d] %s: %u rounds ran, %zu expected\n", s.rank, label.c_str(), done, rounds);
    ++bad;
  }
  std::vector<char> got(rounds * bytes);
  CheckCuda(cudaMemcpy(got.data(), history, rounds * bytes, cudaMemcpyDeviceToHost), "D2H");
  long long wrong_rounds = 0;
  for (size_t k = 0; k < rounds; ++k) {
    const long long b = Compare(s, label + " round " + std::to_string(k), dtype, got.data() + k * bytes,
                                expected[k].data(), count);
    wrong_rounds += b > 0;
    bad += b;
  }
  bad += CheckRanksEqual(s, got.data(), got.size());
  if (s.rank == 0)
    std::printf("#   %s: %zu rounds (%s), %lld wrong rounds on rank 0\n", label.c_str(), rounds,
                schedule.c_str(), wrong_rounds);
  CheckCuda(cudaGraphExecDestroy(graph_a), "graph destroy");
  CheckCuda(cudaGraphExecDestroy(graph_b), "graph destroy");
  CheckCuda(cudaStreamDestroy(stream), "stream destroy");
  for (void* p : {static_cast<void*>(bank), static_cast<void*>(history), static_cast<void*>(in),
                  static_cast<void*>(out), static_cast<void*>(round)})
    CheckCuda(cudaFree(p), "cudaFree");
  if (bad > 0) comm->Abort();
  comm.reset();
  Report(s, label.c_str(), bad);
  s.cases += 1;
  s.wrong += bad;
}

// Two caller streams: allreduces issued alternately on two streams with no
// synchronization between them (one-shot and two-shot sizes); the
// communicator must order them itself. Every result is checked.
void RunTwoStreams(Suite& s, const Topology& host, uint64_t seed) {
  const DataType dtype = DataType::kFloat32;
  const ReduceOp op = ReduceOp::kSum;
  const size_t counts[] = {65539, 3145729};
  const int kCalls = 4;  // per stream
  std::unique_ptr<Communicator> comm = SideCommunicator(s, host, 2.0, 16u << 20);
  cudaStream_t streams[2];
  for (cudaStream_t& st : streams) CheckCuda(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  struct Call {
    size_t count;
    char *in, *out;
    std::vector<char> expected;
  };
  std::vector<Call> calls(2 * kCalls);
  for (int i = 0; i < 2 * kCalls; ++i) {
    Call& c = calls[i];
    c.count = counts[(i / 2) % 2];
    const size_t bytes = c.count * 4;
    std::vector<std::vector<char>> inputs(s.layout.size, std::vector<char>(bytes));
    for (int r = 0; r < s.layout.size; ++r)
      FillInput(seed * 1000 + i, r, dtype, op, c.count, inputs[r].data());
    ExpectedResult(s.layout, s.hierarchical, dtype, op, inputs, c.count, &c.expected);
    CheckCuda(cudaMalloc(&c.in, bytes), "cudaMalloc");
    CheckCuda(cudaMalloc(&c.out, bytes), "cudaMalloc");
    ToDevice(c.in, inputs[s.rank].data(), bytes);
    Poison(c.out, bytes);
  }
  long long bad = 0;
  for (int i = 0; i < 2 * kCalls; ++i) {
    Call& c = calls[i];
    if (!Soft(s, comm->Allreduce(c.in, c.out, c.count, dtype, op, streams[i % 2]),
              "two streams, call " + std::to_string(i), &bad))
      break;
  }
  for (cudaStream_t st : streams) Soft(s, comm->Synchronize(st), "two streams", &bad);
  for (int i = 0; i < 2 * kCalls && bad == 0; ++i) {
    Call& c = calls[i];
    std::vector<char> got(c.count * 4);
    CheckCuda(cudaMemcpy(got.data(), c.out, got.size(), cudaMemcpyDeviceToHost), "D2H");
    bad += Compare(s, "two streams, call " + std::to_string(i), dtype, got.data(), c.expected.data(),
                   c.count);
  }
  for (Call& c : calls) {
    CheckCuda(cudaFree(c.in), "cudaFree");
    CheckCuda(cudaFree(c.out), "cudaFree");
  }
  for (cudaStream_t st : streams) CheckCuda(cudaStreamDestroy(st), "stream destroy");
  // Agree on the verdict first: a rank whose peer failed must not wait for it
  // in the communicator's closing barrier.
  long long any = 0;
  NVG_TOOL_MPI(MPI_Allreduce(&bad, &any, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
  if (any > 0) comm->Abort();
  comm.reset();
  if (s.rank == 0) std::printf("#   two caller streams: %d calls each, %s\n", kCalls, any ? "FAILED" : "ok");
  Report(s, "two streams", bad);
  s.cases += 1;
  s.wrong += bad;
}

// Peer exit: the last rank issues allreduces and exits (no MPI_Finalize) with
// them in flight and its memory mapped by the others; every other rank keeps
// calling Allreduce + Synchronize and must fail with kUnavailable naming that
// rank within a few seconds (before mpirun tears the job down). Ends the
// process: prints "peer exit: PASSED" or "FAILED" per surviving rank.
[[noreturn]] void RunPeerExit(Suite& s, const Topology& host) {
  std::unique_ptr<Communicator> comm = SideCommunicator(s, host, 20.0, 16u << 20);
  const int victim = s.layout.size - 1;
  const size_t count = 1u << 20;
  float* d = nullptr;
  CheckCuda(cudaMalloc(&d, count * 4), "cudaMalloc");
  std::vector<char> mine(count * 4);
  FillInput(77, s.rank, DataType::kFloat32, ReduceOp::kMax, count, mine.data());
  ToDevice(d, mine.data(), mine.size());
  NVG_TOOL_MPI(MPI_Barrier(MPI_COMM_WORLD));
  if (s.rank == victim) {
    for (int i = 0; i < 20; ++i)
      (void)comm->Allreduce(d, d, count, DataType::kFloat32, ReduceOp::kMax, nullptr);
    usleep(20000);  // some of them are running
    std::printf("# peer exit: rank %d exits now\n", s.rank);
    std::fflush(stdout);
    _exit(0);
  }
  const double t0 = MPI_Wtime();
  Status st;
  int calls = 0;
  while (st.ok() && MPI_Wtime() - t0 < 60) {
    st = comm->Allreduce(d, d, count, DataType::kFloat32, ReduceOp::kMax, nullptr);
    if (st.ok()) st = comm->Synchronize(nullptr);
    ++calls;
  }
  const double waited = MPI_Wtime() - t0;
  const std::string text = st.ToString();
  const bool named = text.find("rank " + std::to_string(victim)) != std::string::npos;
  const bool pass = st.code() == StatusCode::kUnavailable && named && waited < 10;
  std::printf("# peer exit: rank %d after %d calls, %.3f s: %s -> %s\n", s.rank, calls, waited, text.c_str(),
              pass ? "PASSED" : "FAILED");
  std::fflush(stdout);
  _exit(pass ? 0 : 1);
}

}  // namespace
}  // namespace tools
}  // namespace nvgroup

int main(int argc, char** argv) {
  using namespace nvgroup;
  using namespace nvgroup::tools;
  int provided = 0;
  NVG_TOOL_MPI(MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided));
  Args args = ParseArgs(argc, argv);
  Topology host;
  TopologyComms comms;
  Check(SplitNodes(MPI_COMM_WORLD, &host, &comms), "SplitNodes");
  Knobs knobs = EnvironmentKnobs();
  knobs.peer_timeout_s = 30;
  knobs.one_gpu_group = knobs.one_gpu_group || args.one_gpu_group;
  CommunicatorOptions opt;
  opt.registered_bytes = 256u << 20;  // the 1 GiB case runs in 4 pieces
  auto created = CreateCudaCommunicator(MPI_COMM_WORLD, -1, knobs, opt, host);
  Check(created.status(), "CreateCudaCommunicator");
  std::unique_ptr<Communicator> comm = created.consume();
  if (args.mode == "oneshot") Check(SetCudaKernelTuning(comm.get(), 16u << 20, 32, 64), "tuning");
  else if (args.mode == "twoshot")
    Check(SetCudaKernelTuning(comm.get(), 0, 32, args.twoshot_blocks), "tuning");
  else if (args.mode != "auto") Die("--mode must be auto, oneshot or twoshot");
  if (args.twoshot_chunk >= 0)
    Check(SetCudaTwoShotChunk(comm.get(), static_cast<size_t>(args.twoshot_chunk)), "chunk");

  Suite s{comm.get(), GatherLayout(comm->topology()), false, host.rank};
  s.one_gpu_group = args.one_gpu_group;
  s.hierarchical = s.layout.group_count > 1 || knobs.algorithm == AllreduceAlgorithm::kHierarchical;
  const Topology& t = comm->topology();
  int dev = comm->device().ordinal;
  char bus[32] = {};
  cudaDeviceGetPCIBusId(bus, sizeof(bus), dev);
  std::printf("# rank %d: cuda:%d bus %s group %d/%d rank-in-group %d/%d\n", t.rank, dev, bus, t.group_index,
              t.group_count, t.group_rank, t.group_size);
  std::fflush(stdout);
  NVG_TOOL_MPI(MPI_Barrier(MPI_COMM_WORLD));
  if (host.rank == 0)
    std::printf("# allreduce_check: %d ranks, %d group(s) of %d, mode %s, two-shot chunk %lld, %s path\n",
                t.size, t.group_count, t.group_size, args.mode.c_str(), args.twoshot_chunk,
                s.hierarchical ? "hierarchical" : "flat NV-group");

  const DataType dtypes[] = {DataType::kFloat32, DataType::kFloat16, DataType::kBFloat16,
                             DataType::kFloat64, DataType::kInt32,   DataType::kInt64};
  const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kAverage, ReduceOp::kMin, ReduceOp::kMax,
                          ReduceOp::kProduct};
  std::vector<size_t> sizes = {1,  2,   3,   7,    8,    9,     15,     16,      17,     31,
                               33, 100, 255, 1000, 4097, 65539, 262149, 1048583, 3145729};
  if (args.quick) sizes = {1, 3, 8, 17, 1000, 65539};
  uint64_t seed = 1;
  if (args.peer_exit_test) {
    comm.reset();
    RunPeerExit(s, host);
  }
  if (args.time_bytes > 0) {
    RunTiming(s, args.time_bytes);
    comm.reset();
    NVG_TOOL_MPI(MPI_Finalize());
    return 0;
  }
  if (args.only_timeout) {
    comm.reset();
    RunTimeout(s, host);
    long long bad = s.wrong, all_bad = 0;
    NVG_TOOL_MPI(MPI_Allreduce(&bad, &all_bad, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
    if (host.rank == 0) std::printf("# dead peer: %s\n", all_bad == 0 ? "PASSED" : "FAILED");
    NVG_TOOL_MPI(MPI_Finalize());
    return all_bad == 0 ? 0 : 1;
  }
  if (args.only_streams) {
    sizes.clear();
    args.large = false;
  }
  for (DataType d : dtypes) {
    if (sizes.empty()) break;
    const long long before = s.wrong;
    for (ReduceOp op : ops)
      for (size_t i = 0; i < sizes.size(); ++i)
        if (sizes[i] <= args.max_elems) RunCase(s, d, op, sizes[i], seed++, i % 2 == 1);
    Report(s, ShortName(d), s.wrong - before);
    if (host.rank == 0) std::printf("#   %-8s all ops, %zu sizes: done\n", ShortName(d), sizes.size());
    std::fflush(stdout);
  }
  if (args.large) {  // 16 MiB+odd, 256 MiB (one piece), 1 GiB (four pieces), bf16 96 MiB+odd
    RunCase(s, DataType::kFloat32, ReduceOp::kSum, (4u << 20) + 3, seed++, true);
    RunCase(s, DataType::kFloat32, ReduceOp::kSum, 64u << 20, seed++, false);
    RunCase(s, DataType::kBFloat16, ReduceOp::kAverage, (48u << 20) + 5, seed++, false);
    RunCase(s, DataType::kFloat32, ReduceOp::kAverage, 256u << 20, seed++, false);
    if (host.rank == 0) std::printf("#   large sizes up to 1 GiB: done\n");
  }
  if (!args.only_streams) {
    RunFused(s, DataType::kFloat32, seed++);
    RunFused(s, DataType::kFloat16, seed++);
    RunFused(s, DataType::kInt32, seed++);
    RunAllgatherBroadcast(s);
    RunBadInput(s);
  }
  comm.reset();
  if (!s.hierarchical) {  // graphs and streams: the NV-group kernels
    RunGraphReplay(s, host, true, seed++);
    RunGraphReplay(s, host, false, seed++);
    RunTwoStreams(s, host, seed++);
  }
  if (args.timeout_test) RunTimeout(s, host);

  long long totals[2] = {s.cases, s.wrong}, sum[2];
  NVG_TOOL_MPI(MPI_Allreduce(totals, sum, 2, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
  if (host.rank == 0)
    std::printf("# allreduce_check: %lld case-runs over all ranks, %lld wrong -> %s\n", sum[0], sum[1],
                sum[1] == 0 ? "PASSED" : "FAILED");
  NVG_TOOL_MPI(MPI_Finalize());
  return sum[1] == 0 ? 0 : 1;
}
