// The engine's public API (nvgroup/engine.h): Init, Shutdown, topology,
// Enqueue/EnqueueGroup. Validates requests on the caller's thread and hands
// them to the running Engine (background_loop.h, where the pipeline and its
// design constraints are described).
#include "nvgroup/engine.h"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>

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
  // The same on every rank that submits the same set of names, whatever their
  // order: the sum of a mixed FNV-1a 64 hash of each name (Fowler/Noll/Vo
  // offset basis and prime; the splitmix64 finalizer spreads each name's hash
  // over all bits so that the sum does not cancel). No copies, no sort.
  uint64_t sum = 0;
  for (const CollectiveRequest& r : requests) {
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : r.name) h = (h ^ c) * 1099511628211ull;
    h ^= h >> 30;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebull;
    h ^= h >> 31;
    sum += h;
  }
  return sum == 0 ? 1 : sum;  // 0 means "not grouped"
}

std::mutex g_mu;                  // guards the globals below
std::shared_ptr<Engine> g_engine;
bool g_initialized_mpi = false;   // Init called MPI_Init_thread
bool g_thread_multiple = false;   // set by Init: MPI_Query_thread == MPI_THREAD_MULTIPLE
bool g_homogeneous = false;       // set by Init: every node has the same local size

// "collective '<name>'", built only when an error message uses it (`who +
// "..."`): validation runs for every enqueue and must not allocate when the
// request is good.
struct CollectiveWho {
  const std::string& name;
};
std::string operator+(const CollectiveWho& who, const char* text) {
  return "collective '" + who.name + "'" + text;
}

// Process sets other than 0 (engine.h). Each member holds its own Engine over
// a sub-communicator split from g_control; non-members keep the entry (ranks)
// with a null engine so their calls fail naming the set.
struct ProcessSetEntry {
  std::vector<int> ranks;           // ranks of set 0, ascending
  int my_rank = -1;                 // this rank's position in `ranks`, -1 if not a member
  std::shared_ptr<Engine> engine;   // null when not a member
};
std::map<int32_t, ProcessSetEntry> g_sets;
int32_t g_next_set_id = 1;
// Duplicate of the user's communicator used only for registering process sets
// (from the caller's thread, under g_registration_mu), never by a background loop.
MPI_Comm g_control = MPI_COMM_NULL;
Knobs g_knobs;                    // agreed at Init; sub-engines use the same
std::mutex g_registration_mu;     // serializes AddProcessSet/RemoveProcessSet/Shutdown

std::string RanksText(const std::vector<int>& ranks) {
  std::string t = "[";
  for (size_t i = 0; i < ranks.size(); ++i) t += (i ? ", " : "") + std::to_string(ranks[i]);
  return t + "]";
}

Status ValidateScales(const CollectiveRequest& q, const CollectiveWho& who) {
  if (!std::isfinite(q.prescale_factor) || !std::isfinite(q.postscale_factor))
    return Status::InvalidArgument(who + ": scale factors must be finite");
  return Status::Ok();
}

