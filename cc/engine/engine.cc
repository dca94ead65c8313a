// The engine's public API (nvgroup/engine.h): a thin front over the process's
// one Runtime (runtime.h), which holds set 0's engine, the agreed knobs and
// the process sets. Init is in init.cc, request validation in
// request_validation.cc, the process sets in process_set_registry.cc, and the
// running engine (the pipeline and its design constraints) in
// engine.h.
#include "nvgroup/engine.h"

#include <algorithm>

#include "engine/engine_control.h"
#include "engine/runtime.h"

namespace nvgroup {

Status Init(const EngineOptions& options) { return Runtime::Get().Init(options); }
Status Shutdown() { return Runtime::Get().Shutdown(); }
Status FinalizeMpi() { return Runtime::Get().FinalizeMpi(); }
bool IsInitialized() { return Runtime::Get().IsInitialized(); }

#define NVG_TOPOLOGY_GETTER(Function, field)                             \
  StatusOr<int> Function() {                                             \
    StatusOr<std::shared_ptr<Engine>> engine = Runtime::Get().Current(); \
    if (!engine.ok()) return engine.status();                            \
    return engine.value()->topology().field;                             \
  }
NVG_TOPOLOGY_GETTER(Rank, rank)
NVG_TOPOLOGY_GETTER(Size, size)
NVG_TOPOLOGY_GETTER(LocalRank, local_rank)
NVG_TOPOLOGY_GETTER(LocalSize, local_size)
NVG_TOPOLOGY_GETTER(CrossRank, node_index)
NVG_TOPOLOGY_GETTER(CrossSize, node_count)
#undef NVG_TOPOLOGY_GETTER

StatusOr<int> MpiThreadsSupported() {
  StatusOr<bool> multiple = Runtime::Get().ThreadMultiple();
  if (!multiple.ok()) return multiple.status();
  return multiple.value() ? 1 : 0;
}

StatusOr<int> IsHomogeneous() {
  StatusOr<bool> homogeneous = Runtime::Get().Homogeneous();
  if (!homogeneous.ok()) return homogeneous.status();
  return homogeneous.value() ? 1 : 0;
}

StatusOr<std::string> AgreedSettingValue(const std::string& name) {
  StatusOr<Knobs> knobs = Runtime::Get().AgreedKnobs();
  if (!knobs.ok()) return knobs.status();
  for (auto& [variable, value] : AgreedKnobs(knobs.value()))
    if (variable == name) return value;
  return Status::InvalidArgument(name + " is not a setting the ranks agree on at init (docs/SETTINGS.md)");
}

Status StartTimeline(const std::string& path, bool mark_cycles) {
  if (path.empty()) return Status::InvalidArgument("start_timeline: the file path is empty");
  StatusOr<std::shared_ptr<Engine>> engine = Runtime::Get().Current();
  if (!engine.ok()) return engine.status();
  return engine.value()->ControlTimeline(true, path, mark_cycles);
}

Status StopTimeline() {
  StatusOr<std::shared_ptr<Engine>> engine = Runtime::Get().Current();
  if (!engine.ok()) return engine.status();
  return engine.value()->ControlTimeline(false, "", false);
}

StatusOr<EngineStats> GetEngineStats() {
  StatusOr<std::shared_ptr<Engine>> engine = Runtime::Get().Current();
  if (!engine.ok()) return engine.status();
  return engine.value()->Stats();
}

void AbortEngine(const Status& reason) { Runtime::Get().Abort(reason); }
void PerturbStateDigestForTesting() { Runtime::Get().PerturbStateDigest(); }

StatusOr<int32_t> AddProcessSet(const std::vector<int>& ranks) { return Runtime::Get().AddProcessSet(ranks); }
Status RemoveProcessSet(int32_t process_set_id) { return Runtime::Get().RemoveProcessSet(process_set_id); }
StatusOr<std::vector<int>> ProcessSetRanks(int32_t process_set_id) {
  return Runtime::Get().ProcessSetRanks(process_set_id);
}
std::vector<int32_t> ProcessSetIds() { return Runtime::Get().ProcessSetIds(); }

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

Status Enqueue(CollectiveRequest request) {
  std::vector<CollectiveRequest> one;
  one.push_back(std::move(request));
  return Runtime::Get().Submit(std::move(one), false);
}

Status EnqueueGroup(std::vector<CollectiveRequest> requests) {
  return Runtime::Get().Submit(std::move(requests), true);
}

StatusOr<uint64_t> RegisterGroup(std::vector<CollectiveRequest> members) {
  return Runtime::Get().RegisterGroup(std::move(members));
}

Status EnqueueRegisteredGroup(uint64_t group, GroupLaunch launch) {
  return Runtime::Get().EnqueueRegisteredGroup(group, std::move(launch));
}

Status UnregisterGroup(uint64_t group) { return Runtime::Get().UnregisterGroup(group); }

bool RegisteredGroupUsable(uint64_t group) { return Runtime::Get().RegisteredGroupUsable(group); }

}  // namespace nvgroup
