// The process's one nvgroup runtime (Runtime::Get): set 0's engine, the knobs
// agreed at Init, what Init learned about MPI and the nodes, and the process
// sets (process_set_registry.h). The public API (nvgroup/engine.h,
// engine.cc) is a thin front over it; Runtime::Init is in init.cc.
//
// Locking: mu_ guards engine_ and the flags; a caller that needs set 0's
// engine and a process set in one consistent view takes mu_ and then the
// registry's own lock (never the other way round). registration_mu_
// serializes the collective calls that change the sets (AddProcessSet,
// RemoveProcessSet, Shutdown), which run their MPI outside mu_.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "common/env.h"
#include "engine/engine.h"
#include "engine/process_set_registry.h"
#include "engine/registered_groups.h"
#include "nvgroup/engine.h"

namespace nvgroup {

// How long Init's own waits (and process-set registration's) last: the larger
// of NVGROUP_INIT_TIMEOUT (default 120 s: ranks reach hvd.init() after
// importing TensorFlow, which takes tens of seconds on a loaded host, so the
// peer timeout, meant for a running job, would be too eager here) and
// NVGROUP_TIMEOUT. The init watchdog (init_watchdog.h) adds its grace to it.
inline double InitWaitSeconds(const Knobs& knobs) {
  return std::max(knobs.init_timeout_s, knobs.peer_timeout_s);
}

class Runtime {
 public:
  // The process's one runtime.
  static Runtime& Get();

  // nvgroup/engine.h's Init (init.cc): MPI, the engine's duplicate of the
  // user's communicator, the knob agreement, the communicators and set 0's
  // engine. OK at once when already initialized.
  Status Init(const EngineOptions& options);
  Status Shutdown();
  Status FinalizeMpi();
  bool IsInitialized();
  // Set 0's engine, or kFailedPrecondition before Init.
  StatusOr<std::shared_ptr<Engine>> Current();
  StatusOr<bool> ThreadMultiple();
  StatusOr<bool> Homogeneous();
  // The knobs agreed at Init (kFailedPrecondition before).
  StatusOr<Knobs> AgreedKnobs();
  // Validates `requests` (request_validation.h) and hands them to their
  // process set's engine as one submission; `grouped`: EnqueueGroup.
  Status Submit(std::vector<CollectiveRequest> requests, bool grouped);
  // Registered groups (registered_groups.h): RegisterGroup validates and
  // builds the members' entries as Submit does, once.
  StatusOr<uint64_t> RegisterGroup(std::vector<CollectiveRequest> members);
  Status EnqueueRegisteredGroup(uint64_t group, GroupLaunch launch) {
    return registered_.Launch(group, std::move(launch));
  }
  Status UnregisterGroup(uint64_t group) { return registered_.Remove(group); }
  bool RegisteredGroupUsable(uint64_t group) const { return registered_.Usable(group); }
  // Aborts every engine of the process (engine_control.h).
  void Abort(const Status& reason);
  void PerturbStateDigest();

  StatusOr<int32_t> AddProcessSet(const std::vector<int>& ranks);
  Status RemoveProcessSet(int32_t process_set_id);
  StatusOr<std::vector<int>> ProcessSetRanks(int32_t process_set_id);
  std::vector<int32_t> ProcessSetIds();

 private:
  Runtime() = default;
  // The engine of the requests' process set; broadcast roots (ranks of set 0,
  // as in Horovod) are translated into ranks of the set.
  StatusOr<std::shared_ptr<Engine>> EngineFor(std::vector<CollectiveRequest>* requests);
  // The one builder of a submission's entries (Submit's and RegisterGroup's):
  // validates each request (`registered`: without its pointers) and moves it
  // into its entry with this rank's message; `size`: the set's ranks.
  static Status BuildSubmission(std::vector<CollectiveRequest>* requests, bool grouped, bool registered,
                                int size, Submission* out);
  // Set 0's engine (null before Init), read under mu_.
  std::shared_ptr<Engine> Global();

  std::mutex mu_;
  std::shared_ptr<Engine> engine_;  // set 0's
  // Engines Shutdown() took out of engine_ / sets_ and is stopping: Abort()
  // reaches them too, so a peer lost during shutdown() ends its agreement at
  // once instead of after NVGROUP_TIMEOUT.
  std::vector<std::shared_ptr<Engine>> stopping_;
  // A stopped engine had lost peers (Engine::LostPeers): FinalizeMpi skips
  // MPI_Finalize, which would wait for them forever.
  bool lost_peers_ = false;
  // Set 0's liveness monitor after shutdown(), heartbeats only, until
  // FinalizeMpi has finalized MPI or Init starts again (Note [Finalize watch]).
  std::unique_ptr<LivenessMonitor> exit_liveness_;
  bool initialized_mpi_ = false;    // Init called MPI_Init_thread
  bool thread_multiple_ = false;    // MPI_Query_thread == MPI_THREAD_MULTIPLE
  bool homogeneous_ = false;        // every node has the same local size
  Knobs knobs_;                     // agreed at Init; process sets' engines use the same
  std::mutex registration_mu_;
  ProcessSetRegistry sets_;
  RegisteredGroups registered_;  // its own lock; Shutdown clears it
};

// "nvgroup_tf has not been initialized; call hvd.init() first".
Status NotInitialized();

}  // namespace nvgroup
