// The engine's public API (nvgroup/engine.h): Init, Shutdown, topology,
// Enqueue/EnqueueGroup. Validates requests on the caller's thread and hands
// them to the running Engine (background_loop.h, where the pipeline and its
// design constraints are described).
#include "nvgroup/engine.h"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <mutex>

#include "common/checks.h"
#include "common/env.h"
#include "common/logging.h"
#include "engine/background_loop.h"
#include "engine/engine_control.h"
#include "engine/mpi_wait.h"

namespace nvgroup {
namespace {

// Init's own collectives wait at least this long: ranks reach hvd.init() after
// importing TensorFlow, which takes tens of seconds on a loaded host, so the
// peer timeout (meant for a running job) would be too eager here.
constexpr double kMinInitTimeoutS = 120.0;

uint64_t GroupId(const std::vector<CollectiveRequest>& requests) {
  // FNV-1a 64 (Fowler/Noll/Vo offset basis and prime) over the sorted names,
  // '\0'-separated: the same on every rank that submits the same set of
  // names, whatever their order.
  std::vector<std::string> names;
  for (const CollectiveRequest& r : requests) names.push_back(r.name);
  std::sort(names.begin(), names.end());
  uint64_t h = 1469598103934665603ull;
  for (const std::string& n : names) {
    for (unsigned char c : n) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0) * 1099511628211ull;
  }
  return h == 0 ? 1 : h;  // 0 means "not grouped"
}

std::mutex g_mu;                  // guards the three below
std::shared_ptr<Engine> g_engine;
bool g_initialized_mpi = false;   // Init called MPI_Init_thread

Status ValidateRequest(const CollectiveRequest& q, int size) {
  const std::string who = "collective '" + q.name + "'";
  if (q.name.empty()) return Status::InvalidArgument("a collective needs a non-empty name");
  if (static_cast<int>(q.dtype) >= kNumDataTypes)
    return Status::InvalidArgument(who + ": unknown dtype " + std::to_string(static_cast<int>(q.dtype)));
  if (static_cast<int>(q.type) > static_cast<int>(CollectiveType::kBroadcast))
    return Status::InvalidArgument(who + ": unknown collective type " + std::to_string(static_cast<int>(q.type)));
  if (!q.done) return Status::InvalidArgument(who + ": no done callback");
  // Element and byte counts must fit in int64 (they travel as such and size
  // every buffer computation).
  int64_t bytes = static_cast<int64_t>(DataTypeSize(q.dtype));
  for (int64_t d : q.shape) {
    if (d < 0) return Status::InvalidArgument(who + ": negative dimension in shape " + ShapeToString(q.shape));
    if (__builtin_mul_overflow(bytes, d, &bytes))
      return Status::InvalidArgument(who + ": shape " + ShapeToString(q.shape) + " is too large");
  }
  if (q.device.kind == DeviceKind::kCuda) {
    if (q.device.ordinal < 0) return Status::InvalidArgument(who + ": CUDA device ordinal must be >= 0");
#ifndef NVGROUP_WITH_CUDA
    return Status::Unimplemented(who + ": device " + q.device.ToString() +
                                 " needs a CUDA build of nvgroup_tf (NVGROUP_WITH_CUDA=1)");
#endif
  } else if (q.device.kind != DeviceKind::kCpu) {
    return Status::InvalidArgument(who + ": unknown device kind");
  }
  const bool has_data = NumElements(q.shape) > 0;
  if (has_data && q.input == nullptr) return Status::InvalidArgument(who + ": input pointer is null");
  switch (q.type) {
    case CollectiveType::kAllreduce:
      if (!SupportsReduction(q.dtype))
        return Status::Unimplemented(who + ": allreduce does not support dtype " + DataTypeName(q.dtype) +
                                     " (float16, bfloat16, float32, float64, int32, int64 only)");
      if (static_cast<int>(q.op) > static_cast<int>(ReduceOp::kProduct))
        return Status::InvalidArgument(who + ": unknown reduce op " + std::to_string(static_cast<int>(q.op)));
      if (!std::isfinite(q.prescale_factor) || !std::isfinite(q.postscale_factor))
        return Status::InvalidArgument(who + ": scale factors must be finite");
      if (!IsFloatingPoint(q.dtype) && (q.prescale_factor != 1.0 || q.postscale_factor != 1.0))
        return Status::InvalidArgument(who + ": prescale/postscale factors other than 1 need a "
                                       "floating-point dtype, not " + DataTypeName(q.dtype));
      if (has_data && q.output == nullptr) return Status::InvalidArgument(who + ": output pointer is null");
      break;
    case CollectiveType::kAllgather:
      if (q.shape.empty())
        return Status::InvalidArgument(who + ": allgather needs a tensor of rank >= 1 (got a scalar)");
      if (!q.allocate_output) return Status::InvalidArgument(who + ": allgather needs allocate_output");
      break;
    case CollectiveType::kBroadcast:
      if (q.root_rank < 0 || q.root_rank >= size)
        return Status::InvalidArgument(who + ": root rank " + std::to_string(q.root_rank) +
                                       " is out of range [0, " + std::to_string(size) + ")");
      if (has_data && q.output == nullptr) return Status::InvalidArgument(who + ": output pointer is null");
      break;
  }
  return Status::Ok();
}

StatusOr<std::shared_ptr<Engine>> CurrentEngine() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_engine == nullptr)
    return Status::FailedPrecondition("nvgroup_tf has not been initialized; call hvd.init() first");
  return g_engine;
}

