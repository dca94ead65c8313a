// The process's one nvgroup runtime (runtime.h): set 0's engine and the
// process sets behind the public API, submission of validated requests to
// their engine, shutdown and abort. Init is in init.cc.
#include "engine/runtime.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <numeric>
#include <thread>

#include "common/checks.h"
#include "common/logging.h"
#include "common/thread_setup.h"
#include "engine/init_watchdog.h"
#include "engine/mpi_wait.h"
#include "engine/request_validation.h"

namespace nvgroup {
namespace {

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

}  // namespace

Status NotInitialized() {
  return Status::FailedPrecondition("nvgroup_tf has not been initialized; call hvd.init() first");
}

Runtime& Runtime::Get() {
  static Runtime runtime;
  return runtime;
}

std::shared_ptr<Engine> Runtime::Global() {
  std::lock_guard<std::mutex> lock(mu_);
  return engine_;
}

StatusOr<std::shared_ptr<Engine>> Runtime::Current() {
  std::lock_guard<std::mutex> lock(mu_);
  if (engine_ == nullptr) return NotInitialized();
  return engine_;
}

bool Runtime::IsInitialized() {
  std::lock_guard<std::mutex> lock(mu_);
  return engine_ != nullptr;
}

StatusOr<bool> Runtime::ThreadMultiple() {
  std::lock_guard<std::mutex> lock(mu_);
  if (engine_ == nullptr) return NotInitialized();
  return thread_multiple_;
}

StatusOr<bool> Runtime::Homogeneous() {
  std::lock_guard<std::mutex> lock(mu_);
  if (engine_ == nullptr) return NotInitialized();
  return homogeneous_;
}

StatusOr<Knobs> Runtime::AgreedKnobs() {
  std::lock_guard<std::mutex> lock(mu_);
  if (engine_ == nullptr) return NotInitialized();
  return knobs_;
}

StatusOr<std::shared_ptr<Engine>> Runtime::EngineFor(std::vector<CollectiveRequest>* requests) {
  const int32_t id = (*requests)[0].process_set_id;
  for (const CollectiveRequest& q : *requests)
    if (q.process_set_id != id)
      return Status::InvalidArgument("the members of a grouped collective name different process sets (" +
                                     std::to_string(id) + " and " + std::to_string(q.process_set_id) + ")");
  std::lock_guard<std::mutex> lock(mu_);
  if (engine_ == nullptr) return NotInitialized();
  if (id == 0) return engine_;
  return sets_.EngineFor(id, engine_->topology().rank, requests);
}

Status Runtime::BuildSubmission(std::vector<CollectiveRequest>* requests, bool grouped, bool registered,
                                int size, Submission* out) {
  const uint64_t group_id = grouped && requests->size() > 1 ? GroupId(*requests) : 0;
  Submission& submission = *out;
  submission.group_id = group_id;
  std::vector<TensorEntry>& entries = submission.entries;
  entries.reserve(requests->size());
  for (CollectiveRequest& q : *requests) {
    NVG_RETURN_IF_ERROR(registered ? ValidateRegisteredMember(q, size) : ValidateRequest(q, size));
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
    m.group_size = group_id != 0 ? static_cast<uint32_t>(requests->size()) : 0;
    if (q.type == CollectiveType::kAlltoall)
      m.splits = q.splits.empty() ? std::vector<int64_t>(size, q.shape[0] / size) : q.splits;
    e.request = std::move(q);  // enqueue_time: TensorQueue::Push
  }
  return Status::Ok();
}

Status Runtime::Submit(std::vector<CollectiveRequest> requests, bool grouped) {
  if (requests.empty()) return Status::InvalidArgument("EnqueueGroup needs at least one request");
  for (CollectiveRequest& q : requests)
    if (q.type == CollectiveType::kJoin && q.name.empty()) q.name = "nvgroup.join";
  StatusOr<std::shared_ptr<Engine>> engine = EngineFor(&requests);
  if (!engine.ok()) return engine.status();
  Submission submission;
  NVG_RETURN_IF_ERROR(BuildSubmission(&requests, grouped, false, engine.value()->size(), &submission));
  return engine.value()->Submit(std::move(submission));
}

StatusOr<uint64_t> Runtime::RegisterGroup(std::vector<CollectiveRequest> members) {
  if (members.empty()) return Status::InvalidArgument("RegisterGroup needs at least one member");
  for (const CollectiveRequest& q : members)
    if (q.type != CollectiveType::kAllreduce)
      return Status::InvalidArgument("RegisterGroup: member '" + q.name + "' is not an allreduce (" +
                                     CollectiveTypeName(q.type) + "); only allreduces can be registered");
  StatusOr<std::shared_ptr<Engine>> engine = EngineFor(&members);
  if (!engine.ok()) return engine.status();
  Submission model;
  NVG_RETURN_IF_ERROR(BuildSubmission(&members, true, true, engine.value()->size(), &model));
  for (TensorEntry& e : model.entries) {  // each launch brings these (Note [Registered groups])
    CollectiveRequest& q = e.request;
    q.input = nullptr;
    q.output = nullptr;
    q.ready_event = nullptr;
    q.done = nullptr;
    q.completion_event_ready = nullptr;
  }
  return registered_.Add(engine.value(), std::move(model));
}

Status Runtime::Shutdown() {
  std::lock_guard<std::mutex> registration(registration_mu_);
  std::shared_ptr<Engine> engine;
  std::map<int32_t, ProcessSetRegistry::Set> sets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (engine_ != nullptr && engine_->OnEngineThread())
      return Status::FailedPrecondition(
          "nvgroup_tf.shutdown() was called from a collective's done "
          "callback; call it from another thread");
    engine.swap(engine_);
    sets = sets_.TakeAll();
    if (engine != nullptr) stopping_.push_back(engine);
    for (auto& [id, set] : sets)
      if (set.engine != nullptr) stopping_.push_back(set.engine);
  }
  registered_.Clear();  // their engines stop below
  if (engine == nullptr) return Status::Ok();
  // Sets first (each agrees on its own shutdown among its members), then set 0.
  bool lost = false;
  for (auto& [id, set] : sets) {
    if (set.engine == nullptr) continue;
    (void)set.engine->Stop();
    lost = lost || set.engine->LostPeers();
  }
  sets.clear();
  engine->KeepLivenessAfterStop();  // Note [Finalize watch]
  Status stopped = engine->Stop();
  lost = lost || engine->LostPeers();
  std::unique_ptr<LivenessMonitor> liveness = engine->TakeLiveness();
  if (lost) liveness.reset();  // closes it
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_.clear();
    lost_peers_ = lost_peers_ || lost;
    exit_liveness_ = std::move(liveness);
  }
  NVG_RETURN_IF_ERROR(sets_.CloseControl());
  return stopped;
}

