// cross_exchange_cost: what one call of the cross-group exchange
// (CrossExchange, cc/algorithms/cross_exchange.h) costs on host buffers: Start
// + Wait of one float32 Sum slice among all ranks (the peers), against
// MPI_Allreduce of the same bytes. Per size and variant every call is timed
// alone (barrier, call, max over ranks) and the median is printed; the
// smallest sizes are the fixed cost per call. The variants run call by call in
// turn (rotated each iteration), so load drifts hit them alike:
//   allgather   the exchange as configured (NVGROUP_CROSS_ALLGATHER_MAX_BYTES
//               default: allgather + fold for small slices)
//   rs+ag       reduce-scatter + allgather at every size
//   no-thread   as configured, without the progress thread (Start and Wait
//               progress; what MPI without MPI_THREAD_MULTIPLE gets)
//   base        (built by scripts/cross_exchange_cost.sh) a baseline commit's
//               CrossExchange, renamed BaseCrossExchange
//   mpi         MPI_Allreduce in place
// Every call's result is checked bitwise against the exact sum (small integers).
// Flags: --json FILE --commit REV --base_commit REV --max_bytes N.
#include <mpi.h>
#include <sys/utsname.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "algorithms/cross_exchange.h"
#include "common/checks.h"
#include "common/env.h"
#include "cpu/host_reduce.h"
#if NVG_WITH_BASE_CROSS_EXCHANGE
#include "base_cross_exchange.h"
#endif