Status Submit(std::vector<CollectiveRequest> requests, bool grouped) {
  StatusOr<std::shared_ptr<Engine>> engine = CurrentEngine();
  if (!engine.ok()) return engine.status();
  if (requests.empty()) return Status::InvalidArgument("EnqueueGroup needs at least one request");
  const uint64_t group_id = grouped && requests.size() > 1 ? GroupId(requests) : 0;
  const double now = MonotonicSeconds();
  std::vector<TensorEntry> entries;
  for (CollectiveRequest& q : requests) {
    NVG_RETURN_IF_ERROR(ValidateRequest(q, engine.value()->size()));
    TensorEntry e;
    RequestMessage& m = e.message;
    m.name = q.name;
    m.type = q.type;
    m.dtype = q.dtype;
    m.device_kind = q.device.kind;
    m.op = q.op;
    m.prescale_factor = q.prescale_factor;
    m.postscale_factor = q.postscale_factor;
    m.root_rank = q.root_rank;
    m.shape = q.shape;
    m.group_id = group_id;
    m.group_size = group_id != 0 ? static_cast<uint32_t>(requests.size()) : 0;
    e.request = std::move(q);
    e.enqueue_time = now;
    entries.push_back(std::move(e));
  }
  return engine.value()->Submit(std::move(entries));
}

// Memory of Init's non-blocking exchanges; leaked when a wait gives up, since
// the abandoned operation may still write into it.
struct InitExchange {
  int64_t summary[3] = {0, 0, 0};
  std::vector<int64_t> all;
  std::string mine, texts;
  std::vector<int> lengths, displs;
};

// Parses the knobs on every rank and makes Init fail on every rank if any
// rank's environment is malformed or the ranks disagree on a knob that shapes
// the collectives (fusion threshold and cache size decide which collectives
// run). Gathers each rank's verdict so every rank can name the culprit.

Status AgreeOnKnobs(MPI_Comm comm, int size, StatusOr<Knobs>* knobs, double timeout_s) {
  std::atomic<bool> never{false};
  auto x = std::make_unique<InitExchange>();
  x->mine = knobs->ok() ? std::string() : knobs->status().message();
  x->summary[0] = static_cast<int64_t>(x->mine.size());
  x->summary[1] = knobs->ok() ? static_cast<int64_t>(knobs->value().fusion_threshold) : -1;
  x->summary[2] = knobs->ok() ? knobs->value().cache_capacity : -1;
  x->all.resize(3 * size);
  MPI_Request req;
  NVG_MPI_CHECK(MPI_Iallgather(x->summary, 3, MPI_INT64_T, x->all.data(), 3, MPI_INT64_T, comm, &req));
  Status waited = WaitMpi(&req, "Init's environment check", timeout_s, never);
  if (!waited.ok()) {
    (void)x.release();
    return waited;
  }
  x->lengths.resize(size);
  x->displs.resize(size);
  int total = 0;
  for (int r = 0; r < size; ++r) {
    x->lengths[r] = static_cast<int>(x->all[3 * r]);
    x->displs[r] = total;
    total += x->lengths[r];
  }
  x->texts.assign(std::max(total, 1), '\0');
  NVG_MPI_CHECK(MPI_Iallgatherv(x->mine.data(), static_cast<int>(x->mine.size()), MPI_CHAR, &x->texts[0],
                                x->lengths.data(), x->displs.data(), MPI_CHAR, comm, &req));
  waited = WaitMpi(&req, "Init's environment check", timeout_s, never);
  if (!waited.ok()) {
    (void)x.release();
    return waited;
  }
  if (!knobs->ok()) return knobs->status();
  const std::vector<int64_t>& all = x->all;
  for (int r = 0; r < size; ++r)
    if (x->lengths[r] > 0)
      return Status::InvalidArgument("nvgroup_tf initialization failed on rank " + std::to_string(r) +
                                     ": " + x->texts.substr(x->displs[r], x->lengths[r]));
  for (int r = 1; r < size; ++r) {
    if (all[3 * r + 1] != all[1])
      return Status::InvalidArgument("NVGROUP_FUSION_THRESHOLD differs across ranks: rank 0 has " +
                                     std::to_string(all[1]) + ", rank " + std::to_string(r) + " has " +
                                     std::to_string(all[3 * r + 1]) + "; it must be the same on every rank");
    if (all[3 * r + 2] != all[2])
      return Status::InvalidArgument("NVGROUP_CACHE_CAPACITY differs across ranks: rank 0 has " +
                                     std::to_string(all[2]) + ", rank " + std::to_string(r) + " has " +
                                     std::to_string(all[3 * r + 2]) + "; it must be the same on every rank");
  }
  return Status::Ok();
}

