#include "engine/init_arrival.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <vector>

#include "common/checks.h"
#include "engine/mpi_wait.h"
#include "engine/rank_lists.h"

namespace nvgroup {
namespace {

// The verdict: [number missing, the first kNamed of them].
constexpr int kNamed = 64;
constexpr int kVerdictInts = 1 + kNamed;

// Memory of the exchange; leaked when an operation is abandoned (it may still
// write into it).
struct ArrivalExchange {
  int token = 1;
  std::vector<int> tokens;
  std::vector<MPI_Request> requests;
  std::vector<int> verdict = std::vector<int>(kVerdictInts, 0);
};

std::string MissingText(const int* verdict) {
  std::vector<int> named(verdict + 1, verdict + 1 + std::min(verdict[0], kNamed));
  std::string text = verdict[0] == 1 ? "rank " + std::to_string(named[0]) : "ranks " + RanksText(named);
  if (verdict[0] > kNamed) text += " and " + std::to_string(verdict[0] - kNamed) + " more";
  return text;
}

std::string SecondsText(double s) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", s);
  return text;
}

// Polls until every request completed or `deadline` passed; *done[i] says
// which completed. True when all did.
StatusOr<bool> PollAll(std::vector<MPI_Request>* requests, std::vector<bool>* done, double deadline) {
  size_t left = 0;
  for (bool d : *done) left += d ? 0 : 1;
  while (left > 0) {
    for (size_t i = 0; i < requests->size(); ++i) {
      if ((*done)[i]) continue;
      int flag = 0;
      NVG_MPI_CHECK(MPI_Test(&(*requests)[i], &flag, MPI_STATUS_IGNORE));
      if (flag) {
        (*done)[i] = true;
        --left;
      }
    }
    if (left == 0) break;
    if (MonotonicSeconds() > deadline) return false;
    usleep(1000);  // init(): a millisecond more is nothing, a spinning core is
  }
  return true;
}

Status RankZero(MPI_Comm comm, int size, double timeout_s, std::string* ranks_text) {
  auto x = std::make_unique<ArrivalExchange>();
  x->tokens.assign(size, 0);
  x->requests.assign(size - 1, MPI_REQUEST_NULL);
  for (int r = 1; r < size; ++r)
    NVG_MPI_CHECK(MPI_Irecv(&x->tokens[r], 1, MPI_INT, r, kArrivalTag, comm, &x->requests[r - 1]));
  std::vector<bool> arrived(size - 1, false);
  StatusOr<bool> all = PollAll(&x->requests, &arrived, MonotonicSeconds() + timeout_s);
  if (!all.ok()) {
    (void)x.release();
    return all.status();
  }
  std::vector<int> missing;
  for (int r = 1; r < size; ++r) {
    if (arrived[r - 1]) continue;
    NVG_MPI_CHECK(MPI_Cancel(&x->requests[r - 1]));
    NVG_MPI_CHECK(MPI_Request_free(&x->requests[r - 1]));
    missing.push_back(r);
  }
  x->verdict[0] = static_cast<int>(missing.size());
  for (int i = 0; i < std::min(x->verdict[0], kNamed); ++i) x->verdict[1 + i] = missing[i];
  const std::string missing_text = MissingText(x->verdict.data());
  // Freed below only once every request completed: a cancelled receive may
  // complete after its request was freed, a send to a rank that went away
  // stays pending.
  ArrivalExchange* const kept = x.release();
  std::vector<MPI_Request> sends;
  for (int r = 1; r < size; ++r) {
    if (!arrived[r - 1]) continue;
    sends.push_back(MPI_REQUEST_NULL);
    NVG_MPI_CHECK(MPI_Isend(kept->verdict.data(), kVerdictInts, MPI_INT, r, kArrivalVerdictTag, comm,
                            &sends.back()));
  }
  std::vector<bool> sent(sends.size(), false);
  StatusOr<bool> delivered = PollAll(&sends, &sent, MonotonicSeconds() + kArrivalGraceS);
  if (!delivered.ok()) return delivered.status();
  if (missing.empty()) {
    if (delivered.value()) delete kept;
    *ranks_text = "every rank reached init()";
    return Status::Ok();  // a rank that went away since arriving is the next phases' to find
  }
  *ranks_text = missing_text + " did not reach init()";
  return Status::Unavailable(missing_text + " of " + std::to_string(size) + " did not reach init() within " +
                             SecondsText(timeout_s) +
                             " s (NVGROUP_INIT_TIMEOUT): died, stopped, or not started yet");
}

Status OtherRank(MPI_Comm comm, double timeout_s, std::string* ranks_text) {
  auto x = std::make_unique<ArrivalExchange>();
  x->requests.assign(2, MPI_REQUEST_NULL);
  NVG_MPI_CHECK(MPI_Isend(&x->token, 1, MPI_INT, 0, kArrivalTag, comm, &x->requests[0]));
  NVG_MPI_CHECK(MPI_Irecv(x->verdict.data(), kVerdictInts, MPI_INT, 0, kArrivalVerdictTag, comm,
                          &x->requests[1]));
  std::vector<bool> done(2, false);
  StatusOr<bool> all = PollAll(&x->requests, &done, MonotonicSeconds() + timeout_s + kArrivalGraceS);
  if (!all.ok()) {
    (void)x.release();
    return all.status();
  }
  if (!all.value()) {
    if (!done[1]) {
      NVG_MPI_CHECK(MPI_Cancel(&x->requests[1]));
      NVG_MPI_CHECK(MPI_Request_free(&x->requests[1]));
    }
    (void)x.release();  // the send to rank 0 may stay pending
    *ranks_text = "rank 0 did not answer the arrival check";
    return Status::Unavailable(
        "rank 0 did not answer the arrival check within " + SecondsText(timeout_s + kArrivalGraceS) +
        " s (NVGROUP_INIT_TIMEOUT plus " + SecondsText(kArrivalGraceS) +
        " s): rank 0 did not reach init() (died, stopped, or not started yet), or it "
        "reached it later than this rank and another rank did not (rank 0's error names it)");
  }
  if (x->verdict[0] == 0) {
    *ranks_text = "every rank reached init()";
    return Status::Ok();
  }
  *ranks_text = MissingText(x->verdict.data()) + " did not reach init() (rank 0's arrival check)";
  return Status::Unavailable(MissingText(x->verdict.data()) + " did not reach init() within " +
                             SecondsText(timeout_s) +
                             " s of rank 0 (NVGROUP_INIT_TIMEOUT): died, stopped, or not started yet");
}

}  // namespace

Status CheckArrival(MPI_Comm comm, int rank, int size, double timeout_s, std::string* ranks_text) {
  if (size == 1) {
    *ranks_text = "a job of one rank";
    return Status::Ok();
  }
  return rank == 0 ? RankZero(comm, size, timeout_s, ranks_text) : OtherRank(comm, timeout_s, ranks_text);
}

}  // namespace nvgroup