namespace nvgroup {
namespace {

void Die(const std::string& what) {
  std::fprintf(stderr, "cross_exchange_cost: %s\n", what.c_str());
  MPI_Abort(MPI_COMM_WORLD, 2);
}

void Check(const Status& s, const char* what) {
  if (!s.ok()) Die(std::string(what) + ": " + s.ToString());
}

template <class Exchange>
Status ExchangeOnce(Exchange& x, const float* send, void* recv, float* result, size_t count,
                    const typename Exchange::Fold& fold) {
  typename Exchange::Job job;
  job.send = send;
  job.recv = recv;
  job.result = result;
  job.count = count;
  job.element_size = sizeof(float);
  job.fold = fold;
  uint64_t ticket = 0;
  NVG_RETURN_IF_ERROR(x.Start(std::move(job), &ticket));
  return x.Wait(ticket);
}

struct Variant {
  std::string name;
  std::function<void(size_t count)> call;
  std::vector<double> us;  // max over ranks, per call
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace
}  // namespace nvgroup

int main(int argc, char** argv) {
  using namespace nvgroup;
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::string json, commit = "unknown", base_commit = "";
  size_t max_bytes = 4u << 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) Die("missing value after " + a);
    if (a == "--json") json = argv[++i];
    else if (a == "--commit") commit = argv[++i];
    else if (a == "--base_commit") base_commit = argv[++i];
    else if (a == "--max_bytes") max_bytes = std::stoull(argv[++i]);
    else Die("unknown flag " + a);
  }
  StatusOr<Knobs> knobs = ParseKnobsFromEnvironment();
  Check(knobs.status(), "settings");
  CrossExchange::Options with_allgather;
  with_allgather.allgather_max_bytes = knobs.value().cross_allgather_max_bytes;
  auto x_ag = CrossExchange::Create(MPI_COMM_WORLD, with_allgather);
  Check(x_ag.status(), "CrossExchange::Create");
  auto x_rs = CrossExchange::Create(MPI_COMM_WORLD);  // allgather_max_bytes 0: reduce-scatter + allgather
  Check(x_rs.status(), "CrossExchange::Create");
  CrossExchange::Options caller_only = with_allgather;
  caller_only.use_thread = false;
  auto x_caller = CrossExchange::Create(MPI_COMM_WORLD, caller_only);
  Check(x_caller.status(), "CrossExchange::Create");
#if NVG_WITH_BASE_CROSS_EXCHANGE
  auto x_base = BaseCrossExchange::Create(MPI_COMM_WORLD);
  Check(x_base.status(), "BaseCrossExchange::Create");
#endif
  const CrossExchange::Fold fold = HostFold(DataType::kFloat32, ReduceOp::kSum, 1);
  const size_t max_count = max_bytes / sizeof(float);
  std::vector<float> send(max_count), result(max_count), want(max_count);
  std::vector<char> recv(std::max(x_ag.value()->MaxRecvBytes(max_bytes),
                                  x_rs.value()->MaxRecvBytes(max_bytes)));
  for (size_t i = 0; i < max_count; ++i) {
    send[i] = static_cast<float>(static_cast<int>((i * 7 + rank) % 13) - 6);
    double s = 0;
    for (int r = 0; r < size; ++r) s += static_cast<int>((i * 7 + r) % 13) - 6;
    want[i] = static_cast<float>(s);
  }
  long long wrong = 0;
  auto checked = [&](size_t count) {
    if (std::memcmp(result.data(), want.data(), count * sizeof(float)) != 0) ++wrong;
  };
  std::vector<Variant> variants;
  variants.push_back({"allgather", [&](size_t n) {
    Check(ExchangeOnce(*x_ag.value(), send.data(), recv.data(), result.data(), n, fold), "ag");
  }, {}});
  variants.push_back({"rs+ag", [&](size_t n) {
    Check(ExchangeOnce(*x_rs.value(), send.data(), recv.data(), result.data(), n, fold), "rs");
  }, {}});
  variants.push_back({"no-thread", [&](size_t n) {
    Check(ExchangeOnce(*x_caller.value(), send.data(), recv.data(), result.data(), n, fold), "no-thread");
  }, {}});
#if NVG_WITH_BASE_CROSS_EXCHANGE
  // A baseline's fold takes the peers' copies as a pointer array, as ours, or
  // (before our own share stayed in `send`) as P contiguous copies.
  const BaseCrossExchange::Fold base_fold = [&fold](auto sources, int num, void* dst, size_t count) {
    if constexpr (std::is_same_v<decltype(sources), const void*>) {
      std::vector<const void*> copies(num);
      for (int k = 0; k < num; ++k) copies[k] = static_cast<const char*>(sources) + k * count * sizeof(float);
      return fold(copies.data(), num, dst, count);
    } else {
      return fold(sources, num, dst, count);
    }
  };
  variants.push_back({"base", [&](size_t n) {
    Check(ExchangeOnce(*x_base.value(), send.data(), recv.data(), result.data(), n, base_fold), "base");
  }, {}});
#endif
  variants.push_back({"mpi", [&](size_t n) {
    std::memcpy(result.data(), send.data(), n * sizeof(float));
    if (MPI_Allreduce(MPI_IN_PLACE, result.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD) !=
        MPI_SUCCESS)
      Die("MPI_Allreduce");
  }, {}});
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) < 0) load[0] = -1;
  struct utsname host{};
  uname(&host);
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  if (rank == 0) {
    std::printf(
        "# cross_exchange_cost: %d ranks, MPI_THREAD_MULTIPLE=%d, host %s, %s, load %.2f, commit %s%s%s\n",
        size, provided == MPI_THREAD_MULTIPLE, host.nodename, date, load[0], commit.c_str(),
        base_commit.empty() ? "" : ", base ", base_commit.c_str());
    std::printf("# median us per call (max over ranks); allgather = NVGROUP_CROSS_ALLGATHER_MAX_BYTES %zu\n",
                with_allgather.allgather_max_bytes);
    std::printf("%10s", "bytes");
    for (const Variant& v : variants) std::printf(" %10s", v.name.c_str());
    std::printf("\n");
  }
  std::string rows;
  for (size_t bytes = 4; bytes <= max_bytes; bytes = bytes < 4096 ? 4096 : bytes * 4) {
    const size_t count = bytes / sizeof(float);
    const int iters = static_cast<int>(std::max<size_t>(30, std::min<size_t>(400, (64u << 20) / bytes)));
    for (Variant& v : variants) v.us.clear();
    for (int it = -3; it < iters; ++it) {  // 3 warmup rounds
      for (size_t k = 0; k < variants.size(); ++k) {
        Variant& v = variants[(k + static_cast<size_t>(it + 3)) % variants.size()];
        std::fill(result.begin(), result.begin() + count, -1.0f);
        MPI_Barrier(MPI_COMM_WORLD);
        const double t0 = MPI_Wtime();
        v.call(count);
        double us = (MPI_Wtime() - t0) * 1e6, worst = 0;
        checked(count);
        MPI_Allreduce(&us, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (it >= 0) v.us.push_back(worst);
      }
    }
    if (rank == 0) {
      std::printf("%10zu", bytes);
      rows += std::string(rows.empty() ? "" : ",\n") + "  {\"bytes\": " + std::to_string(bytes) +
              ", \"iters\": " + std::to_string(iters);
      for (const Variant& v : variants) {
        std::printf(" %10.1f", Median(v.us));
        rows += ", \"" + v.name + "_us\": " + std::to_string(Median(v.us));
      }
      rows += "}";
      std::printf("\n");
    }
  }
  long long all_wrong = 0;
  MPI_Allreduce(&wrong, &all_wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  double load_after[3] = {0, 0, 0};
  if (getloadavg(load_after, 3) < 0) load_after[0] = -1;
  if (rank == 0) {
    std::printf("# wrong results: %lld, load after %.2f\n", all_wrong, load_after[0]);
    if (!json.empty()) {
      FILE* f = std::fopen(json.c_str(), "w");
      if (f == nullptr) Die("cannot write " + json);
      std::fprintf(
          f,
          "{\"tool\": \"cross_exchange_cost\", \"machine\": \"%s\", \"date\": \"%s\", \"commit\": \"%s\", "
          "\"base_commit\": \"%s\", \"ranks\": %d, \"load_before\": %.2f, \"load_after\": %.2f, "
          "\"allgather_max_bytes\": %zu, \"wrong\": %lld, \"rows\": [\n%s\n]}\n",
          host.nodename, date, commit.c_str(), base_commit.c_str(), size, load[0], load_after[0],
          with_allgather.allgather_max_bytes, all_wrong, rows.c_str());
      std::fclose(f);
    }
  }
  x_ag.value().reset();
  x_rs.value().reset();
  x_caller.value().reset();
#if NVG_WITH_BASE_CROSS_EXCHANGE
  x_base.value().reset();
#endif
  MPI_Finalize();
  return all_wrong == 0 ? 0 : 1;
}