// Whether every rank asks for `wish` (creating a communicator is collective:
// all ranks or none). A rank that asks alone is told in the log.
StatusOr<bool> AllRanksAsk(MPI_Comm comm, int size, bool wish, double timeout_s) {
  std::atomic<bool> never{false};
  auto x = std::make_unique<InitExchange>();
  x->summary[0] = wish ? 1 : 0;
  x->all.resize(size);
  MPI_Request req;
  NVG_MPI_CHECK(MPI_Iallgather(x->summary, 1, MPI_INT64_T, x->all.data(), 1, MPI_INT64_T, comm, &req));
  Status waited = WaitMpi(&req, "Init's device check", timeout_s, never);
  if (!waited.ok()) {
    (void)x.release();
    return waited;
  }
  const int64_t askers = std::count(x->all.begin(), x->all.end(), int64_t{1});
  if (wish && askers < size)
    NVG_LOG(kWarning) << "only " << askers << " of " << size << " ranks see a GPU at init(): the GPU "
                      << "memory is taken at the first GPU collective instead";
  return askers == size;
}

// EngineOptions::cuda_at_init: the CUDA communicator on local_rank % device
// count, then one agreement so that a rank that could not create it (most
// often: its GPU memory is taken) fails Init on every rank, named, instead of
// leaving the others to time out in their first collective.
StatusOr<std::unique_ptr<Communicator>> CreateCudaAtInit(MPI_Comm comm, int size,
                                                         const CommunicatorOptions& copts,
                                                         double timeout_s) {
  StatusOr<std::unique_ptr<Communicator>> c = CreateCommunicator(MPI_Comm_c2f(comm), Device::Cuda(-1), copts);
  std::atomic<bool> never{false};
  auto x = std::make_unique<InitExchange>();
  x->summary[0] = c.ok() ? 0 : 1;
  x->all.resize(size);
  MPI_Request req;
  NVG_MPI_CHECK(MPI_Iallgather(x->summary, 1, MPI_INT64_T, x->all.data(), 1, MPI_INT64_T, comm, &req));
  Status waited = WaitMpi(&req, "Init's CUDA communicator check", timeout_s, never);
  if (!waited.ok()) {
    (void)x.release();
    return waited;
  }
  if (!c.ok()) return c.status().WithContext("creating the CUDA communicator (registered GPU memory, see README 'GPU memory')");
  for (int r = 0; r < size; ++r)
    if (x->all[r] != 0)
      return Status::Unavailable("rank " + std::to_string(r) + " could not create its CUDA communicator "
                                 "(its error names the cause, most often GPU memory; see README 'GPU memory')");
  return c;
}

}  // namespace