// Note [Finalize watch]
// MPI_Finalize synchronizes with every rank and has no timeout: a rank that
// stops (SIGSTOP) or hangs between shutdown() and its own MPI_Finalize holds
// every other rank in MPI_Finalize for good. A rank that is merely late (rank 0
// evaluating a model after shutdown()) must not be taken for one. So Shutdown
// keeps set 0's liveness monitor (cc/transport/liveness.h) running after the
// engine stopped, heartbeats only (the engine's progress no longer moves, so it
// no longer counts), and FinalizeMpi watches it while MPI_Finalize runs: a late
// rank's monitor thread still sends heartbeats; a stopped or hung process sends
// none. When some rank has been silent for NVGROUP_TIMEOUT on end, this rank
// logs which at error level and ends with _exit(kFinalizeWatchExitCode)
// (a thread inside MPI_Finalize cannot be brought back); mpirun then ends the
// job. The monitor says BYE once MPI_Finalize returned (or at the next Init),
// so the ranks that finalize later never see a death.
namespace {

constexpr int kFinalizeWatchExitCode = kInitWatchdogExitCode;

class FinalizeWatch {
 public:
  FinalizeWatch(const LivenessMonitor* monitor, double bound_s) : monitor_(monitor), bound_s_(bound_s) {
    if (monitor_ != nullptr) thread_ = std::thread([this] { Watch(); });
  }
  ~FinalizeWatch() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    changed_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Watch() {
    NameThisThread("nvg-finalize");
    std::unique_lock<std::mutex> lock(mu_);
    double silent_since = -1;
    while (!changed_.wait_for(lock, std::chrono::milliseconds(200), [this] { return done_; })) {
      const std::string silent = monitor_->DescribeSilentPeers();
      const double now = MonotonicSeconds();
      if (silent.empty()) {
        silent_since = -1;
        continue;
      }
      if (silent_since < 0) silent_since = now;
      if (now - silent_since < bound_s_) continue;
      NVG_LOG(kError) << "MPI_Finalize waited " << static_cast<int>(now - silent_since)
                      << " s (NVGROUP_TIMEOUT) for a rank that stopped after shutdown(): " << silent
                      << "; this rank exits without finalizing MPI";
      _exit(kFinalizeWatchExitCode);
    }
  }