// `size`: ranks of the request's process set.
Status ValidateRequest(const CollectiveRequest& q, int size) {
  const CollectiveWho who{q.name};
  if (q.name.empty()) return Status::InvalidArgument("a collective needs a non-empty name");
  if (static_cast<int>(q.dtype) >= kNumDataTypes)
    return Status::InvalidArgument(who + ": unknown dtype " + std::to_string(static_cast<int>(q.dtype)));
  if (static_cast<int>(q.type) >= kNumCollectiveTypes)
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
  if (has_data && q.input == nullptr && q.type != CollectiveType::kJoin)
    return Status::InvalidArgument(who + ": input pointer is null");
  if (q.type != CollectiveType::kAlltoall && !q.splits.empty())
    return Status::InvalidArgument(who + ": splits are only meaningful for alltoall");
  switch (q.type) {
    case CollectiveType::kAllreduce:
      if (!SupportsReduction(q.dtype))
        return Status::Unimplemented(who + ": allreduce does not support dtype " + DataTypeName(q.dtype) +
                                     " (every numeric type, not bool)");
      if (static_cast<int>(q.op) > static_cast<int>(ReduceOp::kProduct))
        return Status::InvalidArgument(who + ": unknown reduce op " + std::to_string(static_cast<int>(q.op)));
      NVG_RETURN_IF_ERROR(ValidateScales(q, who));
      if (has_data && q.output == nullptr) return Status::InvalidArgument(who + ": output pointer is null");
      break;
    case CollectiveType::kReducescatter:
      if (!SupportsReduction(q.dtype))
        return Status::Unimplemented(who + ": reducescatter does not support dtype " + DataTypeName(q.dtype) +
                                     " (every numeric type, not bool)");
      if (q.op != ReduceOp::kSum && q.op != ReduceOp::kAverage)
        return Status::InvalidArgument(who + ": reducescatter supports op Sum or Average, not " +
                                       (static_cast<int>(q.op) <= static_cast<int>(ReduceOp::kProduct)
                                            ? std::string(ReduceOpName(q.op))
                                            : std::to_string(static_cast<int>(q.op))));
      NVG_RETURN_IF_ERROR(ValidateScales(q, who));
      if (q.shape.empty())
        return Status::InvalidArgument(who + ": reducescatter needs a tensor of rank >= 1 (got a scalar)");
      if (!q.allocate_output) return Status::InvalidArgument(who + ": reducescatter needs allocate_output");
      break;
    case CollectiveType::kAllgather:
      if (q.shape.empty())
        return Status::InvalidArgument(who + ": allgather needs a tensor of rank >= 1 (got a scalar)");
      if (!q.allocate_output) return Status::InvalidArgument(who + ": allgather needs allocate_output");
      break;
    case CollectiveType::kAlltoall: {
      if (q.shape.empty())
        return Status::InvalidArgument(who + ": alltoall needs a tensor of rank >= 1 (got a scalar)");
      if (!q.allocate_output) return Status::InvalidArgument(who + ": alltoall needs allocate_output");
      if (q.splits.empty()) {
        if (q.shape[0] % size != 0)
          return Status::InvalidArgument(who + ": alltoall without splits needs the first dimension (" +
                                         std::to_string(q.shape[0]) + ") to be divisible by the number of ranks (" +
                                         std::to_string(size) + ")");
        break;
      }
      if (static_cast<int>(q.splits.size()) != size)
        return Status::InvalidArgument(who + ": alltoall splits has " + std::to_string(q.splits.size()) +
                                       " entries; it needs one per rank (" + std::to_string(size) + ")");
      int64_t total = 0;
      for (int64_t v : q.splits) {
        if (v < 0) return Status::InvalidArgument(who + ": alltoall splits must be >= 0, got " + ShapeToString(q.splits));
        total += v;
      }
      if (total != q.shape[0])
        return Status::InvalidArgument(who + ": alltoall splits " + ShapeToString(q.splits) + " sum to " +
                                       std::to_string(total) + ", not the first dimension " +
                                       std::to_string(q.shape[0]));
      break;
    }
    case CollectiveType::kBroadcast:
      if (q.root_rank < 0 || q.root_rank >= size)
        return Status::InvalidArgument(who + ": root rank " + std::to_string(q.root_rank) +
                                       " is out of range [0, " + std::to_string(size) + ")");
      if (has_data && q.output == nullptr) return Status::InvalidArgument(who + ": output pointer is null");
      break;
    case CollectiveType::kJoin:
      if (q.output == nullptr) return Status::InvalidArgument(who + ": join needs an int32 output");
      if (q.device.kind != DeviceKind::kCpu)
        return Status::InvalidArgument(who + ": join's output lives in host memory (device CPU)");
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

// The engine of the requests' process set; broadcast roots (ranks of set 0,
// as in Horovod) are translated into ranks of the set.
StatusOr<std::shared_ptr<Engine>> EngineFor(std::vector<CollectiveRequest>* requests) {
  const int32_t id = (*requests)[0].process_set_id;
  for (const CollectiveRequest& q : *requests)
    if (q.process_set_id != id)
      return Status::InvalidArgument("the members of a grouped collective name different process sets (" +
                                     std::to_string(id) + " and " + std::to_string(q.process_set_id) + ")");
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_engine == nullptr)
    return Status::FailedPrecondition("nvgroup_tf has not been initialized; call hvd.init() first");
  if (id == 0) return g_engine;
  auto it = g_sets.find(id);
  if (it == g_sets.end())
    return Status::InvalidArgument("process set " + std::to_string(id) +
                                   " does not exist or has not been registered (add_process_set)");
  const ProcessSetEntry& set = it->second;
  if (set.engine == nullptr)
    return Status::InvalidArgument("rank " + std::to_string(g_engine->topology().rank) +
                                   " is not a member of process set " + std::to_string(id) + " (ranks " +
                                   RanksText(set.ranks) + "); '" + (*requests)[0].name +
                                   "' can only run on its members");
  for (CollectiveRequest& q : *requests) {
    if (q.type != CollectiveType::kBroadcast) continue;
    auto pos = std::find(set.ranks.begin(), set.ranks.end(), q.root_rank);
    if (pos == set.ranks.end())
      return Status::InvalidArgument("collective '" + q.name + "': root rank " + std::to_string(q.root_rank) +
                                     " is not a member of process set " + std::to_string(id) + " (ranks " +
                                     RanksText(set.ranks) + ")");
    q.root_rank = static_cast<int>(pos - set.ranks.begin());
  }
  return set.engine;
}

Status Submit(std::vector<CollectiveRequest> requests, bool grouped) {
  if (requests.empty()) return Status::InvalidArgument("EnqueueGroup needs at least one request");
  for (CollectiveRequest& q : requests)
    if (q.type == CollectiveType::kJoin && q.name.empty()) q.name = "nvgroup.join";
  StatusOr<std::shared_ptr<Engine>> engine = EngineFor(&requests);
  if (!engine.ok()) return engine.status();
  const int size = engine.value()->size();
  const uint64_t group_id = grouped && requests.size() > 1 ? GroupId(requests) : 0;
  const double now = MonotonicSeconds();
  Submission submission;
  submission.group_id = group_id;
  std::vector<TensorEntry>& entries = submission.entries;
  entries.reserve(requests.size());
  for (CollectiveRequest& q : requests) {
    NVG_RETURN_IF_ERROR(ValidateRequest(q, size));
    if (q.type == CollectiveType::kJoin && group_id != 0)
      return Status::InvalidArgument("join cannot be part of a grouped collective");
    TensorEntry& e = entries.emplace_back();  // built in place: the request moves once
    e.group_index = static_cast<uint32_t>(entries.size() - 1);
    RequestMessage& m = e.message;  // name and shape stay in e.request (TensorEntry::Report)
    m.type = q.type;
    m.dtype = q.dtype;
    m.device_kind = q.device.kind;
    m.op = q.op;
    m.prescale_factor = q.prescale_factor;
    m.postscale_factor = q.postscale_factor;
    m.root_rank = q.root_rank;
    m.group_id = group_id;
    m.group_size = group_id != 0 ? static_cast<uint32_t>(requests.size()) : 0;
    if (q.type == CollectiveType::kAlltoall)
      m.splits = q.splits.empty() ? std::vector<int64_t>(size, q.shape[0] / size) : q.splits;
    e.request = std::move(q);
    e.enqueue_time = now;
  }
  return engine.value()->Submit(std::move(submission));
}

// Memory of Init's non-blocking exchanges; leaked when a wait gives up, since
// the abandoned operation may still write into it.
struct InitExchange {
  int64_t my_length = 0;
  std::vector<int64_t> all_lengths;
  std::string mine, texts;
  std::vector<int> lengths, displs;
};

// "NVGROUP_X differs across ranks: rank 0 has A, ranks [1, 3] have B; ..."
// (ranks grouped by value, in order of first appearance).
std::string KnobMismatch(const std::string& name, const std::vector<std::string>& by_rank) {
  std::vector<std::string> values;
  std::vector<std::vector<int>> ranks;
  for (size_t r = 0; r < by_rank.size(); ++r) {
    size_t i = 0;
    while (i < values.size() && values[i] != by_rank[r]) ++i;
    if (i == values.size()) {
      values.push_back(by_rank[r]);
      ranks.emplace_back();
    }
    ranks[i].push_back(static_cast<int>(r));
  }
  std::string msg = name + " differs across ranks: ";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) msg += ", ";
    if (ranks[i].size() == 1) {
      msg += "rank " + std::to_string(ranks[i][0]) + " has " + values[i];
    } else {
      msg += "ranks [";
      for (size_t j = 0; j < ranks[i].size(); ++j) msg += (j ? ", " : "") + std::to_string(ranks[i][j]);
      msg += "] have " + values[i];
    }
  }
  return msg + "; it must be the same on every rank";
}

