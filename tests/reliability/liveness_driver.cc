// Drives a LivenessMonitor (cc/transport/liveness.h) on 3 ranks through its
// three verdicts, with exact expectations:
//   1. rank 2 stops reporting progress while ranks 0 and 1 advance:
//      DescribeSilentPeers() on ranks 0 and 1 names rank 2 ("no progress");
//   2. rank 2 is SIGSTOPped (rank 0 resumes it with SIGCONT after the check):
//      ranks 0 and 1 name it with "no heartbeat";
//   3. rank 2 calls Close() (BYE) and stays alive: no loss is reported;
//   4. rank 1 exits without Close(): rank 0 gets the loss callback naming
//      rank 1 with its host and pid, within a second.
// Each rank appends "rank R: OK <what>" or "rank R: FAIL <what>" to
// RECORD_DIR/liveness.<rank> (mpirun may drop output of a job that lost a
// rank), then the survivors exit at once.
//
//   mpirun -np 3 liveness_driver RECORD_DIR
#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>

#include "common/env.h"
#include "transport/liveness.h"

namespace {

using Clock = std::chrono::steady_clock;

FILE* g_record = nullptr;
int g_rank = -1;
int g_failures = 0;

void Report(bool ok, const std::string& what) {
  std::fprintf(g_record, "rank %d: %s %s\n", g_rank, ok ? "OK" : "FAIL", what.c_str());
  std::fflush(g_record);
  if (!ok) ++g_failures;
}

bool Contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Advances this rank's progress for `seconds` (unless `frozen`).
void Run(nvgroup::LivenessMonitor* m, double seconds, bool frozen, uint64_t* progress) {
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < end) {
    if (!frozen) m->SetProgress(++*progress);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc < 2 || size != 3) {
    std::fprintf(stderr, "usage: mpirun -np 3 liveness_driver RECORD_DIR\n");
    return 2;
  }
  g_record = std::fopen((std::string(argv[1]) + "/liveness." + std::to_string(g_rank)).c_str(), "w");
  long long pids[3];
  long long mine = getpid();
  MPI_Allgather(&mine, 1, MPI_LONG_LONG, pids, 1, MPI_LONG_LONG, MPI_COMM_WORLD);
  char hosts[3][256] = {};
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  MPI_Allgather(host, 256, MPI_CHAR, hosts, 256, MPI_CHAR, MPI_COMM_WORLD);

  std::mutex mu;
  std::string lost;
  Clock::time_point lost_at;
  nvgroup::StatusOr<nvgroup::Knobs> knobs = nvgroup::ParseKnobsFromEnvironment();
  if (!knobs.ok()) {
    Report(false, "knobs " + knobs.status().ToString());
    return 1;
  }
  const nvgroup::LivenessSettings settings{30.0, nvgroup::LivenessAddressSettingsFrom(knobs.value())};
  auto created = nvgroup::LivenessMonitor::Create(MPI_COMM_WORLD, settings, [&](const nvgroup::Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    lost = s.ToString();
    lost_at = Clock::now();
  });
  Report(created.ok(), "create " + created.status().ToString());
  if (!created.ok()) return 1;
  std::unique_ptr<nvgroup::LivenessMonitor> m = created.consume();
  uint64_t progress = 0;

  // 1. Rank 2's engine makes no progress while the others do.
  Run(m.get(), 2.0, g_rank == 2, &progress);
  if (g_rank != 2) {
    const std::string d = m->DescribeSilentPeers();
    Report(Contains(d, "rank 2 (host ") && Contains(d, "no progress") && !Contains(d, "rank 0 ") &&
               !Contains(d, "rank 1 "),
           "stuck engine named: '" + d + "'");
  }
  MPI_Barrier(MPI_COMM_WORLD);
  progress = 1000;  // everybody moves on together
  Run(m.get(), 1.5, false, &progress);
  if (g_rank != 2) {
    const std::string d = m->DescribeSilentPeers();
    Report(d.empty(), "nobody suspected once all advance: '" + d + "'");
  }
  MPI_Barrier(MPI_COMM_WORLD);

  // 2. Rank 2 stops (alive, silent); once ranks 0 and 1 checked, rank 0
  // resumes it (rank 1 tells rank 0 that it is done checking).
  if (g_rank == 2) {
    raise(SIGSTOP);
  } else {
    Run(m.get(), 2.0, false, &progress);
    const std::string d = m->DescribeSilentPeers();
    Report(Contains(d, "rank 2 (host ") && Contains(d, "pid " + std::to_string(pids[2])) &&
               Contains(d, "no heartbeat"),
           "stopped rank named: '" + d + "'");
    int token = 1;
    if (g_rank == 1) MPI_Send(&token, 1, MPI_INT, 0, 7, MPI_COMM_WORLD);
    if (g_rank == 0) {
      MPI_Recv(&token, 1, MPI_INT, 1, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      kill(static_cast<pid_t>(pids[2]), SIGCONT);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  {
    std::lock_guard<std::mutex> lock(mu);
    Report(lost.empty(), "no loss reported for a stopped rank: '" + lost + "'");
  }

  // 3. Rank 2 leaves cleanly (Close() says BYE) but stays alive: nobody may
  // report it.
  if (g_rank == 2) m->Close();
  MPI_Barrier(MPI_COMM_WORLD);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  {
    std::lock_guard<std::mutex> lock(mu);
    Report(lost.empty(), "no loss reported after a clean Close(): '" + lost + "'");
  }

  // 4. Rank 1 exits without Close(); rank 0 (directly) and rank 2 (if it
  // still listened) would hear of it -- rank 2 has closed, so only rank 0 checks.
  MPI_Barrier(MPI_COMM_WORLD);
  const auto death = Clock::now();
  if (g_rank == 1) {
    std::fclose(g_record);
    _exit(0);
  }
  if (g_rank == 2) {
    Report(g_failures == 0, "DONE");
    std::fclose(g_record);
    _exit(g_failures == 0 ? 0 : 1);
  }
  for (int i = 0; i < 500; ++i) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!lost.empty()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::lock_guard<std::mutex> lock(mu);
  const double latency = std::chrono::duration<double>(lost_at - death).count();
  Report(lost == "UNAVAILABLE: rank 1 (host " + std::string(hosts[1]) + ", pid " + std::to_string(pids[1]) +
                    ") died or exited without shutdown(); aborting" &&
             latency < 1.0,
         "death of rank 1 reported after " + std::to_string(latency) + " s: '" + lost + "'");
  Report(g_failures == 0, "DONE");
  std::fclose(g_record);
  _exit(g_failures == 0 ? 0 : 1);
}
