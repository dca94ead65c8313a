#include "transport/shm_group.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>

#include "common/checks.h"
#include "common/logging.h"

namespace nvgroup {

struct ShmGroup::Control {
  // Own cache lines (64 B, x86/ARM line size) so a spinning reader of one flag
  // does not bounce the line the owner writes the other flag on.
  alignas(64) std::atomic<uint64_t> arrived;  // last barrier generation entered
  alignas(64) std::atomic<uint32_t> failed;   // nonzero once the owner gave up
};
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "process-shared atomics must be lock free (address free)");

namespace {

// Spins before backing off to sched_yield: about a microsecond of polling, the
// cost of one cache-line transfer between cores many times over; beyond that
// the peer is probably descheduled (ranks may outnumber cores) and yielding
// lets it run.
// Measured against a longer spin (a pause loop of W us before the first yield;
// 2-core VM, 2 ranks, one busy-looping process beside them, 2026-12-07): the
// bare communicator's 2 MiB allreduce (benchmarks/cpu_communicator_bench.py,
// nvgroup path) took 2.4-3.2 ms with this spin and 0.9-1.3 ms with W = 200 us,
// as fast as MPI_Allreduce, but the engine's step
// (benchmarks/cpu_engine_step_bench.py, grouped) went from 1.3-1.7 ms to
// 1.9-2.3 ms with W = 200 us and to 12 ms with W = 1 s (not traced; a
// spinning engine thread presumably keeps a core its peer needs). Quiet, the
// engine's step was the same or slower with W = 200 us.
constexpr int kSpinsBeforeYield = 256;

std::atomic<uint64_t> g_segment_counter{0};

// The names created and not unlinked yet (Note [No segment left behind]): a
// slot is free (0), being written (1) or holds a name (2). A process sets up
// one group at a time per communicator; 16 slots are more than it holds.
constexpr int kPendingSlots = 16;
constexpr size_t kNameBytes = 256;
struct PendingName {
  std::atomic<int> state{0};
  char name[kNameBytes];
};
PendingName g_pending[kPendingSlots];

// Returns the slot, or -1 when every slot is taken (the name is then only
// covered by the sweep).
int AddPending(const std::string& name) {
  if (name.size() >= kNameBytes) return -1;
  for (int i = 0; i < kPendingSlots; ++i) {
    int expected = 0;
    if (g_pending[i].state.compare_exchange_strong(expected, 1)) {
      std::memcpy(g_pending[i].name, name.c_str(), name.size() + 1);
      g_pending[i].state.store(2, std::memory_order_release);
      return i;
    }
  }
  return -1;
}

// Unlinks the name, then frees its slot (in this order: a signal handler that
// comes in between unlinks it once more, which is harmless, rather than not
// at all).
void UnlinkOwn(const std::string& name, int slot) {
  shm_unlink(name.c_str());
  if (slot < 0) return;
  int expected = 2;
  if (!g_pending[slot].state.compare_exchange_strong(expected, 0))
    g_pending[slot].state.store(0, std::memory_order_release);  // the handler took it (1): free it
}

// The inode of this process's pid namespace (0 when /proc does not say).
uint64_t PidNamespace() {
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

// "nvgroup.<pid>.<ns>." prefix of a name: its pid and namespace, or false.
bool ParseCreator(const char* name, long* pid, uint64_t* ns) {
  static const char kPrefix[] = "nvgroup.";
  if (std::strncmp(name, kPrefix, sizeof(kPrefix) - 1) != 0) return false;
  const char* p = name + sizeof(kPrefix) - 1;
  char* end = nullptr;
  errno = 0;
  const long parsed_pid = std::strtol(p, &end, 10);
  if (errno != 0 || end == p || *end != '.' || parsed_pid <= 0) return false;
  p = end + 1;
  const unsigned long long parsed_ns = std::strtoull(p, &end, 10);
  if (errno != 0 || end == p || *end != '.') return false;
  *pid = parsed_pid;
  *ns = parsed_ns;
  return true;
}

// Local status of one setup step -> the same verdict on every member.
Status AgreeOnSetup(MPI_Comm group_comm, const Status& local, const std::vector<int>& global_ranks,
                    const char* step) {
  int mine = local.ok() ? 0 : 1;
  std::vector<int> all(global_ranks.size());
  NVG_MPI_CHECK(MPI_Allgather(&mine, 1, MPI_INT, all.data(), 1, MPI_INT, group_comm));
  if (!local.ok()) return local.WithContext(step);
  for (size_t m = 0; m < all.size(); ++m)
    if (all[m] != 0)
      return Status::Unavailable(std::string(step) + " failed on group rank " + std::to_string(m) +
                                 " (rank " + std::to_string(global_ranks[m]) + "); see that rank's error");
  return Status::Ok();
}

Status MapSegment(const std::string& name, size_t bytes, bool create, char** out) {
  int fd = -1;
  if (create) {
    NVG_SYS_CHECK(fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600));
    int rc;
    do {
      rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    } while (rc == EINTR);
    if (rc != 0) {
      close(fd);
      shm_unlink(name.c_str());
      return Status::Internal("posix_fallocate of " + std::to_string(bytes) + " bytes for " + name +
                              " failed: " + std::strerror(rc) +
                              " (is /dev/shm large enough? lower registered_bytes or "
                              "NVGROUP_FUSION_THRESHOLD)");
    }
  } else {
    NVG_SYS_CHECK(fd = shm_open(name.c_str(), O_RDWR, 0600));
    struct stat st;
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
      close(fd);
      return Status::Internal("shared memory segment " + name + " has the wrong size");
    }
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_errno = errno;
  close(fd);  // the mapping keeps the segment alive
  if (p == MAP_FAILED) {
    if (create) shm_unlink(name.c_str());
    return Status::Internal("mmap of " + name + " failed: " + std::strerror(map_errno));
  }
  *out = static_cast<char*>(p);
  return Status::Ok();
}

}  // namespace

