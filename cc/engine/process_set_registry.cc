// The process sets other than 0 (process_set_registry.h).
#include "engine/process_set_registry.h"

#include <algorithm>
#include <atomic>
#include <string>

#include "common/checks.h"
#include "engine/mpi_wait.h"
#include "engine/rank_lists.h"

namespace nvgroup {
namespace {

// "process set <id> (ranks [..])": the set as errors name it.
std::string SetText(int32_t id, const std::vector<int>& ranks) {
  return "process set " + std::to_string(id) + " (ranks " + RanksText(ranks) + ")";
}

// "process set <id> does not exist or has not been registered".
std::string NoSuchSet(int32_t id) {
  return "process set " + std::to_string(id) + " does not exist or has not been registered";
}

}  // namespace

void ProcessSetRegistry::Reset(MPI_Comm control) {
  control_ = control;
  std::lock_guard<std::mutex> lock(mu_);
  sets_.clear();
  freed_ids_.clear();
  next_id_ = 1;
}

Status ProcessSetRegistry::AgreeOnRanks(const std::vector<int>& mine, const char* what, double timeout_s,
                                        int size) const {
  struct Exchange {  // leaked if a wait gives up (MPI may still write it)
    int count = 0;
    std::vector<int> counts, displs, all;
  };
  auto x = std::make_unique<Exchange>();
  std::atomic<bool> never{false};
  x->count = static_cast<int>(mine.size());
  x->counts.assign(size, 0);
  MPI_Request req;
  NVG_MPI_CHECK(MPI_Iallgather(&x->count, 1, MPI_INT, x->counts.data(), 1, MPI_INT, control_, &req));
  // control_ carries only these collectives, so the probe may use it.
  Status waited = NameSilentRanks(WaitMpi(&req, (std::string(what) + ": exchanging rank lists").c_str(),
                                          timeout_s, never),
                                  control_);
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
                                x->displs.data(), MPI_INT, control_, &req));
  waited = NameSilentRanks(WaitMpi(&req, (std::string(what) + ": exchanging rank lists").c_str(), timeout_s,
                                   never),
                           control_);
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
      for (int q = 0; q < size; ++q)
        msg += (q ? ", " : "") + ("rank " + std::to_string(q) + " passed " + RanksText(list_of(q)));
      return Status::InvalidArgument(msg);
    }
  }
  return Status::Ok();
}

StatusOr<int32_t> ProcessSetRegistry::Add(const std::vector<int>& ranks, int rank, int size,
                                          const Knobs& knobs, double timeout_s) {
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
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, set] : sets_)
      if (set.ranks == ranks)
        return Status::InvalidArgument("add_process_set: a process set with ranks " + RanksText(ranks) +
                                       " is already registered (id " + std::to_string(id) + ")");
  }
  Set entry;
  entry.ranks = ranks;
  auto pos = std::find(ranks.begin(), ranks.end(), rank);
  entry.my_rank = pos == ranks.end() ? -1 : static_cast<int>(pos - ranks.begin());
  // Every rank passed AgreeOnRanks, so this blocking split cannot hang.
  MPI_Comm sub = MPI_COMM_NULL;
  NVG_MPI_CHECK(MPI_Comm_split(control_, entry.my_rank >= 0 ? 0 : MPI_UNDEFINED, rank, &sub));
  if (entry.my_rank >= 0) {
    // NV-groups form inside the set (NVGROUP_GROUP_SIZE, when set, must divide
    // the set's ranks per node, else this fails naming it).
    StatusOr<std::unique_ptr<Communicator>> cpu = CreateCommunicator(MPI_Comm_c2f(sub), Device::Cpu(),
                                                                     knobs);  // agreed at Init
    if (!cpu.ok()) {
      MPI_Comm_free(&sub);
      return cpu.status().WithContext("add_process_set " + RanksText(ranks) +
                                      ": creating the CPU communicator");
    }
    Knobs set_knobs = knobs;
    set_knobs.timeline_path.clear();  // rank 0 of set 0 writes the timeline
    entry.engine = std::make_shared<Engine>(set_knobs, sub, entry.my_rank, static_cast<int>(ranks.size()),
                                            cpu.consume(), /*watch_liveness=*/false);
  }
  std::lock_guard<std::mutex> lock(mu_);
  int32_t id = next_id_;
  if (freed_ids_.empty()) {
    ++next_id_;
  } else {
    id = freed_ids_.front();
    freed_ids_.pop_front();
  }
  sets_[id] = std::move(entry);
  return id;
}

Status ProcessSetRegistry::Remove(int32_t id, int size, double timeout_s) {
  NVG_RETURN_IF_ERROR(AgreeOnRanks({id}, "remove_process_set", timeout_s, size));
  Set entry;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sets_.find(id);
    if (it == sets_.end()) return Status::InvalidArgument("remove_process_set: " + NoSuchSet(id));
    if (it->second.engine != nullptr && it->second.engine->OnEngineThread())
      return Status::FailedPrecondition("remove_process_set was called from a collective's done callback");
    entry = std::move(it->second);
    sets_.erase(it);
    freed_ids_.push_back(id);
  }
  if (entry.engine != nullptr) return entry.engine->Stop();
  return Status::Ok();
}

StatusOr<std::shared_ptr<Engine>> ProcessSetRegistry::EngineFor(int32_t id, int rank,
                                                                std::vector<CollectiveRequest>* requests)
    const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sets_.find(id);
  if (it == sets_.end()) return Status::InvalidArgument(NoSuchSet(id) + " (add_process_set)");
  const Set& set = it->second;
  if (set.engine == nullptr)
    return Status::InvalidArgument("rank " + std::to_string(rank) + " is not a member of " +
                                   SetText(id, set.ranks) + "; '" + (*requests)[0].name +
                                   "' can only run on its members");
  for (CollectiveRequest& q : *requests) {
    if (q.type != CollectiveType::kBroadcast) continue;
    auto pos = std::find(set.ranks.begin(), set.ranks.end(), q.root_rank);
    if (pos == set.ranks.end())
      return Status::InvalidArgument("collective '" + q.name + "': root rank " + std::to_string(q.root_rank) +
                                     " is not a member of " + SetText(id, set.ranks));
    q.root_rank = static_cast<int>(pos - set.ranks.begin());
  }
  return set.engine;
}

StatusOr<std::vector<int>> ProcessSetRegistry::Ranks(int32_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sets_.find(id);
  if (it == sets_.end()) return Status::InvalidArgument(NoSuchSet(id));
  return it->second.ranks;
}

std::vector<int32_t> ProcessSetRegistry::Ids() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int32_t> ids;
  for (auto& [id, set] : sets_) ids.push_back(id);
  return ids;
}

std::vector<std::shared_ptr<Engine>> ProcessSetRegistry::Engines() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Engine>> engines;
  for (auto& [id, set] : sets_)
    if (set.engine != nullptr) engines.push_back(set.engine);
  return engines;
}

std::map<int32_t, ProcessSetRegistry::Set> ProcessSetRegistry::TakeAll() {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<int32_t, Set> sets;
  sets.swap(sets_);
  return sets;
}

Status ProcessSetRegistry::CloseControl() {
  int finalized = 0;
  NVG_MPI_CHECK(MPI_Finalized(&finalized));
  if (control_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&control_);
  control_ = MPI_COMM_NULL;
  return Status::Ok();
}

}  // namespace nvgroup
