#include "transport/liveness.h"
#include "transport/liveness_address.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "common/checks.h"
#include "common/env.h"
#include "common/logging.h"

namespace nvgroup {
namespace {

// Testing hooks (liveness.h).
std::mutex g_testing_mu;
double g_connect_delay_s = 0;
std::vector<std::pair<std::string, int>> g_listening;

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

// The job's secret (Note [Liveness connection authentication]).
constexpr int kSecretBytes = 32;
// Rank 0 holds at most this many connections that have not proved the secret
// yet; past it the oldest is closed, so a flood cannot exhaust descriptors.
constexpr size_t kMaxUnauthenticated = 256;

struct RootAddress {
  uint16_t count;                     // 0: rank 0 could not listen
  uint16_t ports[kMaxAddresses];      // ports[i] listens on addresses[i]
  uint32_t addresses[kMaxAddresses];  // network byte order; loopback last
  uint8_t secret[kSecretBytes];
};

// What a rank sends right after connecting: a HELLO frame, then the secret.
struct HelloRecord {
  Frame frame;
  uint8_t secret[kSecretBytes];
};
static_assert(sizeof(HelloRecord) == 64, "HelloRecord is a fixed 64-byte record");

// Sends `n` bytes without blocking forever: the kernel buffer of a live peer
// always has room for a frame unless it stopped reading for a long time (then
// the heartbeat is dropped, which is harmless). MSG_NOSIGNAL: a closed peer
// gives EPIPE instead of killing the process with SIGPIPE.
bool SendBytes(int fd, const void* data, size_t n, bool block) {
  const char* p = static_cast<const char*>(data);
  size_t left = n;
  while (left > 0) {
    ssize_t sent = send(fd, p, left, MSG_NOSIGNAL | (block ? 0 : MSG_DONTWAIT));
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) return false;
    p += sent;
    left -= static_cast<size_t>(sent);
  }
  return true;
}

bool SendFrame(int fd, const Frame& f, bool block) { return SendBytes(fd, &f, sizeof(f), block); }

// Fills `out` from the kernel's random source: getrandom(2), or /dev/urandom
// on kernels without it.
Status DrawSecret(uint8_t* out, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom(out + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && errno == ENOSYS) break;
    if (r < 0) return Status::Internal(std::string("getrandom failed: ") + std::strerror(errno));
    got += static_cast<size_t>(r);
  }
  if (got == n) return Status::Ok();
  const int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::Internal(std::string("cannot open /dev/urandom: ") + std::strerror(errno));
  while (got < n) {
    ssize_t r = read(fd, out + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      const std::string why = r == 0 ? std::string("end of file") : std::strerror(errno);
      close(fd);
      return Status::Internal("reading /dev/urandom failed: " + why);
    }
    got += static_cast<size_t>(r);
  }
  close(fd);
  return Status::Ok();
}

// Compares in a time that does not depend on where the secrets differ.
bool SameSecret(const uint8_t* a, const uint8_t* b) {
  uint8_t diff = 0;
  for (int i = 0; i < kSecretBytes; ++i) diff = static_cast<uint8_t>(diff | (a[i] ^ b[i]));
  return diff == 0;
}

std::string AddressText(uint32_t address, int port = -1) {
  char text[INET_ADDRSTRLEN] = "?";
  in_addr a{};
  a.s_addr = address;
  inet_ntop(AF_INET, &a, text, sizeof(text));
  return port < 0 ? std::string(text) : std::string(text) + ":" + std::to_string(port);
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

// Rank 0: a listening socket on `address`, ephemeral port (non-blocking, so
// that accept never waits).
Status ListenOn(uint32_t address, int size, std::vector<int>* fds, uint16_t* port) {
  int s;
  NVG_SYS_CHECK(s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  fds->push_back(s);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = address;
  addr.sin_port = 0;
  NVG_SYS_CHECK(bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)));
  NVG_SYS_CHECK(listen(s, std::max(size, 128)));
  socklen_t len = sizeof(addr);
  NVG_SYS_CHECK(getsockname(s, reinterpret_cast<sockaddr*>(&addr), &len));
  *port = ntohs(addr.sin_port);
  return Status::Ok();
}

