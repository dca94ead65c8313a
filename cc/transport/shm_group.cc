#include "transport/shm_group.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <new>

#include "common/checks.h"

namespace nvgroup {

struct ShmGroup::Control {
  // Own cache lines (64 B, x86/ARM line size) so a spinning reader of one flag
  // does not bounce the line the owner writes the other flag on.
  alignas(64) std::atomic<uint64_t> arrived;  // last barrier generation entered
  alignas(64) std::atomic<uint32_t> failed;   // nonzero once the owner gave up
};
static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "process-shared atomics must be lock free (address free)");

namespace {

// Spins before backing off to sched_yield: about a microsecond of polling, the
// cost of one cache-line transfer between cores many times over; beyond that
// the peer is probably descheduled (ranks may outnumber cores) and yielding
// lets it run.
constexpr int kSpinsBeforeYield = 256;

std::atomic<uint64_t> g_segment_counter{0};

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
                                 " (rank " + std::to_string(global_ranks[m]) +
                                 "); see that rank's error");
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

ShmGroup::Control* ShmGroup::control(int m) const {
  static_assert(sizeof(Control) <= kControlBytes, "Control must fit the control page");
  return reinterpret_cast<Control*>(segments_[m]);
}

StatusOr<std::unique_ptr<ShmGroup>> ShmGroup::Create(MPI_Comm group_comm,
                                                     const std::vector<int>& global_ranks,
                                                     size_t capacity, double timeout_seconds,
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

  // Step 1: the leader's name stem, then every member creates and maps its own
  // segment. The clock reading keeps a name leaked by a crashed job from
  // colliding with a later job whose leader got the same pid (containers).
  uint64_t stem[3] = {static_cast<uint64_t>(getpid()), g_segment_counter.fetch_add(1),
                      static_cast<uint64_t>(
                          std::chrono::steady_clock::now().time_since_epoch().count())};
  NVG_MPI_CHECK(MPI_Bcast(stem, 3, MPI_UINT64_T, 0, group_comm));
  const std::string prefix = "/nvgroup." + std::to_string(stem[0]) + "." +
                             std::to_string(stem[1]) + "." + std::to_string(stem[2]) + ".";
  auto name = [&](int m) { return prefix + std::to_string(m); };
  Status created = MapSegment(name(g->member_), bytes, true, &g->segments_[g->member_]);
  if (created.ok()) {
    // Fresh tmpfs pages are zero, but say so explicitly: generation 0, not failed.
    Control* c = new (g->segments_[g->member_]) Control();
    c->arrived.store(0, std::memory_order_relaxed);
    c->failed.store(0, std::memory_order_relaxed);
  }
  Status s = AgreeOnSetup(group_comm, created, global_ranks, "creating the shared-memory buffer");
  if (!s.ok()) {
    if (created.ok()) shm_unlink(name(g->member_).c_str());
    return s;  // the destructor unmaps what was mapped
  }

  // Step 2: map every peer's segment. Step 3 (after the agreement, which orders
  // all peers' mappings before it): unlink our own name, mapped or not.
  Status mapped = Status::Ok();
  for (int m = 0; m < n && mapped.ok(); ++m)
    if (m != g->member_) mapped = MapSegment(name(m), bytes, false, &g->segments_[m]);
  s = AgreeOnSetup(group_comm, mapped, global_ranks, "mapping the group's shared-memory buffers");
  shm_unlink(name(g->member_).c_str());
  if (!s.ok()) return s;
  return std::move(g);
}

ShmGroup::~ShmGroup() {
  for (char* seg : segments_)
    if (seg != nullptr) munmap(seg, kControlBytes + capacity_);
}

void ShmGroup::MarkFailed() {
  control(member_)->failed.store(1, std::memory_order_release);
}

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
