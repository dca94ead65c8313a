// The process sets other than 0 (add_process_set, nvgroup/engine.h). Each
// member holds its own Engine over a sub-communicator split from the
// registry's control communicator; non-members keep the entry (its ranks)
// with a null engine, so their calls fail naming the set.
//
// The control communicator is a duplicate of the user's communicator made at
// Init, used only here (from the caller's thread, under the owner's
// registration lock), never by a background loop. Registration is collective
// over it: every rank first shares its arguments with NVGROUP_TIMEOUT-bounded
// waits, so a rank that never calls, or calls with other ranks, makes every
// rank fail naming each rank's list instead of hanging.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "common/env.h"
#include "engine/engine.h"
#include "nvgroup/engine.h"

namespace nvgroup {

class ProcessSetRegistry {
 public:
  struct Set {
    std::vector<int> ranks;          // ranks of set 0, ascending
    int my_rank = -1;                // this rank's position in `ranks`, -1 if not a member
    std::shared_ptr<Engine> engine;  // null when not a member
  };

  // Init: no sets, ids from 1, registration over `control` (owned from here on).
  void Reset(MPI_Comm control);
  // Collective over the control communicator: every rank of set 0 (this one
  // is `rank` of `size`) calls it with the same `ranks`. The new set's
  // engine runs with `knobs` (Init's agreed knobs); `timeout_s` bounds the
  // agreement.
  StatusOr<int32_t> Add(const std::vector<int>& ranks, int rank, int size, const Knobs& knobs,
                        double timeout_s);
  // Collective like Add; stops the set's engine on its members.
  Status Remove(int32_t id, int size, double timeout_s);
  // Set `id`'s engine for `requests` (their broadcast roots, ranks of set 0,
  // become ranks of the set). `rank`: this rank in set 0, for the error of a
  // non-member.
  StatusOr<std::shared_ptr<Engine>> EngineFor(int32_t id, int rank,
                                              std::vector<CollectiveRequest>* requests) const;
  StatusOr<std::vector<int>> Ranks(int32_t id) const;
  std::vector<int32_t> Ids() const;
  // The engines this rank runs (the sets it is a member of).
  std::vector<std::shared_ptr<Engine>> Engines() const;
  // Shutdown: takes every set out of the registry (their engines still run).
  std::map<int32_t, Set> TakeAll();
  // Shutdown, after the sets' engines stopped: frees the control communicator.
  Status CloseControl();

 private:
  // Every rank's list, gathered over control_; fails on every rank if the
  // lists differ, naming each rank's list.
  Status AgreeOnRanks(const std::vector<int>& mine, const char* what, double timeout_s, int size) const;

  mutable std::mutex mu_;  // guards sets_, freed_ids_ and next_id_
  std::map<int32_t, Set> sets_;
  // Ids of removed sets, first removed first: Add reuses them before taking
  // next_id_ (as Horovod's ProcessSetTable, horovod/common/process_set.cc).
  // Every rank adds and removes the same sets in the same order (both are
  // collective), so every rank hands out the same ids.
  std::deque<int32_t> freed_ids_;
  int32_t next_id_ = 1;
  MPI_Comm control_ = MPI_COMM_NULL;
};

}  // namespace nvgroup