// Parses the knobs on every rank and makes Init fail on every rank if any
// rank's environment is malformed or the ranks disagree on a knob of
// AgreedKnobs (cc/common/env.h). Every rank shares its verdict: its error
// ("E" + text) or its agreed knobs ("K" + "NAME=value\n" lines), so every
// rank names the culprit and every differing value.
Status AgreeOnKnobs(MPI_Comm comm, int size, StatusOr<Knobs>* knobs, double timeout_s) {
  std::atomic<bool> never{false};
  auto x = std::make_unique<InitExchange>();
  if (knobs->ok()) {
    x->mine = "K";
    for (const auto& [name, value] : AgreedKnobs(knobs->value())) x->mine += name + "=" + value + "\n";
  } else {
    x->mine = "E" + knobs->status().message();
  }
  x->my_length = static_cast<int64_t>(x->mine.size());
  x->all_lengths.resize(size);
  MPI_Request req;
  NVG_MPI_CHECK(MPI_Iallgather(&x->my_length, 1, MPI_INT64_T, x->all_lengths.data(), 1, MPI_INT64_T, comm, &req));
  Status waited = WaitMpi(&req, "Init's environment check", timeout_s, never);
  if (!waited.ok()) {
    (void)x.release();
    return waited;
  }
  x->lengths.resize(size);
  x->displs.resize(size);
  int total = 0;
  for (int r = 0; r < size; ++r) {
    x->lengths[r] = static_cast<int>(x->all_lengths[r]);
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
  std::vector<std::string> texts(size);
  for (int r = 0; r < size; ++r) {
    texts[r] = x->texts.substr(x->displs[r], x->lengths[r]);
    if (texts[r].empty() || texts[r][0] != 'K')
      return Status::InvalidArgument("nvgroup_tf initialization failed on rank " + std::to_string(r) +
                                     ": " + (texts[r].empty() ? std::string("(no reason given)") : texts[r].substr(1)));
  }
  // Same knob list (same build) on every rank: compare line by line.
  const auto mine = AgreedKnobs(knobs->value());
  std::vector<std::vector<std::string>> values(mine.size(), std::vector<std::string>(size));
  for (int r = 0; r < size; ++r) {
    size_t pos = 1;
    for (size_t i = 0; i < mine.size(); ++i) {
      const size_t eol = texts[r].find('\n', pos);
      const std::string line = texts[r].substr(pos, eol == std::string::npos ? std::string::npos : eol - pos);
      const std::string prefix = mine[i].first + "=";
      if (line.compare(0, prefix.size(), prefix) != 0)
        return Status::InvalidArgument("rank " + std::to_string(r) + " runs a build of nvgroup_tf that agrees on "
                                       "different knobs (expected " + mine[i].first + ", got '" + line + "')");
      values[i][r] = line.substr(prefix.size());
      pos = eol == std::string::npos ? texts[r].size() : eol + 1;
    }
  }
  std::string differs;
  for (size_t i = 0; i < mine.size(); ++i) {
    bool same = true;
    for (int r = 1; r < size; ++r) same = same && values[i][r] == values[i][0];
    if (!same) differs += (differs.empty() ? "" : "; and ") + KnobMismatch(mine[i].first, values[i]);
  }
  if (!differs.empty()) return Status::InvalidArgument(differs);
  return Status::Ok();
}

// Memory of the CUDA-at-init agreements (leaked when a wait gives up, as
// InitExchange).
struct FlagExchange {
  int64_t mine = 0;
  std::vector<int64_t> all;
};

// Whether every rank asks for `wish` (creating a communicator is collective:
// all ranks or none). A rank that asks alone is told in the log.
StatusOr<bool> AllRanksAsk(MPI_Comm comm, int size, bool wish, double timeout_s) {
  std::atomic<bool> never{false};
  auto x = std::make_unique<FlagExchange>();
  x->mine = wish ? 1 : 0;
  x->all.resize(size);
  MPI_Request req;
  NVG_MPI_CHECK(MPI_Iallgather(&x->mine, 1, MPI_INT64_T, x->all.data(), 1, MPI_INT64_T, comm, &req));
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
StatusOr<std::unique_ptr<Communicator>> CreateCudaAtInit(MPI_Comm comm, int size, const Knobs& knobs,
                                                         double timeout_s) {
  StatusOr<std::unique_ptr<Communicator>> c = CreateCommunicator(MPI_Comm_c2f(comm), Device::Cuda(-1), knobs);
  std::atomic<bool> never{false};
  auto x = std::make_unique<FlagExchange>();
  x->mine = c.ok() ? 0 : 1;
  x->all.resize(size);
  MPI_Request req;
  NVG_MPI_CHECK(MPI_Iallgather(&x->mine, 1, MPI_INT64_T, x->all.data(), 1, MPI_INT64_T, comm, &req));
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
  g_thread_multiple = provided >= MPI_THREAD_MULTIPLE;
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

  StatusOr<std::unique_ptr<Communicator>> cpu = CreateCommunicator(MPI_Comm_c2f(comm), Device::Cpu(), knobs.value());
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
    StatusOr<std::unique_ptr<Communicator>> c = CreateCudaAtInit(comm, size, knobs.value(), timeout_s);
    if (!c.ok()) {
      MPI_Comm_free(&comm);
      return c.status().WithContext("nvgroup_tf.init");
    }
    cuda = c.consume();
  }
  // Homogeneous: the largest and the smallest local size agree (one MAX
  // allreduce of {local_size, -local_size}), so every rank reports the same.
  int local_sizes[2] = {cpu.value()->topology().local_size, -cpu.value()->topology().local_size};
  NVG_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, local_sizes, 2, MPI_INT, MPI_MAX, comm, &req));
  Status agreed_sizes = WaitMpi(&req, "Init's local-size allreduce", timeout_s, never);
  if (!agreed_sizes.ok()) return agreed_sizes.WithContext("nvgroup_tf.init");  // comm may still be in use: kept
  g_homogeneous = local_sizes[0] == -local_sizes[1];
  // The process-set registration communicator: duplicated now, while every
  // rank is inside Init (a blocking dup here cannot hang: the idup above and
  // AgreeOnKnobs proved every rank is here).
  MPI_Comm control = MPI_COMM_NULL;
  NVG_MPI_CHECK(MPI_Comm_dup(comm, &control));
  g_control = control;
  g_knobs = knobs.value();
  g_sets.clear();
  g_next_set_id = 1;
  g_engine = std::make_shared<Engine>(knobs.value(), comm, rank, size, cpu.consume(), true, std::move(cuda));
  NVG_LOG(kInfo) << "initialized: " << size << " ranks, fusion threshold "
                 << knobs.value().fusion_threshold << " B, cache " << knobs.value().cache_capacity;
  return Status::Ok();
}

