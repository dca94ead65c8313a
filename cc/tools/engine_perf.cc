// engine_perf: the full engine path on the GPU for a model's gradient set.
//
// Every step enqueues one named Average allreduce per gradient (in reverse
// order, as backprop produces them) through nvgroup::Enqueue with a ready
// event, exactly as the TF adapter does: negotiation -> fusion into the
// registered buffer (BatchedScaledCopy) -> NV-group kernel -> copy out ->
// done callback. A step ends when every callback has run (callbacks run after
// the output is complete on the device), so wall-clock time per step is the
// engine's latency for the set. The last step's outputs are checked against a
// float64 reference, every element. Compare with allreduce_perf's NCCL time
// for the same bytes from the same run (docs/PERFORMANCE.md).
//
// Per-phase breakdown, means per step over the timed steps:
//   enqueue   host time of the step's Enqueue calls, split into building
//             the requests (this program's share, as an adapter's) and the
//             Enqueue/EnqueueGroup calls (validation, queueing: the engine's)
//   drain     last Enqueue -> last done callback
//   and the engine's own counters (nvgroup::GetEngineStats): cycles and
//   buckets per step, background-thread seconds idle / in the agreement
//   allreduce / negotiating / executing (communicator calls, copies,
//   completions), ready-event waits and plan launches; then the parts of
//   those phases (admission, cache lookups, CPU completions) and the
//   group-level bookkeeping (queue entries, entries admitted one by one,
//   groups admitted and run whole, groups turned back into entries; Note
//   [Cached groups] in cc/engine/plan_cache.h).
// With `grouped` the step is one EnqueueGroup of every gradient (the
// DistributedOptimizer's bucket), else one Enqueue per gradient; with
// `registered` it is one EnqueueRegisteredGroup of the same requests,
// registered once before the first step (RegisterGroup, nvgroup/engine.h):
// the step fills only the pointer arrays, and one done callback ends it. With
// `inplace` every request's output is its input, as the TF adapter submits
// them whenever TF lets it forward the input buffer (ops/adapter.cc): on one
// rank with unit scales the engine then launches nothing at all. After the
// timed steps two more grouped calls check the fused bucket's other shapes
// (scaled, in place) every element against float64; `wrong` counts all.
//
// `cpu`: the same on host buffers (Device::Cpu, no CUDA call), for the
// engine's own cost on a machine without a GPU; `scale=N` divides every
// gradient's size by N (at least one element), as the CPU benchmark does.
//
// Usage: mpirun -np 2 engine_perf benchmarks/resnet50_gradients.txt [steps] [grouped|registered] [inplace] [cpu]
//        [scale=N]
// (`registered` needs an engine with registered groups: NVG_HAS_REGISTERED_GROUPS.)
#include <cuda_runtime.h>
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "nvgroup/engine.h"
#include "tools/tool_common.h"