void UnlinkPendingShmSegments() {
  for (int i = 0; i < kPendingSlots; ++i) {
    int expected = 2;
    if (g_pending[i].state.compare_exchange_strong(expected, 1)) shm_unlink(g_pending[i].name);
  }
}

int SweepStaleShmSegments() {
  const uint64_t ns = PidNamespace();
  if (ns == 0) return 0;  // whose namespace a name is of cannot be told
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  while (struct dirent* e = readdir(dir)) {
    long pid = 0;
    uint64_t creator_ns = 0;
    if (!ParseCreator(e->d_name, &pid, &creator_ns) || creator_ns != ns) continue;
    if (kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to judge)
    if (shm_unlink(("/" + std::string(e->d_name)).c_str()) == 0) ++removed;
  }
  closedir(dir);
  return removed;
}

ShmGroup::Control* ShmGroup::control(int m) const {
  static_assert(sizeof(Control) <= kControlBytes, "Control must fit the control page");
  return reinterpret_cast<Control*>(segments_[m]);
}

StatusOr<std::unique_ptr<ShmGroup>> ShmGroup::Create(MPI_Comm group_comm,
                                                     const std::vector<int>& global_ranks, size_t capacity,
                                                     double timeout_seconds,
                                                     const std::atomic<bool>* abort_flag) {
  std::unique_ptr<ShmGroup> g(new ShmGroup());
  NVG_MPI_CHECK(MPI_Comm_rank(group_comm, &g->member_));
  const int n = static_cast<int>(global_ranks.size());
  g->capacity_ = capacity;
  g->timeout_seconds_ = timeout_seconds;
  g->abort_flag_ = abort_flag;
  g->global_ranks_ = global_ranks;
  g->segments_.assign(n, nullptr);
  const size_t bytes = kControlBytes + capacity;

  // Step 0 (Note [No segment left behind]).
  const int swept = SweepStaleShmSegments();
  if (swept > 0)
    NVG_LOG(kInfo) << "removed " << swept << " shared-memory segment(s) of processes that ended without "
                   << "unlinking them (/dev/shm/nvgroup.<pid>.*)";

  // Step 1: the leader's name stem and every member's pid, then every member
  // creates and maps its own segment. The clock reading keeps a name leaked
  // by a crashed job from colliding with a later job whose leader got the
  // same pid (containers).
  uint64_t stem[3] = {static_cast<uint64_t>(getpid()), g_segment_counter.fetch_add(1),
                      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count())};
  NVG_MPI_CHECK(MPI_Bcast(stem, 3, MPI_UINT64_T, 0, group_comm));
  const uint64_t mine[2] = {static_cast<uint64_t>(getpid()), PidNamespace()};
  std::vector<uint64_t> creators(2 * n);
  NVG_MPI_CHECK(MPI_Allgather(mine, 2, MPI_UINT64_T, creators.data(), 2, MPI_UINT64_T, group_comm));
  const std::string suffix = std::to_string(stem[0]) + "." + std::to_string(stem[1]) + "." +
                             std::to_string(stem[2]) + ".";
  auto name = [&](int m) {
    return "/nvgroup." + std::to_string(creators[2 * m]) + "." + std::to_string(creators[2 * m + 1]) + "." +
           suffix + std::to_string(m);
  };
  const std::string own = name(g->member_);
  Status created = MapSegment(own, bytes, true, &g->segments_[g->member_]);
  const int slot = created.ok() ? AddPending(own) : -1;
  if (created.ok()) {
    // Fresh tmpfs pages are zero, but say so explicitly: generation 0, not failed.
    Control* c = new (g->segments_[g->member_]) Control();
    c->arrived.store(0, std::memory_order_relaxed);
    c->failed.store(0, std::memory_order_relaxed);
  }
  Status s = AgreeOnSetup(group_comm, created, global_ranks, "creating the shared-memory buffer");
  if (!s.ok()) {
    if (created.ok()) UnlinkOwn(own, slot);
    return s;  // the destructor unmaps what was mapped
  }

  // Step 2: map every peer's segment. Step 3 (after the agreement, which orders
  // all peers' mappings before it): unlink our own name, mapped or not.
  Status mapped = Status::Ok();
  for (int m = 0; m < n && mapped.ok(); ++m)
    if (m != g->member_) mapped = MapSegment(name(m), bytes, false, &g->segments_[m]);
  s = AgreeOnSetup(group_comm, mapped, global_ranks, "mapping the group's shared-memory buffers");
  UnlinkOwn(own, slot);
  if (!s.ok()) return s;
  return std::move(g);
}