Status Shutdown() {
  std::lock_guard<std::mutex> registration(g_registration_mu);
  std::shared_ptr<Engine> engine;
  std::map<int32_t, ProcessSetEntry> sets;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_engine != nullptr && g_engine->OnEngineThread())
      return Status::FailedPrecondition("nvgroup_tf.shutdown() was called from a collective's done "
                                        "callback; call it from another thread");
    engine.swap(g_engine);
    sets.swap(g_sets);
  }
  if (engine == nullptr) return Status::Ok();
  // Sets first (each agrees on its own shutdown among its members), then set 0.
  for (auto& [id, set] : sets)
    if (set.engine != nullptr) (void)set.engine->Stop();
  sets.clear();
  Status stopped = engine->Stop();
  int finalized = 0;
  NVG_MPI_CHECK(MPI_Finalized(&finalized));
  if (g_control != MPI_COMM_NULL && !finalized) MPI_Comm_free(&g_control);
  g_control = MPI_COMM_NULL;
  return stopped;
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

StatusOr<int> MpiThreadsSupported() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_engine == nullptr)
    return Status::FailedPrecondition("nvgroup_tf has not been initialized; call hvd.init() first");
  return g_thread_multiple ? 1 : 0;
}

StatusOr<int> IsHomogeneous() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_engine == nullptr)
    return Status::FailedPrecondition("nvgroup_tf has not been initialized; call hvd.init() first");
  return g_homogeneous ? 1 : 0;
}

