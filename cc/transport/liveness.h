// LivenessMonitor: dead-rank detection over a channel independent of MPI.
//
// Why. When one rank of an MPI job dies, the survivors that are inside (or
// enter) a collective with it never learn who died: MPI reports nothing, and
// under Open MPI's mpirun the survivors are killed about 1 s later
// (measured here: SIGKILL of rank 1 -> "process rank 1 ... exited on signal 9",
// survivors SIGTERMed, exit 137). The user sees a dead job and no reason.
//
// How it works.
//  * Setup (Create, collective over the engine's communicator): rank 0 draws
//    a random per-job secret, listens on a TCP socket (ephemeral port) on each
//    IPv4 address it publishes (transport/liveness_address.h, and loopback),
//    and broadcasts the addresses, ports and secret over MPI; every rank also
//    publishes its host name and pid. Each other rank connects to rank 0
//    (loopback when it runs on rank 0's host, else rank 0's addresses in turn)
//    and says HELLO with the secret. Rank 0 gives a rank's place only to a
//    connection that proves the secret; anything else is closed, however many
//    strangers come first (Note [Liveness connection authentication] in
//    liveness_setup.cc). One MPI reduction then tells every rank whether all
//    connections were made, so all ranks agree on whether the monitor runs.
//  * A death closes the dead process's sockets in the kernel. Rank 0 therefore
//    reads EOF (or ECONNRESET) on that rank's socket at once, sends DEAD(k) to
//    every other rank and reports the loss locally. If rank 0 dies, every rank
//    reads EOF on its one socket. No timeout is involved: detection takes one
//    poll() wake-up.
//  * A clean shutdown sends BYE before closing, so a rank that stops
//    on purpose is never mismatched with a dead one (Close()).
//  * Heartbeats (every kHeartbeatPeriodS, both directions) carry the engine's
//    progress counter (its cycle number, SetProgress). They do not declare
//    anybody dead -- a slow rank is not a dead one -- but when a collective
//    times out (NVGROUP_TIMEOUT) the engine asks DescribeSilentPeers() which
//    rank went quiet (no heartbeat: SIGSTOPped, swapping, host gone) or stopped
//    making progress while the others moved on (its engine is stuck), so the
//    error can name it. Rank 0 knows every rank's state and forwards its
//    suspicion to the others in its heartbeat.
//
// Threads. One monitor thread owns every socket after Create: it polls them
// with a short timeout (the heartbeat period) plus a wake-up pipe for Close().
// The loss callback runs on that thread, at most once per monitor.
//
// Frames are fixed-size records in host byte order: every rank of a job runs
// the same build on the same architecture (MPI itself assumes it for MPI_BYTE).
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "nvgroup/status.h"
#include "transport/liveness_address.h"

namespace nvgroup {

struct LivenessFrame;  // the wire record, defined in liveness_wire.h

// What Create takes from the settings, parsed once by its caller (the engine,
// from its knobs: cc/common/env.h) and never read again here.
struct LivenessSettings {
  double timeout_s = 30;  // the most Create waits for the connections (NVGROUP_TIMEOUT)
  // Where rank 0 listens (NVGROUP_LIVENESS_ADDR, NVGROUP_LIVENESS_IFACE and
  // MPI's interface lists: LivenessAddressSettingsFrom).
  LivenessAddressSettings addresses;
};

class LivenessMonitor {
 public:
  // Receives kUnavailable "rank k (host H, pid P) died or exited without
  // shutdown(); aborting". Called on the monitor thread, at most once; must
  // not block (the engine sets its abort flags and returns).
  using LostCallback = std::function<void(const Status&)>;

  // Collective over `comm` (every rank calls it; only this thread may use
  // `comm` meanwhile). Waits at most `settings.timeout_s` for the
  // connections. On failure every rank gets a non-OK Status (the same verdict
  // everywhere) and the caller may carry on without a monitor.
  static StatusOr<std::unique_ptr<LivenessMonitor>> Create(MPI_Comm comm, const LivenessSettings& settings,
                                                           LostCallback on_lost);
  ~LivenessMonitor();  // Close()
  LivenessMonitor(const LivenessMonitor&) = delete;
  LivenessMonitor& operator=(const LivenessMonitor&) = delete;

