// LivenessMonitor::Create: the authenticated setup of the liveness channel
// (cc/transport/liveness.h): rank 0 listens, every other rank connects and
// proves the job's secret, and all ranks agree on the verdict.
#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "common/checks.h"
#include "common/logging.h"
#include "transport/liveness.h"
#include "transport/liveness_address.h"
#include "transport/liveness_wire.h"

namespace nvgroup {

using namespace liveness_wire;  // NOLINT: the channel's records and helpers

namespace {

// Testing hooks (liveness.h).
std::mutex g_testing_mu;
double g_connect_delay_s = 0;
std::vector<std::pair<std::string, int>> g_listening;

// Polls a non-blocking MPI request until it completes or `deadline` passes.
Status WaitRequest(MPI_Request* req, double deadline, const char* what) {
  for (;;) {
    int done = 0;
    NVG_MPI_CHECK(MPI_Test(req, &done, MPI_STATUS_IGNORE));
    if (done) return Status::Ok();
    if (Now() > deadline)
      return Status::Unavailable(std::string("timed out in ") + what +
                                 " while setting up dead-rank detection");
    usleep(200);
  }
}

// Rank 0: the job's secret, and a listening TCP socket on each address it
// publishes (never on every interface).
Status Listen(int size, const LivenessAddressSettings& address_settings, std::vector<int>* listen_fds,
              RootAddress* out) {
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
  LivenessAddressSettings settings = address_settings;
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
    ssize_t got = recv(u.fd, reinterpret_cast<char*>(&u.hello) + u.got, sizeof(u.hello) - u.got,
                       MSG_DONTWAIT);
    if (got < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (got <= 0) {
      s->Refuse(&u,
                got == 0 ? "closed before a complete HELLO" : "failed: " + std::string(std::strerror(errno)));
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
      int fd = accept4(s->listen_fds[i], reinterpret_cast<sockaddr*>(&peer), &len,
                       SOCK_CLOEXEC | SOCK_NONBLOCK);
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
StatusOr<std::unique_ptr<LivenessMonitor>> LivenessMonitor::Create(MPI_Comm comm,
                                                                   const LivenessSettings& settings,
                                                                   LostCallback on_lost) {
  const double deadline = Now() + settings.timeout_s;
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
  if (rank == 0 && size > 1) local = Listen(size, settings.addresses, &sockets.listen_fds, &root);
  if (!local.ok()) root.count = 0;
  struct TestingAddresses {  // LivenessListenAddressesForTesting while accepting
    explicit TestingAddresses(const RootAddress& root) {
      std::lock_guard<std::mutex> lock(g_testing_mu);
      g_listening.clear();
      for (int i = 0; i < root.count; ++i)
        g_listening.emplace_back(AddressText(root.addresses[i]), root.ports[i]);
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

  std::unique_ptr<LivenessMonitor> m(new LivenessMonitor(rank, size, std::move(hosts), std::move(pids),
                                                         std::move(on_lost)));
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

void SetLivenessConnectDelayForTesting(double seconds) {
  std::lock_guard<std::mutex> lock(g_testing_mu);
  g_connect_delay_s = seconds;
}

std::vector<std::pair<std::string, int>> LivenessListenAddressesForTesting() {
  std::lock_guard<std::mutex> lock(g_testing_mu);
  return g_listening;
}

}  // namespace nvgroup