Status StartTimeline(const std::string& path, bool mark_cycles) {
  if (path.empty()) return Status::InvalidArgument("start_timeline: the file path is empty");
  StatusOr<std::shared_ptr<Engine>> engine = CurrentEngine();
  if (!engine.ok()) return engine.status();
  return engine.value()->ControlTimeline(true, path, mark_cycles);
}

Status StopTimeline() {
  StatusOr<std::shared_ptr<Engine>> engine = CurrentEngine();
  if (!engine.ok()) return engine.status();
  return engine.value()->ControlTimeline(false, "", false);
}

StatusOr<EngineStats> GetEngineStats() {
  StatusOr<std::shared_ptr<Engine>> engine = CurrentEngine();
  if (!engine.ok()) return engine.status();
  return engine.value()->Stats();
}

void AbortEngine(const Status& reason) {
  std::vector<std::shared_ptr<Engine>> engines;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_engine != nullptr) engines.push_back(g_engine);
    for (auto& [id, set] : g_sets)
      if (set.engine != nullptr) engines.push_back(set.engine);
  }
  for (auto& engine : engines) engine->Abort(reason);
}

// --- Process sets -------------------------------------------------------------

namespace {

// Every rank's list of ranks, gathered over g_control with NVGROUP_TIMEOUT-
// bounded waits (a rank that never calls makes the others fail, not hang).
// Fails on every rank if the lists differ, naming each rank's list.
Status AgreeOnRanks(const std::vector<int>& mine, const char* what, double timeout_s, int size) {
  struct Exchange {  // leaked if a wait gives up (MPI may still write it)
    int count = 0;
    std::vector<int> counts, displs, all;
  };
  auto x = std::make_unique<Exchange>();
  std::atomic<bool> never{false};
  x->count = static_cast<int>(mine.size());
  x->counts.assign(size, 0);
  MPI_Request req;
  NVG_MPI_CHECK(MPI_Iallgather(&x->count, 1, MPI_INT, x->counts.data(), 1, MPI_INT, g_control, &req));
  Status waited = WaitMpi(&req, (std::string(what) + ": exchanging rank lists").c_str(), timeout_s, never);
  if (!waited.ok()) {
    (void)x.release();
    return waited;
  }
  x->displs.assign(size, 0);
  int total = 0;
  for (int r = 0; r < size; ++r) {
    x->displs[r] = total;
    total += x->counts[r];
  }
  x->all.assign(std::max(total, 1), 0);
  NVG_MPI_CHECK(MPI_Iallgatherv(mine.data(), x->count, MPI_INT, x->all.data(), x->counts.data(),
                                x->displs.data(), MPI_INT, g_control, &req));
  waited = WaitMpi(&req, (std::string(what) + ": exchanging rank lists").c_str(), timeout_s, never);
  if (!waited.ok()) {
    (void)x.release();
    return waited;
  }
  auto list_of = [&](int r) {
    return std::vector<int>(x->all.begin() + x->displs[r], x->all.begin() + x->displs[r] + x->counts[r]);
  };
  for (int r = 1; r < size; ++r) {
    if (list_of(r) != list_of(0)) {
      std::string msg = std::string(what) + " must be called by every rank with the same ranks: ";
      for (int q = 0; q < size; ++q) msg += (q ? ", " : "") + ("rank " + std::to_string(q) + " passed " + RanksText(list_of(q)));
      return Status::InvalidArgument(msg);
    }
  }
  return Status::Ok();
}

}  // namespace

