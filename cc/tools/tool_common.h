// Shared helpers of the GPU tools (allreduce_check, allreduce_perf): random
// test data, the host-side expected result (cc/cpu/host_reduce.h folds in the
// communicator's order), and the tools' error handling. Tools are front ends:
// they may print and exit; the engine never does.
#pragma once

#include <cuda_runtime.h>
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/checks.h"
#include "common/env.h"
#include "cpu/half.h"
#include "cpu/host_reduce.h"
#include "nvgroup/communicator.h"
#include "nvgroup/status.h"
#include "nvgroup/types.h"

namespace nvgroup {
namespace tools {

// Fails the tool on every rank (MPI_Abort) with the message, prefixed by rank.
inline void Die(const std::string& what) {
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "[rank %d] FATAL: %s\n", rank, what.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
}
inline void Check(const Status& s, const std::string& what) {
  if (!s.ok()) Die(what + ": " + s.ToString());
}
// The NVGROUP_* settings of the environment (cc/common/env.h), where the
// tools start from before overriding what a run needs; a malformed value
// stops the tool naming it.
inline Knobs EnvironmentKnobs() {
  StatusOr<Knobs> knobs = ParseKnobsFromEnvironment();
  Check(knobs.status(), "NVGROUP_* settings");
  return knobs.value();
}
// Every MPI call of the tools goes through this, with the call's text: a
// failure stops the tool on every rank with MPI's own error string.
inline void CheckMpi(int rc, const char* what) {
  if (rc != MPI_SUCCESS) Die(std::string(what) + " failed: " + MpiErrorString(rc));
}
#define NVG_TOOL_MPI(call) ::nvgroup::tools::CheckMpi((call), #call)
inline void CheckCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) Die(std::string(what) + ": " + cudaGetErrorString(e));
}

// splitmix64: a stateless hash, so any rank can regenerate any rank's input.
inline uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
inline double Uniform(uint64_t seed, int rank, size_t i) {  // [0, 1)
  return (Mix(seed * 0x100000001b3ull ^ (static_cast<uint64_t>(rank) << 48) ^ i) >> 11) * 0x1.0p-53;
}

// Element i of `rank`'s input for (seed, dtype, op): values that keep every
// op finite (products near 1, integer sums small), exactly representable.
inline void FillInput(uint64_t seed, int rank, DataType dtype, ReduceOp op, size_t count, void* dst) {
  const bool prod = op == ReduceOp::kProduct;
  for (size_t i = 0; i < count; ++i) {
    const double u = Uniform(seed, rank, i);
    const double f = prod ? 0.5 + 1.5 * u : 2.0 * u - 1.0;
    switch (dtype) {
      case DataType::kFloat16: static_cast<uint16_t*>(dst)[i] = FloatToHalf(static_cast<float>(f)); break;
      case DataType::kBFloat16:
        static_cast<uint16_t*>(dst)[i] = FloatToBFloat16(static_cast<float>(f));
        break;
      case DataType::kFloat32: static_cast<float*>(dst)[i] = static_cast<float>(f); break;
      case DataType::kFloat64: static_cast<double*>(dst)[i] = f; break;
      case DataType::kInt32:
        static_cast<int32_t*>(dst)[i] =
            prod ? static_cast<int32_t>(u * 7) - 3
            : (op == ReduceOp::kSum || op == ReduceOp::kAverage)
                ? static_cast<int32_t>(u * 2001) - 1000
                : static_cast<int32_t>(Mix(i ^ (static_cast<uint64_t>(rank) << 40) ^ seed));
        break;
      case DataType::kInt64:
        static_cast<int64_t*>(dst)[i] =
            prod ? static_cast<int64_t>(u * 7) - 3
            : (op == ReduceOp::kSum || op == ReduceOp::kAverage)
                ? static_cast<int64_t>(u * 2000001) - 1000000
                : static_cast<int64_t>(Mix(i ^ (static_cast<uint64_t>(rank) << 40) ^ seed));
        break;
      default: Die("FillInput: unsupported dtype");
    }
  }
}

