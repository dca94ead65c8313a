// The liveness channel's TCP helpers (declared in liveness_wire.h).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>

#include "common/checks.h"
#include "transport/liveness_wire.h"

namespace nvgroup {
namespace liveness_wire {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

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

std::string AddressText(uint32_t address, int port) {
  char text[INET_ADDRSTRLEN] = "?";
  in_addr a{};
  a.s_addr = address;
  inet_ntop(AF_INET, &a, text, sizeof(text));
  return port < 0 ? std::string(text) : std::string(text) + ":" + std::to_string(port);
}

void CloseFd(int* fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
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

}  // namespace liveness_wire
}  // namespace nvgroup