StatusOr<int32_t> AddProcessSet(const std::vector<int>& ranks) {
  std::lock_guard<std::mutex> registration(g_registration_mu);
  std::shared_ptr<Engine> global;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    global = g_engine;
  }
  if (global == nullptr)
    return Status::FailedPrecondition("nvgroup_tf has not been initialized; call hvd.init() first");
  const int size = global->size(), rank = global->topology().rank;
  const double timeout_s = std::max(kMinInitTimeoutS, g_knobs.peer_timeout_s);
  NVG_RETURN_IF_ERROR(AgreeOnRanks(ranks, "add_process_set", timeout_s, size));
  // Same lists everywhere, so every rank reaches the same verdict below.
  if (ranks.empty()) return Status::InvalidArgument("add_process_set: a process set needs at least one rank");
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= size)
      return Status::InvalidArgument("add_process_set: rank " + std::to_string(ranks[i]) + " of " +
                                     RanksText(ranks) + " is out of range [0, " + std::to_string(size) + ")");
    if (i > 0 && ranks[i] <= ranks[i - 1])
      return Status::InvalidArgument("add_process_set: ranks " + RanksText(ranks) +
                                     " must be sorted and unique");
  }
  if (static_cast<int>(ranks.size()) == size)
    return Status::InvalidArgument("add_process_set: ranks " + RanksText(ranks) +
                                   " are the global process set (id 0), which always exists");
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto& [id, set] : g_sets)
      if (set.ranks == ranks)
        return Status::InvalidArgument("add_process_set: a process set with ranks " + RanksText(ranks) +
                                       " is already registered (id " + std::to_string(id) + ")");
  }
  ProcessSetEntry entry;
  entry.ranks = ranks;
  auto pos = std::find(ranks.begin(), ranks.end(), rank);
  entry.my_rank = pos == ranks.end() ? -1 : static_cast<int>(pos - ranks.begin());
  // Every rank passed AgreeOnRanks, so this blocking split cannot hang.
  MPI_Comm sub = MPI_COMM_NULL;
  NVG_MPI_CHECK(MPI_Comm_split(g_control, entry.my_rank >= 0 ? 0 : MPI_UNDEFINED, rank, &sub));
  if (entry.my_rank >= 0) {
    // NV-groups form inside the set (NVGROUP_GROUP_SIZE, when set, must divide
    // the set's ranks per node, else this fails naming it).
    StatusOr<std::unique_ptr<Communicator>> cpu = CreateCommunicator(MPI_Comm_c2f(sub), Device::Cpu(), g_knobs);
    if (!cpu.ok()) {
      MPI_Comm_free(&sub);
      return cpu.status().WithContext("add_process_set " + RanksText(ranks) + ": creating the CPU communicator");
    }
    Knobs knobs = g_knobs;
    knobs.timeline_path.clear();  // rank 0 of set 0 writes the timeline
    entry.engine = std::make_shared<Engine>(knobs, sub, entry.my_rank, static_cast<int>(ranks.size()),
                                            cpu.consume(), /*watch_liveness=*/false);
  }
  std::lock_guard<std::mutex> lock(g_mu);
  const int32_t id = g_next_set_id++;
  g_sets[id] = std::move(entry);
  return id;
}

