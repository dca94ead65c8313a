#include "transport/liveness.h"
#include "transport/liveness_address.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "common/checks.h"
#include "common/env.h"
#include "common/logging.h"

namespace nvgroup {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// --- Frames -----------------------------------------------------------------

constexpr uint32_t kMagic = 0x4e56474cu;  // "NVGL"

enum FrameType : uint32_t {
  kHello = 1,      // rank -> 0, once after connecting. rank: the sender.
  kHeartbeat = 2,  // both ways every period. a: sender's progress. From rank 0
                   // also rank: suspect (-1 none), aux: SuspectReason, b: silent ms.
  kDead = 3,       // 0 -> rank. rank: the rank whose socket closed without BYE.
  kBye = 4,        // both ways: clean shutdown, the EOF that follows is expected.
};

enum SuspectReason : uint32_t { kNoSuspect = 0, kNoHeartbeat = 1, kNoProgress = 2 };

}  // namespace

struct LivenessFrame {
  uint32_t magic;
  uint32_t type;
  int32_t rank;
  uint32_t aux;
  uint64_t a;
  uint64_t b;
};

namespace {

using Frame = LivenessFrame;
static_assert(sizeof(Frame) == 32, "Frame is a fixed 32-byte record");

// Host names travel in fixed fields; HOST_NAME_MAX on Linux is 64.
constexpr int kHostBytes = 256;
// Rank 0 publishes at most this many IPv4 addresses (interfaces) to try.
constexpr int kMaxAddresses = 16;

struct RootAddress {
  uint16_t port;  // 0: rank 0 could not listen
  uint16_t count;
  uint32_t addresses[kMaxAddresses];  // network byte order; loopback last
};

// Sends a whole frame without blocking forever: the kernel buffer of a live
// peer always has room for 32 bytes unless it stopped reading for a long time
// (then the heartbeat is dropped, which is harmless). MSG_NOSIGNAL: a closed
// peer gives EPIPE instead of killing the process with SIGPIPE.
bool SendFrame(int fd, const Frame& f, bool block) {
  const char* p = reinterpret_cast<const char*>(&f);
  size_t left = sizeof(f);
  while (left > 0) {
    ssize_t n = send(fd, p, left, MSG_NOSIGNAL | (block ? 0 : MSG_DONTWAIT));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    left -= static_cast<size_t>(n);
  }
  return true;
}

Frame MakeFrame(FrameType type, int32_t rank, uint32_t aux = 0, uint64_t a = 0, uint64_t b = 0) {
  return Frame{kMagic, type, rank, aux, a, b};
}

void CloseFd(int* fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

// Polls a non-blocking MPI request until it completes or `deadline` passes.
Status WaitRequest(MPI_Request* req, double deadline, const char* what) {
  for (;;) {
    int done = 0;
    NVG_MPI_CHECK(MPI_Test(req, &done, MPI_STATUS_IGNORE));
    if (done) return Status::Ok();
    if (Now() > deadline)
      return Status::Unavailable(std::string("timed out in ") + what + " while setting up dead-rank detection");
    usleep(200);
  }
}

// Waits until `fd` has `events` or the deadline passes. Returns false on timeout.
Status PollOne(int fd, short events, double deadline, bool* ready) {
  *ready = false;
  for (;;) {
    const double left = deadline - Now();
    if (left <= 0) return Status::Ok();
    pollfd p{fd, events, 0};
    int n = poll(&p, 1, static_cast<int>(std::ceil(left * 1000)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::Internal(std::string("poll failed: ") + std::strerror(errno));
    if (n == 0) continue;
    *ready = true;
    return Status::Ok();
  }
}

// Rank 0: a listening TCP socket on every interface, ephemeral port.
Status Listen(int size, int* fd, RootAddress* out) {
  int s;
  NVG_SYS_CHECK(s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  *fd = s;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  NVG_SYS_CHECK(bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)));
  NVG_SYS_CHECK(listen(s, std::max(size, 16)));
  socklen_t len = sizeof(addr);
  NVG_SYS_CHECK(getsockname(s, reinterpret_cast<sockaddr*>(&addr), &len));
  out->port = ntohs(addr.sin_port);
  out->count = 0;
  // Which addresses the other ranks try, best first: transport/liveness_address.h.
  std::vector<NetInterface> interfaces;
  ifaddrs* list = nullptr;
  NVG_SYS_CHECK(getifaddrs(&list));
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    interfaces.push_back({i->ifa_name != nullptr ? i->ifa_name : "",
                          reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr});
  }
  freeifaddrs(list);
  StatusOr<Knobs> knobs = ParseKnobsFromEnvironment();  // the settings table, cc/common/env.h
  if (!knobs.ok()) return knobs.status();
  LivenessAddressSettings settings = LivenessAddressSettingsFrom(knobs.value());
  char host[kHostBytes] = {};
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_INET;
  if (gethostname(host, sizeof(host) - 1) == 0 && getaddrinfo(host, nullptr, &hints, &found) == 0) {
    for (addrinfo* f = found; f != nullptr; f = f->ai_next)
      settings.hostname_addresses.push_back(reinterpret_cast<sockaddr_in*>(f->ai_addr)->sin_addr.s_addr);
    freeaddrinfo(found);
  }
  StatusOr<std::vector<uint32_t>> chosen = ChooseLivenessAddresses(interfaces, settings);
  if (!chosen.ok()) return chosen.status();
  for (uint32_t a : chosen.value())
    if (out->count < kMaxAddresses - 1) out->addresses[out->count++] = a;
  out->addresses[out->count++] = htonl(INADDR_LOOPBACK);
  return Status::Ok();
}

// Non-blocking connect with a deadline; returns the connected fd or -1.
int ConnectTo(uint32_t address, uint16_t port, double deadline) {
  int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (s < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = address;
  addr.sin_port = htons(port);
  int rc = connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  if (rc < 0 && errno != EINPROGRESS) {
    close(s);
    return -1;
  }
  if (rc < 0) {
    bool ready = false;
    int err = 0;
    socklen_t len = sizeof(err);
    if (!PollOne(s, POLLOUT, deadline, &ready).ok() || !ready ||
        getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
      close(s);
      return -1;
    }
  }
  // Back to blocking: frames are tiny and sends to a live peer never stall.
  fcntl(s, F_SETFL, fcntl(s, F_GETFL) & ~O_NONBLOCK);
  int one = 1;
  setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return s;
}

// Rank 0: reads the HELLO of an accepted connection; returns the sender's rank or -1.
int ReadHello(int fd, int size, double deadline) {
  Frame f;
  size_t got = 0;
  while (got < sizeof(f)) {
    bool ready = false;
    if (!PollOne(fd, POLLIN, deadline, &ready).ok() || !ready) return -1;
    ssize_t n = recv(fd, reinterpret_cast<char*>(&f) + got, sizeof(f) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return -1;
    got += static_cast<size_t>(n);
  }
  if (f.magic != kMagic || f.type != kHello || f.rank <= 0 || f.rank >= size) return -1;
  return f.rank;
}

// The sockets of a setup in progress; whatever is still held when Create
// returns (an error path) is closed.
struct SetupSockets {
  int listen_fd = -1;
  std::vector<int> by_rank;   // the sockets Create hands to the monitor
  std::vector<int> accepted;  // rank 0: accepted, HELLO not read yet
  ~SetupSockets() {
    CloseFd(&listen_fd);
    for (int& fd : by_rank) CloseFd(&fd);
    for (int& fd : accepted) CloseFd(&fd);
  }
};

}  // namespace

// Note [Liveness setup agreement]
// Every rank must end Create with the same verdict, or rank 0 would run a
// monitor that reports ranks "dead" that never connected. Two reductions
// order the setup: (1) MIN over "my connection is made" -- after it, every
// connection rank 0 will ever get is in its accept queue (or already
// accepted); (2) rank 0 broadcasts whether it accepted a HELLO from every rank.
StatusOr<std::unique_ptr<LivenessMonitor>> LivenessMonitor::Create(MPI_Comm comm, double timeout_s,
                                                                   LostCallback on_lost) {
  const double deadline = Now() + timeout_s;
  int rank = 0, size = 1;
  NVG_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  NVG_MPI_CHECK(MPI_Comm_size(comm, &size));

  // Who is who: host name and pid of every rank, for the error messages.
  struct Identity {
    int64_t pid;
    char host[kHostBytes];
  } me{};
  me.pid = getpid();
  if (gethostname(me.host, sizeof(me.host) - 1) != 0) std::snprintf(me.host, sizeof(me.host), "?");
  std::vector<Identity> all(size);
  MPI_Request req;
  NVG_MPI_CHECK(MPI_Iallgather(&me, sizeof(me), MPI_BYTE, all.data(), sizeof(me), MPI_BYTE, comm, &req));
  NVG_RETURN_IF_ERROR(WaitRequest(&req, deadline, "the identity exchange"));
  std::vector<std::string> hosts;
  std::vector<int64_t> pids;
  for (const Identity& id : all) {
    hosts.emplace_back(id.host, strnlen(id.host, kHostBytes));
    pids.push_back(id.pid);
  }

  SetupSockets sockets;
  sockets.by_rank.assign(size, -1);
  std::vector<int>& fds = sockets.by_rank;
  RootAddress root{};
  Status local;
  if (rank == 0 && size > 1) local = Listen(size, &sockets.listen_fd, &root);
  if (!local.ok()) root.port = 0;
  NVG_MPI_CHECK(MPI_Ibcast(&root, sizeof(root), MPI_BYTE, 0, comm, &req));
  NVG_RETURN_IF_ERROR(WaitRequest(&req, deadline, "the address broadcast"));

  int connected = 1;
  if (rank != 0 && size > 1) {
    connected = 0;
    std::vector<uint32_t> order(root.addresses, root.addresses + std::min<int>(root.count, kMaxAddresses));
    if (hosts[rank] == hosts[0]) {  // same host: loopback first
      auto lo = std::find(order.begin(), order.end(), htonl(INADDR_LOOPBACK));
      if (lo != order.end()) std::rotate(order.begin(), lo, lo + 1);
    }
    for (uint32_t a : order) {
      if (root.port == 0) break;
      // Each address gets an equal share of the time left, at most 5 s: an
      // address that drops SYNs must not eat the whole budget.
      const double left = deadline - Now();
      const double slot = std::min(5.0, left / static_cast<double>(order.size()));
      int fd = ConnectTo(a, root.port, Now() + slot);
      if (fd < 0) continue;
      if (SendFrame(fd, MakeFrame(kHello, rank), true)) {
        fds[0] = fd;
        connected = 1;
        break;
      }
      close(fd);
    }
  }

  // Agreement (1): every rank's connection is made (or failed). Rank 0 accepts
  // meanwhile so that a backlog smaller than the job cannot stall connects.
  int all_connected = 0;
  NVG_MPI_CHECK(MPI_Iallreduce(&connected, &all_connected, 1, MPI_INT, MPI_MIN, comm, &req));
  for (;;) {
    int done = 0;
    NVG_MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE));
    if (done) break;
    if (Now() > deadline)
      return Status::Unavailable("timed out while ranks connected to rank 0 for dead-rank detection");
    bool ready = false;
    if (sockets.listen_fd >= 0 && PollOne(sockets.listen_fd, POLLIN, Now() + 0.001, &ready).ok() && ready) {
      int fd = accept4(sockets.listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) sockets.accepted.push_back(fd);
    } else if (sockets.listen_fd < 0) {
      usleep(200);
    }
  }

  // Rank 0 collects one HELLO per rank. Every rank sent its HELLO before it
  // joined agreement (1), so the bytes are here already; the 1 s per
  // connection only bounds a stranger that connected and stays silent.
  int verdict = all_connected;
  std::string why;
  if (rank == 0 && size > 1 && all_connected) {
    int missing = size - 1;
    for (size_t next = 0; missing > 0;) {
      if (next == sockets.accepted.size()) {
        bool ready = false;
        if (!PollOne(sockets.listen_fd, POLLIN, deadline, &ready).ok() || !ready) break;
        int fd = accept4(sockets.listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) sockets.accepted.push_back(fd);
        continue;
      }
      int& fd = sockets.accepted[next++];
      const int r = ReadHello(fd, size, std::min(deadline, Now() + 1.0));
      if (r < 0 || fds[r] >= 0) continue;  // closed with the others at the end
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      std::swap(fds[r], fd);
      --missing;
    }
    for (int r = 1; r < size && missing > 0; ++r)
      if (fds[r] < 0) {
        verdict = 0;
        why = "rank 0 got no HELLO from rank " + std::to_string(r);
        break;
      }
  }
  // Agreement (2): rank 0's verdict.
  NVG_MPI_CHECK(MPI_Ibcast(&verdict, 1, MPI_INT, 0, comm, &req));
  NVG_RETURN_IF_ERROR(WaitRequest(&req, deadline, "the setup verdict"));
  if (!verdict) {
    if (root.port == 0)
      return Status::Unavailable("rank 0 could not listen for dead-rank detection" +
                                 (local.ok() ? std::string() : ": " + local.message()));
    return Status::Unavailable("could not connect every rank to rank 0 for dead-rank detection (" +
                               (why.empty() ? std::string("a rank could not connect") : why) + ")");
  }

  std::unique_ptr<LivenessMonitor> m(
      new LivenessMonitor(rank, size, std::move(hosts), std::move(pids), std::move(on_lost)));
  // The sockets are handed over before the thread starts.
  const double now = Now();
  for (int r = 0; r < size; ++r) {
    std::swap(m->peers_[r].fd, fds[r]);
    m->peers_[r].last_heard_s = now;
    m->peers_[r].progress_since_s = now;
  }
  NVG_SYS_CHECK(pipe2(m->wake_pipe_, O_CLOEXEC | O_NONBLOCK));
  m->thread_ = std::thread([p = m.get()] { p->Run(); });
  return m;
}

LivenessMonitor::LivenessMonitor(int rank, int size, std::vector<std::string> hosts,
                                 std::vector<int64_t> pids, LostCallback on_lost)
    : rank_(rank), size_(size), hosts_(std::move(hosts)), pids_(std::move(pids)),
      on_lost_(std::move(on_lost)), peers_(size) {}

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
  return "rank " + std::to_string(rank) + " (host " + hosts_[rank] + ", pid " + std::to_string(pids_[rank]) + ")";
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
  if (forwarded_suspect_ >= 0) forwarded_text_ = SuspectText(f.rank, f.aux, static_cast<double>(f.b) / 1000.0);
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
    } else if (stuck > quiet_s) {
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