  const LivenessMonitor* const monitor_;
  const double bound_s_;
  std::mutex mu_;
  std::condition_variable changed_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace

Status Runtime::FinalizeMpi() {
  NVG_RETURN_IF_ERROR(Shutdown());
  std::lock_guard<std::mutex> lock(mu_);
  // Says BYE when this function returns, after MPI_Finalize.
  std::unique_ptr<LivenessMonitor> liveness = std::move(exit_liveness_);
  if (!initialized_mpi_) return Status::Ok();
  initialized_mpi_ = false;
  if (lost_peers_) {
    // MPI_Finalize synchronizes with every rank and would wait forever for a
    // stopped one; the process exits without it (the launcher then reports
    // that this rank exited without finalizing, after the error it printed).
    NVG_LOG(kWarning) << "MPI_Finalize skipped: a peer was lost, and finalizing would wait for it";
    return Status::Ok();
  }
  int finalized = 0;
  NVG_MPI_CHECK(MPI_Finalized(&finalized));
  if (!finalized) {
    FinalizeWatch watch(liveness.get(), knobs_.peer_timeout_s);  // Note [Finalize watch]
    NVG_MPI_CHECK(MPI_Finalize());
  }
  return Status::Ok();
}

void Runtime::Abort(const Status& reason) {
  std::vector<std::shared_ptr<Engine>> engines;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (engine_ != nullptr) engines.push_back(engine_);
    for (std::shared_ptr<Engine>& e : sets_.Engines()) engines.push_back(std::move(e));
    for (const std::shared_ptr<Engine>& e : stopping_) engines.push_back(e);
  }
  for (auto& engine : engines) engine->Abort(reason);
}

void Runtime::PerturbStateDigest() {
  std::shared_ptr<Engine> engine = Global();
  if (engine != nullptr) engine->PerturbStateDigest();
}

// ---- Process sets (process_set_registry.h) -------------------------------------

StatusOr<int32_t> Runtime::AddProcessSet(const std::vector<int>& ranks) {
  std::lock_guard<std::mutex> registration(registration_mu_);
  std::shared_ptr<Engine> global = Global();
  if (global == nullptr) return NotInitialized();
  const double timeout_s = InitWaitSeconds(knobs_);
  // The split and the set's communicator setup block in MPI once the ranks
  // agreed: bounded as Init's phases are (Note [Init watchdog]).
  InitWatchdog watchdog("add_process_set", timeout_s + kInitWatchdogGraceS);
  watchdog.Enter("process_set",
                 "add_process_set: the rank-list agreement, MPI_Comm_split, the set's CPU communicator");
  return sets_.Add(ranks, global->topology().rank, global->size(), knobs_, timeout_s);
}

Status Runtime::RemoveProcessSet(int32_t process_set_id) {
  std::lock_guard<std::mutex> registration(registration_mu_);
  std::shared_ptr<Engine> global = Global();
  if (global == nullptr) return NotInitialized();
  if (process_set_id == 0)
    return Status::InvalidArgument("remove_process_set: the global process set (0) cannot be removed");
  const double timeout_s = InitWaitSeconds(knobs_);
  return sets_.Remove(process_set_id, global->size(), timeout_s);
}

StatusOr<std::vector<int>> Runtime::ProcessSetRanks(int32_t process_set_id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (engine_ == nullptr) return NotInitialized();
  if (process_set_id == 0) {
    std::vector<int> all(engine_->size());
    std::iota(all.begin(), all.end(), 0);
    return all;
  }
  return sets_.Ranks(process_set_id);
}

std::vector<int32_t> Runtime::ProcessSetIds() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int32_t> ids;
  if (engine_ == nullptr) return ids;
  ids.push_back(0);
  for (int32_t id : sets_.Ids()) ids.push_back(id);
  return ids;
}

}  // namespace nvgroup
