// Init (nvgroup/engine.h), as Runtime::Init: MPI (initialized here when the
// program did not), the engine's own duplicate of the user's communicator, the
// agreement on the knobs (AgreeOnKnobs: every rank's environment parsed and
// compared, so a malformed or differing setting fails Init on every rank,
// named), the CPU communicator, the CUDA communicator when every rank asks for
// it at init (EngineOptions::cuda_at_init), the node-homogeneity check, the
// process-set control communicator and set 0's engine. It begins with the
// arrival check (init_arrival.h), which names the ranks that did not reach
// init(). Every non-blocking wait is bounded by InitWaitSeconds (runtime.h);
// the blocking MPI calls (MPI_Init_thread, the communicators' setup) by the
// init watchdog, phase by phase (Note [Init watchdog] in init_watchdog.h).
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>

#include "common/checks.h"
#include "common/env.h"
#include "common/logging.h"
#include "engine/engine_control.h"
#include "engine/init_arrival.h"
#include "engine/init_watchdog.h"
#include "engine/mpi_wait.h"
#include "engine/rank_lists.h"
#include "engine/runtime.h"

namespace nvgroup {
namespace {

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
  return name + " differs across ranks: " + ValuesByRankText(by_rank) + "; it must be the same on every rank";
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
  NVG_MPI_CHECK(MPI_Iallgather(&x->my_length, 1, MPI_INT64_T, x->all_lengths.data(), 1, MPI_INT64_T, comm,
                               &req));
  Status waited = NameSilentRanks(WaitMpi(&req, "Init's environment check", timeout_s, never), comm);
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
  waited = NameSilentRanks(WaitMpi(&req, "Init's environment check", timeout_s, never), comm);
  if (!waited.ok()) {
    (void)x.release();
    return waited;
  }
  if (!knobs->ok()) return knobs->status();
  std::vector<std::string> texts(size);
  for (int r = 0; r < size; ++r) {
    texts[r] = x->texts.substr(x->displs[r], x->lengths[r]);
    if (texts[r].empty() || texts[r][0] != 'K')
      return Status::InvalidArgument("nvgroup_tf initialization failed on rank " + std::to_string(r) + ": " +
                                     (texts[r].empty() ? std::string("(no reason given)")
                                                       : texts[r].substr(1)));
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
        return Status::InvalidArgument("rank " + std::to_string(r) +
                                       " runs a build of nvgroup_tf that agrees on "
                                       "different knobs (expected " +
                                       mine[i].first + ", got '" + line + "')");
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
  Status waited = NameSilentRanks(WaitMpi(&req, "Init's device check", timeout_s, never), comm);
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
  Status waited = NameSilentRanks(WaitMpi(&req, "Init's CUDA communicator check", timeout_s, never), comm);
  if (!waited.ok()) {
    (void)x.release();
    return waited;
  }
  if (!c.ok())
    return c.status()
        .WithContext("creating the CUDA communicator (registered GPU memory, see README 'GPU memory')");
  for (int r = 0; r < size; ++r)
    if (x->all[r] != 0)
      return Status::Unavailable(
          "rank " + std::to_string(r) +
          " could not create its CUDA communicator "
          "(its error names the cause, most often GPU memory; see README 'GPU memory')");
  return c;
}

// The knobs Init's bounds come from when the environment is malformed (Init
// then fails after the knob agreement, naming it): each timeout on its own.
Knobs TimeoutKnobs() {
  Knobs k;
  for (const char* name : {"NVGROUP_TIMEOUT", "NVGROUP_INIT_TIMEOUT"}) {
    Knobs one = k;
    if (ParseSettingFromEnvironment(name, &one).ok()) k = one;
  }
  return k;
}

}  // namespace

Status Runtime::Init(const EngineOptions& options) {
  std::lock_guard<std::mutex> lock(mu_);
  if (engine_ != nullptr) return Status::Ok();
  exit_liveness_.reset();  // the last shutdown's monitor says BYE (Note [Finalize watch], runtime.cc)
  StatusOr<Knobs> knobs = ParseKnobsFromEnvironment();
  const double timeout_s = InitWaitSeconds(knobs.ok() ? knobs.value() : TimeoutKnobs());
  InitWatchdog watchdog("nvgroup_tf.init", timeout_s + kInitWatchdogGraceS);
  int initialized = 0, finalized = 0;
  NVG_MPI_CHECK(MPI_Initialized(&initialized));
  NVG_MPI_CHECK(MPI_Finalized(&finalized));
  if (finalized)
    return Status::FailedPrecondition("MPI was already finalized; nvgroup_tf cannot start again");
  if (!initialized) {
    watchdog.Enter("mpi_init", "MPI_Init_thread");
    int provided = 0;
    NVG_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
    initialized_mpi_ = true;
  }
  int provided = 0;
  NVG_MPI_CHECK(MPI_Query_thread(&provided));
  thread_multiple_ = provided >= MPI_THREAD_MULTIPLE;
  if (provided < MPI_THREAD_MULTIPLE)
    NVG_LOG(kWarning) << "MPI provides thread level " << provided << ", not MPI_THREAD_MULTIPLE: "
                      << "do not call MPI from other threads while nvgroup_tf runs";

  MPI_Comm user = options.mpi_comm_fortran == -1
                      ? MPI_COMM_WORLD
                      : MPI_Comm_f2c(static_cast<MPI_Fint>(options.mpi_comm_fortran));
  if (user == MPI_COMM_NULL)
    return Status::InvalidArgument("the MPI communicator handle " + std::to_string(options.mpi_comm_fortran) +
                                   " is MPI_COMM_NULL");
  int rank = 0, size = 1;
  NVG_MPI_CHECK(MPI_Comm_rank(user, &rank));
  NVG_MPI_CHECK(MPI_Comm_size(user, &size));
  SetLogRank(rank);
  watchdog.Enter("arrival", "the arrival check: every rank reaches init()");
  std::string ranks_text;
  Status arrived = CheckArrival(user, rank, size, timeout_s, &ranks_text);
  watchdog.NoteRanks(ranks_text);
  if (!arrived.ok()) return arrived.WithContext("nvgroup_tf.init");
  // The new handle is written when the duplication completes: heap memory,
  // leaked if the wait gives up.
  watchdog.Enter("dup", "MPI_Comm_idup of the user's communicator");
  auto dup = std::make_unique<MPI_Comm>(MPI_COMM_NULL);
  MPI_Request req;
  std::atomic<bool> never{false};
  NVG_MPI_CHECK(MPI_Comm_idup(user, dup.get(), &req));
  // The probe runs on the user's communicator, which carries no other
  // point-to-point traffic during init() (Note [Arrival check]).
  Status duplicated = NameSilentRanks(WaitMpi(&req, "Init's communicator duplication", timeout_s, never),
                                      user);
  if (!duplicated.ok()) {
    (void)dup.release();
    return duplicated.WithContext("nvgroup_tf.init");
  }
  MPI_Comm comm = *dup;
  watchdog.Enter("knobs", "the knob agreement");
  Status agreed = AgreeOnKnobs(comm, size, &knobs, timeout_s);
  if (!agreed.ok()) {
    MPI_Comm_free(&comm);
    return agreed.WithContext("nvgroup_tf.init");
  }
  const Knobs& agreed_knobs = knobs.value();
  SetLogLevel(static_cast<LogLevel>(agreed_knobs.log_level));

  // Parsed and agreed above: the communicators do not read the environment.
  watchdog
      .Enter("cpu_communicator",
             "the CPU communicator's setup: MPI_Comm_split into nodes and groups, the shared-memory group");
  StatusOr<std::unique_ptr<Communicator>> cpu = CreateCommunicator(MPI_Comm_c2f(comm), Device::Cpu(),
                                                                   agreed_knobs);
  if (!cpu.ok()) {
    MPI_Comm_free(&comm);
    return cpu.status().WithContext("nvgroup_tf.init: creating the CPU communicator");
  }
  std::unique_ptr<Communicator> cuda;
  watchdog.Enter("device_check", "the agreement on CUDA at init");
  StatusOr<bool> everyone_cuda = AllRanksAsk(comm, size, options.cuda_at_init, timeout_s);
  if (!everyone_cuda.ok()) {
    MPI_Comm_free(&comm);
    return everyone_cuda.status().WithContext("nvgroup_tf.init");
  }
  if (everyone_cuda.value()) {
    watchdog.Enter("cuda_communicator", "the CUDA communicator's setup");
    StatusOr<std::unique_ptr<Communicator>> c = CreateCudaAtInit(comm, size, agreed_knobs, timeout_s);
    if (!c.ok()) {
      MPI_Comm_free(&comm);
      return c.status().WithContext("nvgroup_tf.init");
    }
    cuda = c.consume();
  }
  // Homogeneous: the largest and the smallest local size agree (one MAX
  // allreduce of {local_size, -local_size}), so every rank reports the same.
  watchdog.Enter("local_sizes", "the local-size allreduce");
  int local_sizes[2] = {cpu.value()->topology().local_size, -cpu.value()->topology().local_size};
  NVG_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, local_sizes, 2, MPI_INT, MPI_MAX, comm, &req));
  Status agreed_sizes = NameSilentRanks(WaitMpi(&req, "Init's local-size allreduce", timeout_s, never), comm);
  if (!agreed_sizes.ok())
    return agreed_sizes.WithContext("nvgroup_tf.init");  // comm may still be in use: kept
  homogeneous_ = local_sizes[0] == -local_sizes[1];
  // The process-set registration communicator: duplicated now, while every
  // rank is inside Init (the allreduce above proved every rank got here; a
  // rank lost since holds the others in this blocking dup until the watchdog
  // ends them).
  watchdog.Enter("control_dup", "MPI_Comm_dup of the process-set control communicator");
  MPI_Comm control = MPI_COMM_NULL;
  NVG_MPI_CHECK(MPI_Comm_dup(comm, &control));
  knobs_ = agreed_knobs;
  SetBucketDelayForTesting(knobs_.test_bucket_delay_us);
  sets_.Reset(control);
  watchdog.Enter("engine", "set 0's engine: the dead-rank detection's rendezvous");
  engine_ = std::make_shared<Engine>(knobs_, comm, rank, size, cpu.consume(), true, std::move(cuda));
  NVG_LOG(kInfo) << "initialized: " << size << " ranks, fusion threshold " << knobs_.fusion_threshold
                 << " B, cache " << knobs_.cache_capacity;
  return Status::Ok();
}

}  // namespace nvgroup