  // Clean shutdown: says BYE on every socket, then stops the thread. No loss
  // is reported after Close() starts. Idempotent.
  void Close();

  // The engine's progress counter (monotonic; the background loop's cycle).
  void SetProgress(uint64_t progress) { progress_.store(progress, std::memory_order_relaxed); }

  // "rank 2 (host H, pid P) has sent no heartbeat for 3.1 s" etc., for ranks
  // that look hung; "" when every rank looks alive and busy.
  std::string DescribeSilentPeers() const;
  // The engine stopped (shutdown() agreed on every rank): from now on only a
  // missing heartbeat makes a rank look hung, not a progress counter that no
  // longer moves (Note [Finalize watch], cc/engine/runtime.cc).
  void StopWatchingProgress() { watch_progress_.store(false, std::memory_order_relaxed); }

  // "rank k (host H, pid P)".
  std::string DescribeRank(int rank) const;

 private:
  // Period of heartbeats and of the monitor's poll() wake-ups. 200 ms keeps
  // the traffic negligible (size frames of 32 B per period at rank 0) while a
  // silent rank stands out after a few periods, far below NVGROUP_TIMEOUT's
  // default 30 s.
  static constexpr double kHeartbeatPeriodS = 0.2;
  // A rank is "silent" after this many missed heartbeats (1 s).
  static constexpr int kMissedHeartbeats = 5;

  struct Peer {
    int fd = -1;
    bool said_bye = false;
    double last_heard_s = 0;      // monotonic seconds of the last frame
    uint64_t progress = 0;        // last progress it reported
    double progress_since_s = 0;  // when `progress` last changed
    std::vector<uint8_t> partial; // bytes of an incomplete frame
  };

  LivenessMonitor(int rank, int size, std::vector<std::string> hosts, std::vector<int64_t> pids,
                  LostCallback on_lost);
  void Run();
  // Reads what `peer_rank`'s socket holds; returns false when it is closed.
  bool Drain(int peer_rank);
  void HandleFrame(int from, const LivenessFrame& frame);
  // Logs the loss and calls on_lost_ (first loss only); rank 0 forwards DEAD.
  void ReportLost(int rank);
  void SendHeartbeats(double now);
  // Rank 0, mu_ held: every rank that looks hung, worst first in the outputs.
  std::string SuspectLocked(double now, int* suspect, uint32_t* reason, uint64_t* silent_ms) const;
  std::string SuspectText(int rank, uint32_t reason, double seconds) const;

  const int rank_;
  const int size_;
  const std::vector<std::string> hosts_;  // by rank
  const std::vector<int64_t> pids_;       // by rank
  LostCallback on_lost_;

  // Rank 0: peers_[k] is rank k's socket (peers_[0] unused). Other ranks:
  // peers_[0] is the socket to rank 0, the rest unused except for the
  // progress/last-heard bookkeeping rank 0 forwards. Guarded by mu_ for the
  // bookkeeping; the fds are touched only by the monitor thread.
  mutable std::mutex mu_;
  std::vector<Peer> peers_;
  // Non-zero ranks: rank 0's latest suspicion (rank, detail text), and when it came.
  std::atomic<bool> watch_progress_{true};
  int forwarded_suspect_ = -1;
  std::string forwarded_text_;

  std::atomic<uint64_t> progress_{0};
  std::atomic<bool> closing_{false};
  bool reported_ = false;  // monitor thread only
  bool closed_ = false;    // Close() caller only
  int wake_pipe_[2] = {-1, -1};
  std::thread thread_;  // last: starts after everything it uses exists
};

// Testing only: in the next Create, ranks other than 0 wait `seconds` before
// connecting to rank 0 (a test's stranger process reaches rank 0's port first).
void SetLivenessConnectDelayForTesting(double seconds);

// Testing only: the (IPv4 address, port) pairs rank 0 listens on while a Create
// is accepting connections; empty otherwise. Safe from any thread.
std::vector<std::pair<std::string, int>> LivenessListenAddressesForTesting();

}  // namespace nvgroup