inline double ToDouble(DataType dtype, const void* p, size_t i) {
  switch (dtype) {
    case DataType::kFloat16: return HalfToFloat(static_cast<const uint16_t*>(p)[i]);
    case DataType::kBFloat16: return BFloat16ToFloat(static_cast<const uint16_t*>(p)[i]);
    case DataType::kFloat32: return static_cast<const float*>(p)[i];
    case DataType::kFloat64: return static_cast<const double*>(p)[i];
    case DataType::kInt32: return static_cast<const int32_t*>(p)[i];
    case DataType::kInt64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    default: return 0;
  }
}

// Unit roundoff of the element type (float16: 2^-11, bfloat16: 2^-8, ...).
inline double UnitRoundoff(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat16: return std::ldexp(1.0, -11);
    case DataType::kBFloat16: return std::ldexp(1.0, -8);
    case DataType::kFloat32: return std::ldexp(1.0, -24);
    case DataType::kFloat64: return std::ldexp(1.0, -53);
    default: return 0;
  }
}

// Who sits where: every rank's (group_index, group_rank), gathered.
struct Layout {
  int size = 1;
  int group_count = 1;
  int group_size = 1;
  std::vector<int> rank_at;  // rank_at[group_index * group_size + group_rank]
};
inline Layout GatherLayout(const Topology& t) {
  Layout l;
  l.size = t.size;
  l.group_count = t.group_count;
  l.group_size = t.group_size;
  std::vector<int> pos(2 * t.size);
  int mine[2] = {t.group_index, t.group_rank};
  NVG_TOOL_MPI(MPI_Allgather(mine, 2, MPI_INT, pos.data(), 2, MPI_INT, MPI_COMM_WORLD));
  l.rank_at.assign(t.size, -1);
  for (int r = 0; r < t.size; ++r) l.rank_at[pos[2 * r] * t.group_size + pos[2 * r + 1]] = r;
  return l;
}

// The exact result the communicator must produce (see p2p_allreduce.cuh,
// "Determinism"): fold members in group_rank order, then groups in
// group_index order; one level when there is one group and no forced hierarchy.
inline void ExpectedResult(const Layout& l, bool hierarchical, DataType dtype, ReduceOp op,
                           const std::vector<std::vector<char>>& inputs, size_t count,
                           std::vector<char>* expected) {
  const size_t bytes = count * DataTypeSize(dtype);
  expected->assign(bytes, 0);
  if (l.size == 1) {
    *expected = inputs[0];
    return;
  }
  if (!hierarchical) {
    std::vector<const void*> src;
    for (int p = 0; p < l.group_size; ++p) src.push_back(inputs[l.rank_at[p]].data());
    Check(ReduceFold(dtype, op, src.data(), l.group_size, expected->data(), count,
                     op == ReduceOp::kAverage ? l.size : 1),
          "host fold");
    return;
  }
  std::vector<std::vector<char>> group_sums(l.group_count, std::vector<char>(bytes));
  std::vector<const void*> src;
  for (int g = 0; g < l.group_count; ++g) {
    src.clear();
    for (int p = 0; p < l.group_size; ++p) src.push_back(inputs[l.rank_at[g * l.group_size + p]].data());
    Check(ReduceFold(dtype, op, src.data(), l.group_size, group_sums[g].data(), count, 1), "host fold");
  }
  src.clear();
  for (int g = 0; g < l.group_count; ++g) src.push_back(group_sums[g].data());
  Check(ReduceFold(dtype, op, src.data(), l.group_count, expected->data(), count,
                   op == ReduceOp::kAverage ? l.size : 1),
        "host fold");
}

inline uint64_t HashBytes(const void* p, size_t n) {
  const unsigned char* b = static_cast<const unsigned char*>(p);
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

inline const char* ShortName(DataType d) {
  switch (d) {
    case DataType::kFloat16: return "half";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kFloat32: return "float";
    case DataType::kFloat64: return "double";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    default: return DataTypeName(d);
  }
}

}  // namespace tools
}  // namespace nvgroup
