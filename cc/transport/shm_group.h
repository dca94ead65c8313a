// ShmGroup: the registered buffers of one group's members, shared through POSIX
// shared memory, and the barrier that orders access to them. The CPU analogue
// of the CUDA IPC buffers and the flag barrier of the NV-group kernel.
//
// How it works.
//  Setup (collective over the group communicator):
//   0. every member sweeps /dev/shm of this library's names left by dead
//      creators (SweepStaleShmSegments, below);
//   1. the group leader picks a job-unique stem "<pid>.<n>.<clock>" (its pid,
//      a per-process counter so several communicators never collide, and a
//      clock reading) and broadcasts it, and the members exchange their pids;
//      member m creates "/nvgroup.<pid of m>.<pid namespace of m>.<stem>.<m>"
//      (O_EXCL), reserves it with posix_fallocate (a full /dev/shm is an error
//      here, not a SIGBUS later) and maps it;
//   2. every member maps every other member's segment;
//   3. every member unlinks its own name. From then on nothing is left in
//      /dev/shm if a process dies: the memory goes away with the last mapping.
//  After each of steps 1 and 2 the members exchange their local status over MPI
//  (MPI_Allgather), so all of them fail together, naming the member that broke.
//
// Note [No segment left behind]
// A name lives from step 1 to step 3 of its creator: its peers must open it
// by name, so it cannot be unlinked before step 2's agreement says that every
// peer mapped it. A creator that ends in that window leaves it unless:
//   * it ends through the init watchdog or its SIGTERM handler
//     (engine/init_watchdog.h: mpirun ends the survivors of a death during
//     init() with SIGTERM): both unlink the names still pending
//     (UnlinkPendingShmSegments, async-signal-safe); or
//   * it is killed (SIGKILL): then the name carries its creator's pid and pid
//     namespace, and the next setup on the host (step 0 of any later job, or
//     of the same job's next communicator) unlinks every name whose creator
//     is gone from this pid namespace (kill(pid, 0) fails with ESRCH). A name
//     of another pid namespace, of a live process (also a pid reused since)
//     or of another format is left alone.
//  Segment layout: | Control (one 4 KiB page) | data: capacity bytes |. The data
//  part of a member's segment is its registered buffer.
//
// The barrier protocol. Control.arrived is a monotonically increasing 64-bit
// generation written only by its owner. Barrier k (k = 1, 2, ...):
//   - store-release arrived = k on our own control block, then
//   - for every other member, spin until load-acquire of its arrived >= k.
// Memory ordering: everything a member wrote or read before its release store
// happens-before everything any member does after its acquire load observes it,
// so a barrier orders both "data written -> peers read it" and "peers finished
// reading -> data overwritten". Since generations only grow, a fast member that
// already entered barrier k+1 still satisfies ">= k": no second flag set and no
// reset are needed (vLLM alternates two flag arrays because its flags are
// written into the peer's slot and re-armed; ours are not).
// Spins poll the communicator's abort flag and every peer's Control.failed,
// back off to sched_yield (ranks may outnumber cores), and give up after the
// timeout with kUnavailable naming the group members that did not arrive. A
// member that gives up sets its own failed flag so peers stop waiting at once;
// the group is broken from then on (every later barrier fails immediately).
// Cross-group MPI steps cannot be interrupted this way: a peer lost there is
// MPI's to report (Open MPI aborts the job).
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "nvgroup/status.h"

namespace nvgroup {

class ShmGroup {
 public:
  // `group_comm`: the group, ordered by group_rank. `global_ranks[m]`: rank of
  // member m in the communicator's MPI communicator (for error messages).
  // `abort_flag` must outlive the group.
  static StatusOr<std::unique_ptr<ShmGroup>> Create(MPI_Comm group_comm, const std::vector<int>& global_ranks,
                                                    size_t capacity, double timeout_seconds,
                                                    const std::atomic<bool>* abort_flag);
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  int size() const { return static_cast<int>(segments_.size()); }
  int member() const { return member_; }
  size_t capacity() const { return capacity_; }
  // Data part (registered buffer) of member m's segment, mapped in this process.
  char* buffer(int m) const { return segments_[m] + kControlBytes; }

  // Blocks until every member has called Barrier as often as this one (see the
  // protocol above). `what` names the sync point in error messages.
  Status Barrier(const char* what);

  // Tells the peers this member gave up (abort or error): their barriers fail
  // at once instead of timing out, and so do this member's later barriers.
  // Thread safe (one atomic store), so Communicator::Abort may call it.
  void MarkFailed();

 private:
  // One page, so the data part stays page aligned.
  static constexpr size_t kControlBytes = 4096;
  struct Control;

  ShmGroup() = default;
  Control* control(int m) const;
  std::string MemberName(int m) const;

  int member_ = 0;
  size_t capacity_ = 0;
  double timeout_seconds_ = 30.0;
  const std::atomic<bool>* abort_flag_ = nullptr;
  std::vector<int> global_ranks_;
  std::vector<char*> segments_;  // mapped segments, index = member
  uint64_t generation_ = 0;      // barriers this member has entered
};

// Unlinks the names this process created and has not unlinked yet (Note [No
// segment left behind]). Async-signal-safe.
void UnlinkPendingShmSegments();

// Unlinks /dev/shm's names of this library ("nvgroup.<pid>.<pid ns>.*") whose
// creator is gone from this pid namespace; returns how many. Called by
// ShmGroup::Create (step 0).
int SweepStaleShmSegments();

}  // namespace nvgroup