Status Init(const EngineOptions& options) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_engine != nullptr) return Status::Ok();
  int initialized = 0, finalized = 0;
  NVG_MPI_CHECK(MPI_Initialized(&initialized));
  NVG_MPI_CHECK(MPI_Finalized(&finalized));
  if (finalized) return Status::FailedPrecondition("MPI was already finalized; nvgroup_tf cannot start again");
  if (!initialized) {
    int provided = 0;
    NVG_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
    g_initialized_mpi = true;
  }
  int provided = 0;
  NVG_MPI_CHECK(MPI_Query_thread(&provided));
  if (provided < MPI_THREAD_MULTIPLE)
    NVG_LOG(kWarning) << "MPI provides thread level " << provided << ", not MPI_THREAD_MULTIPLE: "
                      << "do not call MPI from other threads while nvgroup_tf runs";

  StatusOr<Knobs> knobs = ParseKnobsFromEnvironment();
  const double timeout_s = std::max(kMinInitTimeoutS, knobs.ok() ? knobs.value().peer_timeout_s : 0.0);
  MPI_Comm user = options.mpi_comm_fortran == -1
                      ? MPI_COMM_WORLD
                      : MPI_Comm_f2c(static_cast<MPI_Fint>(options.mpi_comm_fortran));
  if (user == MPI_COMM_NULL)
    return Status::InvalidArgument("the MPI communicator handle " + std::to_string(options.mpi_comm_fortran) +
                                   " is MPI_COMM_NULL");
  // The new handle is written when the duplication completes: heap memory,
  // leaked if the wait gives up.
  auto dup = std::make_unique<MPI_Comm>(MPI_COMM_NULL);
  MPI_Request req;
  std::atomic<bool> never{false};
  NVG_MPI_CHECK(MPI_Comm_idup(user, dup.get(), &req));
  Status duplicated = WaitMpi(&req, "Init's communicator duplication", timeout_s, never);
  if (!duplicated.ok()) {
    (void)dup.release();
    return duplicated.WithContext("nvgroup_tf.init");
  }
  MPI_Comm comm = *dup;
  int rank = 0, size = 1;
  NVG_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  NVG_MPI_CHECK(MPI_Comm_size(comm, &size));
  SetLogRank(rank);
  Status agreed = AgreeOnKnobs(comm, size, &knobs, timeout_s);
  if (!agreed.ok()) {
    MPI_Comm_free(&comm);
    return agreed.WithContext("nvgroup_tf.init");
  }
  SetLogLevel(static_cast<LogLevel>(knobs.value().log_level));

  CommunicatorOptions copts;
  copts.group_size = knobs.value().group_size;
  copts.pipeline_chunk_bytes = knobs.value().pipeline_chunk;
  copts.timeout_seconds = knobs.value().peer_timeout_s;
  StatusOr<std::unique_ptr<Communicator>> cpu = CreateCommunicator(MPI_Comm_c2f(comm), Device::Cpu(), copts);
  if (!cpu.ok()) {
    MPI_Comm_free(&comm);
    return cpu.status().WithContext("nvgroup_tf.init: creating the CPU communicator");
  }
  std::unique_ptr<Communicator> cuda;
  StatusOr<bool> everyone_cuda = AllRanksAsk(comm, size, options.cuda_at_init, timeout_s);
  if (!everyone_cuda.ok()) {
    MPI_Comm_free(&comm);
    return everyone_cuda.status().WithContext("nvgroup_tf.init");
  }
  if (everyone_cuda.value()) {
    StatusOr<std::unique_ptr<Communicator>> c = CreateCudaAtInit(comm, size, copts, timeout_s);
    if (!c.ok()) {
      MPI_Comm_free(&comm);
      return c.status().WithContext("nvgroup_tf.init");
    }
    cuda = c.consume();
  }
  g_engine = std::make_shared<Engine>(knobs.value(), comm, rank, size, cpu.consume(), std::move(cuda));
  NVG_LOG(kInfo) << "initialized: " << size << " ranks, fusion threshold "
                 << knobs.value().fusion_threshold << " B, cache " << knobs.value().cache_capacity;
  return Status::Ok();
}

Status Shutdown() {
  std::shared_ptr<Engine> engine;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_engine != nullptr && g_engine->OnEngineThread())
      return Status::FailedPrecondition("nvgroup_tf.shutdown() was called from a collective's done "
                                        "callback; call it from another thread");
    engine.swap(g_engine);
  }
  if (engine == nullptr) return Status::Ok();
  return engine->Stop();
}

Status FinalizeMpi() {
  NVG_RETURN_IF_ERROR(Shutdown());
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_initialized_mpi) return Status::Ok();
  g_initialized_mpi = false;
  int finalized = 0;
  NVG_MPI_CHECK(MPI_Finalized(&finalized));
  if (!finalized) NVG_MPI_CHECK(MPI_Finalize());
  return Status::Ok();
}

bool IsInitialized() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_engine != nullptr;
}

#define NVG_TOPOLOGY_GETTER(Function, field)                            \
  StatusOr<int> Function() {                                            \
    StatusOr<std::shared_ptr<Engine>> engine = CurrentEngine();         \
    if (!engine.ok()) return engine.status();                           \
    return engine.value()->topology().field;                            \
  }
NVG_TOPOLOGY_GETTER(Rank, rank)
NVG_TOPOLOGY_GETTER(Size, size)
NVG_TOPOLOGY_GETTER(LocalRank, local_rank)
NVG_TOPOLOGY_GETTER(LocalSize, local_size)
NVG_TOPOLOGY_GETTER(CrossRank, node_index)
NVG_TOPOLOGY_GETTER(CrossSize, node_count)
#undef NVG_TOPOLOGY_GETTER

void AbortEngine(const Status& reason) {
  std::shared_ptr<Engine> engine;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    engine = g_engine;
  }
  if (engine != nullptr) engine->Abort(reason);
}

Status Enqueue(CollectiveRequest request) {
  std::vector<CollectiveRequest> one;
  one.push_back(std::move(request));
  return Submit(std::move(one), false);
}

Status EnqueueGroup(std::vector<CollectiveRequest> requests) { return Submit(std::move(requests), true); }

}  // namespace nvgroup