Status RemoveProcessSet(int32_t process_set_id) {
  std::lock_guard<std::mutex> registration(g_registration_mu);
  std::shared_ptr<Engine> global;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    global = g_engine;
  }
  if (global == nullptr)
    return Status::FailedPrecondition("nvgroup_tf has not been initialized; call hvd.init() first");
  if (process_set_id == 0) return Status::InvalidArgument("remove_process_set: the global process set (0) cannot be removed");
  const double timeout_s = std::max(kMinInitTimeoutS, g_knobs.peer_timeout_s);
  NVG_RETURN_IF_ERROR(AgreeOnRanks({process_set_id}, "remove_process_set", timeout_s, global->size()));
  ProcessSetEntry entry;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_sets.find(process_set_id);
    if (it == g_sets.end())
      return Status::InvalidArgument("remove_process_set: process set " + std::to_string(process_set_id) +
                                     " does not exist or has not been registered");
    if (it->second.engine != nullptr && it->second.engine->OnEngineThread())
      return Status::FailedPrecondition("remove_process_set was called from a collective's done callback");
    entry = std::move(it->second);
    g_sets.erase(it);
  }
  if (entry.engine != nullptr) return entry.engine->Stop();
  return Status::Ok();
}

StatusOr<std::vector<int>> ProcessSetRanks(int32_t process_set_id) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_engine == nullptr)
    return Status::FailedPrecondition("nvgroup_tf has not been initialized; call hvd.init() first");
  if (process_set_id == 0) {
    std::vector<int> all(g_engine->size());
    std::iota(all.begin(), all.end(), 0);
    return all;
  }
  auto it = g_sets.find(process_set_id);
  if (it == g_sets.end())
    return Status::InvalidArgument("process set " + std::to_string(process_set_id) +
                                   " does not exist or has not been registered");
  return it->second.ranks;
}

