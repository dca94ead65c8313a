// The liveness channel's wire records and TCP helpers (cc/transport/
// liveness.h), shared by the authenticated setup (liveness_setup.cc) and the
// monitor (liveness.cc). Frames are fixed-size records in host byte order
// (liveness.h says why that is enough).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "nvgroup/status.h"

namespace nvgroup {

// One frame of the channel (kMagic, a FrameType, then its fields).
struct LivenessFrame {
  uint32_t magic;
  uint32_t type;
  int32_t rank;
  uint32_t aux;
  uint64_t a;
  uint64_t b;
};

namespace liveness_wire {

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

inline Frame MakeFrame(FrameType type, int32_t rank, uint32_t aux = 0, uint64_t a = 0, uint64_t b = 0) {
  return Frame{kMagic, type, rank, aux, a, b};
}

// Monotonic seconds (the deadlines and heartbeat clocks).
double Now();

// --- TCP helpers (liveness_sockets.cc) ---------------------------------------

// Sends `n` bytes (SendFrame: one frame); false when the peer is gone or, not
// blocking, its buffer is full.
bool SendBytes(int fd, const void* data, size_t n, bool block);
bool SendFrame(int fd, const Frame& f, bool block);
// The job's secret from the kernel's random source; constant-time comparison.
Status DrawSecret(uint8_t* out, size_t n);
bool SameSecret(const uint8_t* a, const uint8_t* b);
// "a.b.c.d" or "a.b.c.d:port" of a network-byte-order IPv4 address.
std::string AddressText(uint32_t address, int port = -1);
void CloseFd(int* fd);
// Waits until `fd` has `events` (*ready) or the deadline passes (!*ready).
Status PollOne(int fd, short events, double deadline, bool* ready);
// Rank 0: a non-blocking listening socket on `address`, ephemeral port, appended to `fds`.
Status ListenOn(uint32_t address, int size, std::vector<int>* fds, uint16_t* port);
// Non-blocking connect with a deadline; returns the connected fd or -1.
int ConnectTo(uint32_t address, uint16_t port, double deadline);

}  // namespace liveness_wire
}  // namespace nvgroup