int main(int argc, char** argv) {
  using namespace nvgroup;
  using namespace nvgroup::tools;
  int provided = 0;
  NVG_TOOL_MPI(MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided));
  if (argc < 2) Die("usage: engine_perf GRADIENT_TABLE [steps]");
  const int steps = argc > 2 ? std::stoi(argv[2]) : 20;
  bool grouped = false, registered = false, cpu = false, inplace = false;
  size_t scale = 1;
  for (int a = 3; a < argc; ++a) {
    const std::string arg = argv[a];
    if (arg == "grouped") grouped = true;
    else if (arg == "registered") registered = true;
    else if (arg == "cpu") cpu = true;
    else if (arg == "inplace") inplace = true;
    else if (arg.rfind("scale=", 0) == 0) scale = std::max<size_t>(1, std::stoul(arg.substr(6)));
    else if (arg != "per_tensor") Die("unknown argument " + arg);
  }
  Check(Init(EngineOptions{}), "engine Init");
  const int rank = Rank().value(), size = Size().value(), local = LocalRank().value();
  int dev = 0;
  if (!cpu) {
    int devices = 0;
    CheckCuda(cudaGetDeviceCount(&devices), "device count");
    dev = local % devices;
    CheckCuda(cudaSetDevice(dev), "set device");
  }
  const Device device = cpu ? Device::Cpu() : Device::Cuda(dev);
  // Buffers: device memory, or host memory with `cpu` (then copies are memcpy).
  auto alloc = [&](size_t bytes) -> float* {
    void* p = nullptr;
    if (cpu) p = std::malloc(std::max<size_t>(bytes, 1));
    else CheckCuda(cudaMalloc(&p, bytes), "cudaMalloc");
    if (p == nullptr) Die("out of host memory");
    return static_cast<float*>(p);
  };
  auto copy = [&](void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    if (cpu) std::memcpy(dst, src, bytes);
    else CheckCuda(cudaMemcpy(dst, src, bytes, kind), "cudaMemcpy");
  };

  std::ifstream in(argv[1]);
  if (!in) Die(std::string("cannot read ") + argv[1]);
  std::vector<size_t> counts;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ss(line);
    size_t idx, n;
    ss >> idx >> n;
    counts.push_back(std::max<size_t>(1, n / scale));
  }
  const int n = static_cast<int>(counts.size());
  size_t total = 0;
  std::vector<float*> d_in(n), d_out(n);
  std::vector<std::vector<float>> host(n);
  for (int t = 0; t < n; ++t) {
    total += counts[t];
    host[t].resize(counts[t]);
    for (size_t i = 0; i < counts[t]; ++i)
      host[t][i] = static_cast<float>(2.0 * Uniform(t + 1, rank, i) - 1.0);
    d_in[t] = alloc(counts[t] * 4);
    d_out[t] = alloc(counts[t] * 4);
    copy(d_in[t], host[t].data(), counts[t] * 4, cudaMemcpyHostToDevice);
  }
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr;
  if (!cpu) {
    CheckCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    CheckCuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "event");
    CheckCuda(cudaDeviceSynchronize(), "sync");
  }

  std::mutex mu;
  std::condition_variable cv;
  int pending = 0;
  Status first_error;
  // `registered`: the step's requests, registered once (the order of the
  // grouped step's: reverse), and their pointer arrays.
  uint64_t registered_group = 0;
  std::vector<const void*> launch_in(n);
  std::vector<void*> launch_out(n);
  // Gradient t's request without its buffers (the same for every style).
  auto gradient_request = [&](int t) {
    CollectiveRequest q;
    q.name = "grad_" + std::to_string(t);
    q.type = CollectiveType::kAllreduce;
    q.dtype = DataType::kFloat32;
    q.device = device;
    q.shape = {static_cast<int64_t>(counts[t])};
    q.op = ReduceOp::kAverage;
    return q;
  };
  if (registered) {
#ifdef NVG_HAS_REGISTERED_GROUPS
    std::vector<CollectiveRequest> members;
    for (int t = n - 1; t >= 0; --t) members.push_back(gradient_request(t));
    StatusOr<uint64_t> handle = RegisterGroup(std::move(members));
    Check(handle.status(), "RegisterGroup");
    registered_group = handle.value();
#else
    Die("`registered` needs an engine with registered groups (RegisterGroup)");
#endif
  }
  double enqueue_s = 0, build_s = 0, drain_s = 0;  // summed over steps
  auto step = [&] {
    if (!cpu) CheckCuda(cudaEventRecord(ready, stream), "record");  // "the gradients are produced"
    {
      std::lock_guard<std::mutex> l(mu);
      pending = n;
    }
    const double t0 = MPI_Wtime();
    double submit = 0;  // seconds inside Enqueue
#ifdef NVG_HAS_REGISTERED_GROUPS
    if (registered) {
      for (int k = 0; k < n; ++k) {
        launch_in[k] = d_in[n - 1 - k];
        launch_out[k] = inplace ? d_in[n - 1 - k] : d_out[n - 1 - k];
      }
      GroupLaunch launch;
      launch.inputs = launch_in.data();
      launch.outputs = launch_out.data();
      launch.count = n;
      launch.ready_event = ready;
      launch.done = [&](const Status& s) {
        std::lock_guard<std::mutex> l(mu);
        if (!s.ok() && first_error.ok()) first_error = s;
        pending = 0;
        cv.notify_all();
      };
      const double s0 = MPI_Wtime();
      Check(EnqueueRegisteredGroup(registered_group, std::move(launch)), "EnqueueRegisteredGroup");
      submit += MPI_Wtime() - s0;
    }
#endif
    std::vector<CollectiveRequest> group_requests;
    if (grouped) group_requests.reserve(n);
    for (int t = n - 1; t >= 0 && !registered; --t) {
      CollectiveRequest q = gradient_request(t);
      q.input = d_in[t];
      q.output = inplace ? d_in[t] : d_out[t];
      q.ready_event = ready;
      q.done = [&](const Status& s) {
        std::lock_guard<std::mutex> l(mu);
        if (!s.ok() && first_error.ok()) first_error = s;
        if (--pending == 0) cv.notify_all();
      };
      if (grouped) {
        group_requests.push_back(std::move(q));
      } else {
        const double s0 = MPI_Wtime();
        Check(Enqueue(std::move(q)), "Enqueue");
        submit += MPI_Wtime() - s0;
      }
    }
    if (grouped) {
      const double s0 = MPI_Wtime();
      Check(EnqueueGroup(std::move(group_requests)), "EnqueueGroup");
      submit += MPI_Wtime() - s0;
    }
    const double t1 = MPI_Wtime();
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return pending == 0; });
    enqueue_s += t1 - t0;
    build_s += t1 - t0 - submit;
    drain_s += MPI_Wtime() - t1;
    Check(first_error, "allreduce");
  };
  for (int i = 0; i < 3; ++i) step();
  NVG_TOOL_MPI(MPI_Barrier(MPI_COMM_WORLD));
  enqueue_s = build_s = drain_s = 0;
  StatusOr<EngineStats> before = GetEngineStats();
  Check(before.status(), "GetEngineStats");
  const double t0 = MPI_Wtime();
  for (int i = 0; i < steps; ++i) step();
  double us = (MPI_Wtime() - t0) * 1e6 / steps, sum = 0;
  StatusOr<EngineStats> after = GetEngineStats();
  Check(after.status(), "GetEngineStats");
  NVG_TOOL_MPI(MPI_Allreduce(&us, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
  // Per-phase breakdown, rank 0's view (means per step).
  const EngineStats& a = before.value();
  const EngineStats& b = after.value();
  auto per_step = [&](double v) { return v / steps; };
  if (rank == 0)
    std::printf(
        "# engine_perf phases (rank 0, per step, %s%s): enqueue %.1f us (building the requests %.1f us, "
        "Enqueue calls %.1f us), enqueue->last done %.1f us | "
        "engine thread: idle %.1f us, agreement %.1f us, negotiation %.1f us, execution %.1f us | "
        "%.2f cycles, %.2f agreement allreduces, %.2f buckets, %.2f ready-event waits, %.2f plan launches, "
        "%.2f negotiation rounds\n",
        registered ? "one EnqueueRegisteredGroup"
        : grouped  ? "one EnqueueGroup"
                   : "one Enqueue per tensor",
        inplace ? ", in place" : "", per_step(enqueue_s) * 1e6, per_step(build_s) * 1e6,
        per_step(enqueue_s - build_s) * 1e6, per_step(drain_s) * 1e6, per_step(b.idle_s - a.idle_s) * 1e6,
        per_step(b.agree_s - a.agree_s) * 1e6, per_step(b.negotiate_s - a.negotiate_s) * 1e6,
        per_step(b.execute_s - a.execute_s) * 1e6, per_step(static_cast<double>(b.cycles - a.cycles)),
        per_step(static_cast<double>(b.agreement_allreduces - a.agreement_allreduces)),
        per_step(static_cast<double>(b.buckets - a.buckets)),
        per_step(static_cast<double>(b.ready_event_waits - a.ready_event_waits)),
        per_step(static_cast<double>(b.plan_launches - a.plan_launches)),
        per_step(static_cast<double>(b.negotiation_rounds - a.negotiation_rounds)));
  auto count = [&](uint64_t before_v, uint64_t after_v) {
    return per_step(static_cast<double>(after_v - before_v));
  };
  if (rank == 0)
    std::printf(
        "# engine_perf parts (rank 0, per step): admission %.1f us, cache lookups %.1f us, completions "
        "%.1f us (CPU only) | %.2f queue entries, %.2f entries admitted one by one, %.2f groups admitted "
        "whole, %.2f run whole, %.2f turned back into entries\n",
        per_step(b.admit_s - a.admit_s) * 1e6, per_step(b.lookup_s - a.lookup_s) * 1e6,
        per_step(b.complete_s - a.complete_s) * 1e6, count(a.queue_entries, b.queue_entries),
        count(a.admitted_entries, b.admitted_entries),
        count(a.cached_group_admissions, b.cached_group_admissions),
        count(a.cached_group_runs, b.cached_group_runs),
        count(a.cached_group_demotions, b.cached_group_demotions));

  // In place, the timed steps averaged the inputs over and over: put them back
  // and run the step once more, so the check below sees one step's result.
  auto restore_inputs = [&] {
    for (int t = 0; t < n; ++t) copy(d_in[t], host[t].data(), counts[t] * 4, cudaMemcpyHostToDevice);
  };
  if (inplace) {
    restore_inputs();
    step();
  }
  // Verify the last step: every element of every gradient vs float64 / size.
  long long wrong = 0;
  const double bound = (size + 2.0) * std::ldexp(1.0, -24);
  for (int t = 0; t < n; ++t) {
    std::vector<float> got(counts[t]);
    copy(got.data(), inplace ? d_in[t] : d_out[t], counts[t] * 4, cudaMemcpyDeviceToHost);
    for (size_t i = 0; i < counts[t]; ++i) {
      double ref = 0;
      for (int r = 0; r < size; ++r) ref += static_cast<float>(2.0 * Uniform(t + 1, r, i) - 1.0);
      if (!(std::fabs(got[i] - ref / size) <= bound)) ++wrong;
    }
  }
  if (inplace) restore_inputs();  // the checks below read the original inputs
  // The fused bucket's other shapes (Communicator::FusedAllreduce; on one rank
  // the direct copies of cc/kernels/batched_copy.cu "Fused buckets"), one
  // EnqueueGroup each, every element checked against float64:
  //   scaled    Sum, prescale 0.5 and postscale 3 (one rank: two launches),
  //             even tensors out of place, odd ones in place;
  //   inplace   Sum in place with unit scales (one rank: no launch at all).
  long long variant_wrong = 0;
  struct Variant {
    const char* name;
    double prescale, postscale;
    bool all_in_place;
  };
  for (const Variant& v : {Variant{"scaled", 0.5, 3.0, false}, Variant{"inplace", 1.0, 1.0, true}}) {
    std::vector<CollectiveRequest> group;
    {
      std::lock_guard<std::mutex> l(mu);
      pending = n;
    }
    for (int t = 0; t < n; ++t) {
      const bool in_place = v.all_in_place || t % 2 == 1;
      if (in_place) copy(d_out[t], d_in[t], counts[t] * 4, cudaMemcpyDeviceToDevice);
      CollectiveRequest q;
      q.name = std::string("check_") + v.name + "_" + std::to_string(t);
      q.type = CollectiveType::kAllreduce;
      q.dtype = DataType::kFloat32;
      q.device = device;
      q.shape = {static_cast<int64_t>(counts[t])};
      q.input = in_place ? d_out[t] : d_in[t];
      q.output = d_out[t];
      q.op = ReduceOp::kSum;
      q.prescale_factor = v.prescale;
      q.postscale_factor = v.postscale;
      q.done = [&](const Status& s) {
        std::lock_guard<std::mutex> l(mu);
        if (!s.ok() && first_error.ok()) first_error = s;
        if (--pending == 0) cv.notify_all();
      };
      group.push_back(std::move(q));
    }
    if (!cpu) CheckCuda(cudaDeviceSynchronize(), "sync before the check");  // the D2D copies are the inputs
    Check(EnqueueGroup(std::move(group)), "EnqueueGroup (check)");
    {
      std::unique_lock<std::mutex> l(mu);
      cv.wait(l, [&] { return pending == 0; });
    }
    Check(first_error, v.name);
    long long bad = 0;
    for (int t = 0; t < n; ++t) {
      std::vector<float> got(counts[t]);
      copy(got.data(), d_out[t], counts[t] * 4, cudaMemcpyDeviceToHost);
      for (size_t i = 0; i < counts[t]; ++i) {
        double ref = 0, magnitude = 0;
        for (int r = 0; r < size; ++r) {
          const double x = static_cast<double>(static_cast<float>(2.0 * Uniform(t + 1, r, i) - 1.0)) *
                           v.prescale;
          ref += x;
          magnitude += std::fabs(x);
        }
        ref *= v.postscale;
        if (!(std::fabs(got[i] - ref) <=
              (size + 3.0) * std::ldexp(1.0, -24) * magnitude * std::fabs(v.postscale)))
          ++bad;
      }
    }
    if (rank == 0)
      std::printf("# engine_perf check %s (pre %g, post %g): %lld wrong of %zu\n", v.name, v.prescale,
                  v.postscale, bad, total);
    variant_wrong += bad;
  }
  wrong += variant_wrong;
  long long all_wrong = 0;
  NVG_TOOL_MPI(MPI_Allreduce(&wrong, &all_wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
  if (rank == 0)
    std::printf(
        "# engine_perf: %d ranks, %d tensors, %zu floats (%.1f MB, %s): %.1f us per step "
        "(mean of %d, enqueue -> last callback), wrong %lld\n",
        size, n, total, total * 4 / 1e6, cpu ? "host memory" : "device memory", sum / size, steps, all_wrong);
  for (int t = 0; t < n; ++t) {
    if (cpu) {
      std::free(d_in[t]);
      std::free(d_out[t]);
    } else {
      CheckCuda(cudaFree(d_in[t]), "cudaFree");
      CheckCuda(cudaFree(d_out[t]), "cudaFree");
    }
  }
  Check(Shutdown(), "Shutdown");
  NVG_TOOL_MPI(MPI_Finalize());
  return all_wrong == 0 ? 0 : 1;
}