std::vector<int32_t> ProcessSetIds() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<int32_t> ids;
  if (g_engine == nullptr) return ids;
  ids.push_back(0);
  for (auto& [id, set] : g_sets) ids.push_back(id);
  return ids;
}

StatusOr<int> ProcessSetRank(int32_t process_set_id) {
  StatusOr<std::vector<int>> ranks = ProcessSetRanks(process_set_id);
  if (!ranks.ok()) return ranks.status();
  StatusOr<int> me = Rank();
  if (!me.ok()) return me.status();
  auto pos = std::find(ranks.value().begin(), ranks.value().end(), me.value());
  return pos == ranks.value().end() ? -1 : static_cast<int>(pos - ranks.value().begin());
}

StatusOr<int> ProcessSetSize(int32_t process_set_id) {
  StatusOr<std::vector<int>> ranks = ProcessSetRanks(process_set_id);
  if (!ranks.ok()) return ranks.status();
  return static_cast<int>(ranks.value().size());
}

void PerturbStateDigestForTesting() {
  std::shared_ptr<Engine> engine;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    engine = g_engine;
  }
  if (engine != nullptr) engine->PerturbStateDigest();
}

Status Enqueue(CollectiveRequest request) {
  std::vector<CollectiveRequest> one;
  one.push_back(std::move(request));
  return Submit(std::move(one), false);
}

Status EnqueueGroup(std::vector<CollectiveRequest> requests) { return Submit(std::move(requests), true); }

}  // namespace nvgroup
