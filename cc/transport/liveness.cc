// LivenessMonitor's monitor thread and queries (cc/transport/liveness.h);
// the setup is in liveness_setup.cc.
#include "transport/liveness.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "common/logging.h"
#include "transport/liveness_wire.h"

namespace nvgroup {

using namespace liveness_wire;  // NOLINT: the channel's records and helpers

LivenessMonitor::LivenessMonitor(int rank, int size, std::vector<std::string> hosts,
                                 std::vector<int64_t> pids, LostCallback on_lost)
    : rank_(rank),
      size_(size),
      hosts_(std::move(hosts)),
      pids_(std::move(pids)),
      on_lost_(std::move(on_lost)),
      peers_(size) {}

LivenessMonitor::~LivenessMonitor() {
  Close();
  for (int& fd : wake_pipe_) CloseFd(&fd);
}

void LivenessMonitor::Close() {
  if (closed_) return;
  closed_ = true;
  closing_.store(true);
  if (wake_pipe_[1] >= 0) {
    char c = 1;
    ssize_t ignored = write(wake_pipe_[1], &c, 1);  // a full pipe is already a wake-up
    (void)ignored;
  }
  if (thread_.joinable()) thread_.join();
  for (Peer& p : peers_) CloseFd(&p.fd);
}

std::string LivenessMonitor::DescribeRank(int rank) const {
  if (rank < 0 || rank >= size_) return "rank " + std::to_string(rank);
  return "rank " + std::to_string(rank) + " (host " + hosts_[rank] + ", pid " + std::to_string(pids_[rank]) +
         ")";
}

void LivenessMonitor::Run() {
  double last_beat = 0;
  std::vector<pollfd> fds;
  std::vector<int> owner;
  while (!closing_.load()) {
    fds.clear();
    owner.clear();
    fds.push_back({wake_pipe_[0], POLLIN, 0});
    owner.push_back(-1);
    for (int r = 0; r < size_; ++r)
      if (peers_[r].fd >= 0) {
        fds.push_back({peers_[r].fd, POLLIN, 0});
        owner.push_back(r);
      }
    int n = poll(fds.data(), fds.size(), static_cast<int>(kHeartbeatPeriodS * 1000));
    if (n < 0 && errno != EINTR) {
      NVG_LOG(kError) << "dead-rank detection stopped: poll failed: " << std::strerror(errno);
      return;
    }
    if (closing_.load()) break;
    for (size_t i = 1; n > 0 && i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const int r = owner[i];
      if (Drain(r)) continue;
      // Closed. Expected after BYE; otherwise the process is gone.
      bool said_bye;
      {
        std::lock_guard<std::mutex> lock(mu_);
        CloseFd(&peers_[r].fd);
        said_bye = peers_[r].said_bye;
      }
      if (!said_bye && !closing_.load()) ReportLost(r);
    }
    const double now = Now();
    if (now - last_beat >= kHeartbeatPeriodS) {
      SendHeartbeats(now);
      last_beat = now;
    }
  }
  // Clean shutdown: BYE first, so the peer reads it before our EOF.
  for (Peer& p : peers_)
    if (p.fd >= 0) SendFrame(p.fd, MakeFrame(kBye, rank_), false);
}

bool LivenessMonitor::Drain(int r) {
  Peer& p = peers_[r];
  char buf[1024];
  for (;;) {
    ssize_t n = recv(p.fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n <= 0) return false;  // EOF, ECONNRESET, ...
    p.partial.insert(p.partial.end(), buf, buf + n);
    size_t used = 0;
    while (p.partial.size() - used >= sizeof(Frame)) {
      Frame f;
      std::memcpy(&f, p.partial.data() + used, sizeof(f));
      used += sizeof(f);
      if (f.magic != kMagic) {
        NVG_LOG(kError) << "dead-rank detection: malformed frame from " << DescribeRank(r)
                        << "; no longer watching it";
        std::lock_guard<std::mutex> lock(mu_);
        p.said_bye = true;  // not a death: do not abort the job over it
        return false;
      }
      if (f.type == kDead && rank_ != 0 && f.rank >= 0 && f.rank < size_) {
        ReportLost(f.rank);
        continue;
      }
      HandleFrame(r, f);
    }
    p.partial.erase(p.partial.begin(), p.partial.begin() + used);
  }
}

void LivenessMonitor::HandleFrame(int from, const Frame& f) {
  const double now = Now();
  std::lock_guard<std::mutex> lock(mu_);
  Peer& p = peers_[from];
  p.last_heard_s = now;
  if (f.type == kBye) {
    p.said_bye = true;
    return;
  }
  if (f.type != kHeartbeat) return;
  if (f.a != p.progress) {
    p.progress = f.a;
    p.progress_since_s = now;
  }
  if (rank_ == 0) return;
  // Rank 0's suspicion rides on its heartbeat.
  forwarded_text_.clear();
  forwarded_suspect_ = f.aux == kNoSuspect ? -1 : f.rank;
  if (forwarded_suspect_ >= 0)
    forwarded_text_ = SuspectText(f.rank, f.aux, static_cast<double>(f.b) / 1000.0);
}

std::string LivenessMonitor::SuspectText(int rank, uint32_t reason, double seconds) const {
  char how_long[32];
  std::snprintf(how_long, sizeof(how_long), "%.1f s", seconds);
  if (reason == kNoHeartbeat)
    return DescribeRank(rank) + " has sent no heartbeat for " + how_long + " (stopped, hung or unreachable)";
  return DescribeRank(rank) + " is alive but its engine has made no progress for " + how_long +
         " while other ranks moved on";
}

void LivenessMonitor::ReportLost(int rank) {
  if (rank_ == 0) {  // tell everybody else first: they may be waiting on `rank` too
    for (int r = 1; r < size_; ++r)
      if (r != rank && peers_[r].fd >= 0 && !peers_[r].said_bye)
        SendFrame(peers_[r].fd, MakeFrame(kDead, rank), false);
  }
  if (reported_) return;
  reported_ = true;
  if (!watch_progress_.load(std::memory_order_relaxed)) {
    // Every rank agreed to shut down: a rank that leaves now without BYE
    // exited without finalizing MPI (or died on its way out). Nothing of the
    // engine runs any more, so there is nothing to abort.
    NVG_LOG(kWarning) << DescribeRank(rank) << " left after shutdown() without finalizing MPI";
    return;
  }
  const std::string message = DescribeRank(rank) + " died or exited without shutdown(); aborting";
  NVG_LOG(kError) << message;
  if (on_lost_) on_lost_(Status::Unavailable(message));
}

std::string LivenessMonitor::SuspectLocked(double now, int* suspect, uint32_t* reason_out,
                                           uint64_t* silent_ms) const {
  // Rank 0 only. Worst first: the longest silence, then the longest stall.
  const double quiet_s = kMissedHeartbeats * kHeartbeatPeriodS;
  uint64_t max_progress = progress_.load(std::memory_order_relaxed);
  for (int r = 1; r < size_; ++r) max_progress = std::max(max_progress, peers_[r].progress);
  std::string text;
  double worst = 0;
  *suspect = -1;
  *reason_out = kNoSuspect;
  *silent_ms = 0;
  for (int r = 0; r < size_; ++r) {
    const Peer& p = peers_[r];
    if (r != 0 && (p.fd < 0 || p.said_bye)) continue;
    const double silent = r == 0 ? 0 : now - p.last_heard_s;
    const uint64_t progress = r == 0 ? progress_.load(std::memory_order_relaxed) : p.progress;
    const double stuck = progress < max_progress ? now - p.progress_since_s : 0;
    uint32_t reason = kNoSuspect;
    double how_long = 0;
    if (silent > quiet_s) {
      reason = kNoHeartbeat;
      how_long = silent;
    } else if (stuck > quiet_s && watch_progress_.load(std::memory_order_relaxed)) {
      reason = kNoProgress;
      how_long = stuck;
    }
    if (reason == kNoSuspect) continue;
    text += (text.empty() ? "" : "; ") + SuspectText(r, reason, how_long);
    if (how_long > worst) {
      worst = how_long;
      *suspect = r;
      *reason_out = reason;
      *silent_ms = static_cast<uint64_t>(how_long * 1000);
    }
  }
  return text;
}

void LivenessMonitor::SendHeartbeats(double now) {
  const uint64_t progress = progress_.load(std::memory_order_relaxed);
  if (rank_ != 0) {
    if (peers_[0].fd >= 0) SendFrame(peers_[0].fd, MakeFrame(kHeartbeat, rank_, 0, progress), false);
    return;
  }
  int suspect;
  uint32_t reason;
  uint64_t silent_ms;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Rank 0's own progress clock, for stalls of its own engine.
    if (progress != peers_[0].progress) {
      peers_[0].progress = progress;
      peers_[0].progress_since_s = now;
    }
    SuspectLocked(now, &suspect, &reason, &silent_ms);
  }
  const Frame f = MakeFrame(kHeartbeat, suspect, reason, progress, silent_ms);
  for (int r = 1; r < size_; ++r)
    if (peers_[r].fd >= 0 && !peers_[r].said_bye) SendFrame(peers_[r].fd, f, false);
}

std::string LivenessMonitor::DescribeSilentPeers() const {
  const double now = Now();
  std::lock_guard<std::mutex> lock(mu_);
  if (rank_ == 0) {
    int suspect;
    uint32_t reason;
    uint64_t silent_ms;
    return SuspectLocked(now, &suspect, &reason, &silent_ms);
  }
  const Peer& root = peers_[0];
  const double silent = now - root.last_heard_s;
  if (root.fd >= 0 && !root.said_bye && silent > kMissedHeartbeats * kHeartbeatPeriodS)
    return SuspectText(0, kNoHeartbeat, silent);
  return forwarded_suspect_ >= 0 ? forwarded_text_ : std::string();
}

}  // namespace nvgroup