// Rank 0: the job's secret, and a listening TCP socket on each address it
// publishes (never on every interface).
Status Listen(int size, std::vector<int>* listen_fds, RootAddress* out) {
  out->count = 0;
  NVG_RETURN_IF_ERROR(DrawSecret(out->secret, kSecretBytes));
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
  std::vector<uint32_t> publish;
  for (uint32_t a : chosen.value())
    if (publish.size() < kMaxAddresses - 1 && a != htonl(INADDR_LOOPBACK)) publish.push_back(a);
  publish.push_back(htonl(INADDR_LOOPBACK));
  for (uint32_t a : publish) {
    uint16_t port = 0;
    Status s = ListenOn(a, size, listen_fds, &port);
    if (!s.ok()) {
      if (!settings.address.empty() && a != htonl(INADDR_LOOPBACK))
        return Status::Unavailable("NVGROUP_LIVENESS_ADDR=" + settings.address +
                                   ": rank 0 cannot listen on it: " + s.message());
      NVG_LOG(kWarning) << "dead-rank detection: rank 0 does not listen on " << AddressText(a) << ": "
                        << s.message();
      continue;
    }
    out->addresses[out->count] = a;
    out->ports[out->count] = port;
    ++out->count;
  }
  if (out->count == 0) return Status::Unavailable("no address to listen on");
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

// A connection rank 0 accepted whose HELLO has not been checked yet.
struct Unauthenticated {
  int fd = -1;
  std::string from;  // "a.b.c.d:port"
  size_t got = 0;    // bytes of `hello` read so far
  HelloRecord hello{};
};

// The sockets of a setup in progress; whatever is still held when Create
// returns (an error path) is closed. Rank 0 logs the connections it refused
// once, when the setup ends.
struct SetupSockets {
  std::vector<int> listen_fds;           // rank 0
  std::vector<int> by_rank;              // the sockets Create hands to the monitor
  std::vector<Unauthenticated> pending;  // rank 0: accepted, HELLO not checked yet
  int refused = 0;
  std::string first_refusal;

  void Refuse(Unauthenticated* u, const std::string& why) {
    CloseFd(&u->fd);
    if (refused++ == 0) first_refusal = u->from + " " + why;
  }
  ~SetupSockets() {
    for (Unauthenticated& u : pending)
      if (u.fd >= 0) Refuse(&u, "sent no complete HELLO before the setup ended");
    if (refused > 0)
      NVG_LOG(kWarning) << "dead-rank detection: refused " << refused << " connection(s) to rank 0 that did "
                        << "not prove this job's secret (the first: " << first_refusal
                        << "); a process outside the job reached the port";
    for (int& fd : listen_fds) CloseFd(&fd);
    for (int& fd : by_rank) CloseFd(&fd);
  }
};

// Rank 0: checks a complete HELLO and places its connection, or refuses it.
void CheckHello(SetupSockets* s, Unauthenticated* u, const uint8_t* secret, int size) {
  const Frame& f = u->hello.frame;
  if (f.magic != kMagic || f.type != kHello) {
    s->Refuse(u, "sent something other than a HELLO");
  } else if (!SameSecret(u->hello.secret, secret)) {
    s->Refuse(u, "sent a HELLO without this job's secret");
  } else if (f.rank <= 0 || f.rank >= size) {
    s->Refuse(u, "sent a HELLO for rank " + std::to_string(f.rank) + " of a job of " + std::to_string(size));
  } else if (s->by_rank[f.rank] >= 0) {
    s->Refuse(u, "sent a second HELLO for rank " + std::to_string(f.rank));
  } else {
    fcntl(u->fd, F_SETFL, fcntl(u->fd, F_GETFL) & ~O_NONBLOCK);
    int one = 1;
    setsockopt(u->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    std::swap(s->by_rank[f.rank], u->fd);
  }
}

// Rank 0: one round of the accept loop (Note [Liveness connection
// authentication]). Waits up to `wait_s` for a connection or HELLO bytes,
// reads what every pending connection sent, places the ones that prove the
// secret and accepts what is queued. Never blocks on one connection.
Status AcceptRound(SetupSockets* s, const uint8_t* secret, int size, double wait_s) {
  std::vector<pollfd> p;
  for (int fd : s->listen_fds) p.push_back({fd, POLLIN, 0});
  for (const Unauthenticated& u : s->pending) p.push_back({u.fd, POLLIN, 0});
  const int n = poll(p.data(), p.size(), std::max(0, static_cast<int>(std::ceil(wait_s * 1000))));
  if (n < 0 && errno == EINTR) return Status::Ok();
  if (n < 0) return Status::Internal(std::string("poll failed: ") + std::strerror(errno));
  if (n == 0) return Status::Ok();
  const size_t listeners = s->listen_fds.size();
  for (size_t i = 0; i < s->pending.size(); ++i) {
    if (p[listeners + i].revents == 0) continue;
    Unauthenticated& u = s->pending[i];
    ssize_t got = recv(u.fd, reinterpret_cast<char*>(&u.hello) + u.got, sizeof(u.hello) - u.got, MSG_DONTWAIT);
    if (got < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (got <= 0) {
      s->Refuse(&u, got == 0 ? "closed before a complete HELLO" : "failed: " + std::string(std::strerror(errno)));
      continue;
    }
    u.got += static_cast<size_t>(got);
    // Only this many bytes are read: whatever a placed rank sends next stays
    // in its socket for the monitor.
    if (u.got == sizeof(u.hello)) CheckHello(s, &u, secret, size);
  }
  s->pending.erase(std::remove_if(s->pending.begin(), s->pending.end(),
                                  [](const Unauthenticated& u) { return u.fd < 0; }),
                   s->pending.end());
  for (size_t i = 0; i < listeners; ++i) {
    if (p[i].revents == 0) continue;
    for (;;) {  // everything queued
      sockaddr_in peer{};
      socklen_t len = sizeof(peer);
      int fd = accept4(s->listen_fds[i], reinterpret_cast<sockaddr*>(&peer), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0 && errno == EINTR) continue;
      if (fd < 0) break;  // EAGAIN: none left; anything else: next round
      if (s->pending.size() >= kMaxUnauthenticated) {
        s->Refuse(&s->pending.front(), "was dropped: too many connections without a HELLO");
        s->pending.erase(s->pending.begin());
      }
      Unauthenticated u;
      u.fd = fd;
      u.from = AddressText(peer.sin_addr.s_addr, ntohs(peer.sin_port));
      s->pending.push_back(std::move(u));
    }
  }
  return Status::Ok();
}

}  // namespace

// Note [Liveness setup agreement]
// Every rank must end Create with the same verdict, or rank 0 would run a
// monitor that reports ranks "dead" that never connected. Two reductions
// order the setup: (1) MIN over "my connection is made" -- after it, every
// connection rank 0 will ever get is in its accept queue (or already
// accepted); (2) rank 0 broadcasts whether it placed a HELLO from every rank.
//
// Note [Liveness connection authentication]
// Rank 0's port can be reached by any process that can reach its host, and the
// frame format is public. So a connection takes a rank's place only if its
// HELLO carries the job's secret: 32 bytes rank 0 draws from the kernel's
// random source and hands to the other ranks with its addresses over MPI (the
// job's own channel), compared in constant time. A connection that sends
// anything else, too little, or a second HELLO for a placed rank is closed and
// never holds a slot: rank 0 reads every pending connection as its bytes come,
// until every rank is placed or the setup deadline passes, so a rank's HELLO
// arriving after a stranger's is still placed. Refusals are logged once per
// setup. The listening sockets (only on the published addresses) are closed
// when Create returns; a frame on rank k's socket is rank k's whatever its
// rank field says, and only placed sockets get or give heartbeats.
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
  if (rank == 0 && size > 1) local = Listen(size, &sockets.listen_fds, &root);
  if (!local.ok()) root.count = 0;
  struct TestingAddresses {  // LivenessListenAddressesForTesting while accepting
    explicit TestingAddresses(const RootAddress& root) {
      std::lock_guard<std::mutex> lock(g_testing_mu);
      g_listening.clear();
      for (int i = 0; i < root.count; ++i) g_listening.emplace_back(AddressText(root.addresses[i]), root.ports[i]);
    }
    ~TestingAddresses() {
      std::lock_guard<std::mutex> lock(g_testing_mu);
      g_listening.clear();
    }
  } testing_addresses(root);
  NVG_MPI_CHECK(MPI_Ibcast(&root, sizeof(root), MPI_BYTE, 0, comm, &req));
  NVG_RETURN_IF_ERROR(WaitRequest(&req, deadline, "the address broadcast"));

  int connected = 1;
  if (rank != 0 && size > 1) {
    double delay = 0;
    {
      std::lock_guard<std::mutex> lock(g_testing_mu);
      delay = g_connect_delay_s;
    }
    if (delay > 0) std::this_thread::sleep_for(std::chrono::duration<double>(delay));
    connected = 0;
    std::vector<int> order;  // indices into root's addresses
    for (int i = 0; i < std::min<int>(root.count, kMaxAddresses); ++i) order.push_back(i);
    if (hosts[rank] == hosts[0]) {  // same host: loopback first
      auto lo = std::find_if(order.begin(), order.end(),
                             [&](int i) { return root.addresses[i] == htonl(INADDR_LOOPBACK); });
      if (lo != order.end()) std::rotate(order.begin(), lo, lo + 1);
    }
    HelloRecord hello{MakeFrame(kHello, rank), {}};
    std::memcpy(hello.secret, root.secret, kSecretBytes);
    for (int i : order) {
      // Each address gets an equal share of the time left, at most 5 s: an
      // address that drops SYNs must not eat the whole budget.
      const double left = deadline - Now();
      const double slot = std::min(5.0, left / static_cast<double>(order.size()));
      int fd = ConnectTo(root.addresses[i], root.ports[i], Now() + slot);
      if (fd < 0) continue;
      if (SendBytes(fd, &hello, sizeof(hello), true)) {
        fds[0] = fd;
        connected = 1;
        break;
      }
      close(fd);
    }
  }

  // Agreement (1): every rank's connection is made (or failed). Rank 0 accepts
  // and checks HELLOs meanwhile so that a backlog smaller than the job cannot
  // stall connects.
  int all_connected = 0;
  NVG_MPI_CHECK(MPI_Iallreduce(&connected, &all_connected, 1, MPI_INT, MPI_MIN, comm, &req));
  for (;;) {
    int done = 0;
    NVG_MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE));
    if (done) break;
    if (Now() > deadline)
      return Status::Unavailable("timed out while ranks connected to rank 0 for dead-rank detection");
    if (!sockets.listen_fds.empty()) {
      NVG_RETURN_IF_ERROR(AcceptRound(&sockets, root.secret, size, 0.001));
    } else {
      usleep(200);
    }
  }

  // Rank 0 places one connection per rank. Every rank sent its HELLO before
  // it joined agreement (1), so its bytes are here or on their way; strangers
  // cost nothing but a pending slot (Note [Liveness connection authentication]).
  int verdict = all_connected;
  std::string why;
  if (rank == 0 && size > 1 && all_connected) {
    auto placed = [&] { return std::count_if(fds.begin() + 1, fds.end(), [](int fd) { return fd >= 0; }); };
    while (placed() < size - 1 && Now() < deadline)
      NVG_RETURN_IF_ERROR(AcceptRound(&sockets, root.secret, size, std::min(0.05, deadline - Now())));
    for (int r = 1; r < size; ++r)
      if (fds[r] < 0) {
        verdict = 0;
        why = "rank 0 got no HELLO with this job's secret from rank " + std::to_string(r);
        break;
      }
  }
  std::memset(root.secret, 0, kSecretBytes);
  // Agreement (2): rank 0's verdict.
  NVG_MPI_CHECK(MPI_Ibcast(&verdict, 1, MPI_INT, 0, comm, &req));
  NVG_RETURN_IF_ERROR(WaitRequest(&req, deadline, "the setup verdict"));
  if (!verdict) {
    if (root.count == 0)
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

void SetLivenessConnectDelayForTesting(double seconds) {
  std::lock_guard<std::mutex> lock(g_testing_mu);
  g_connect_delay_s = seconds;
}

std::vector<std::pair<std::string, int>> LivenessListenAddressesForTesting() {
  std::lock_guard<std::mutex> lock(g_testing_mu);
  return g_listening;
}

}  // namespace nvgroup