ShmGroup::~ShmGroup() {
  for (char* seg : segments_)
    if (seg != nullptr) munmap(seg, kControlBytes + capacity_);
}

void ShmGroup::MarkFailed() { control(member_)->failed.store(1, std::memory_order_release); }

Status ShmGroup::Barrier(const char* what) {
  if (control(member_)->failed.load(std::memory_order_acquire) != 0)
    return Status::Unavailable(std::string("shared-memory group is broken by an earlier failure (at ") +
                               what + ")");
  const uint64_t gen = ++generation_;
  // Release: publishes everything this member wrote or read before the barrier.
  control(member_)->arrived.store(gen, std::memory_order_release);
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  const int n = size();
  for (int m = 0; m < n; ++m) {
    if (m == member_) continue;
    const Control* peer = control(m);
    // Acquire: pairs with the peer's release store above.
    for (int spins = 0; peer->arrived.load(std::memory_order_acquire) < gen; ++spins) {
      if (spins < kSpinsBeforeYield) continue;
      sched_yield();
      if (abort_flag_ != nullptr && abort_flag_->load(std::memory_order_acquire)) {
        MarkFailed();
        return Status::Aborted(std::string("communicator aborted while waiting at ") + what);
      }
      if (peer->failed.load(std::memory_order_acquire) != 0) {
        MarkFailed();
        return Status::Unavailable(std::string("group rank ") + std::to_string(m) + " (rank " +
                                   std::to_string(global_ranks_[m]) + ") failed; seen at " + what);
      }
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      if (waited > timeout_seconds_) {
        std::string missing;
        for (int q = 0; q < n; ++q)
          if (q != member_ && control(q)->arrived.load(std::memory_order_acquire) < gen)
            missing += (missing.empty() ? "" : ", ") + std::to_string(q) + " (rank " +
                       std::to_string(global_ranks_[q]) + ")";
        MarkFailed();
        return Status::Unavailable(std::string("timed out after ") + std::to_string(timeout_seconds_) +
                                   " s at " + what + ": group ranks " + missing + " did not arrive");
      }
    }
  }
  return Status::Ok();
}

}  // namespace nvgroup
