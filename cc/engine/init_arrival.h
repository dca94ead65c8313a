// The arrival check: Init's first communication, which names the ranks that
// did not reach init().
//
// Note [Arrival check]
// On the user's communicator, before anything collective: every rank other
// than 0 sends rank 0 one int (tag kArrivalTag) and waits for rank 0's
// verdict (tag kArrivalVerdictTag); rank 0 receives until every rank arrived
// or `timeout_s` passed, then sends every rank that arrived the list of those
// that did not (empty: all are here). So a rank that died, stopped or has not
// started yet is named by init()'s error on every rank that arrived, instead
// of a hang in the collectives that follow. A rank that hears nothing from
// rank 0 within timeout_s + kArrivalGraceS fails naming rank 0 (when rank 0
// reached init() more than kArrivalGraceS after this rank, a missing rank
// other than 0 is reported so too: the error says both).
// Point-to-point traffic on the user's communicator: the two tags are the
// engine's, and init() is collective, so no message of the user's can be in
// flight to be matched by them. Unmatched receives are cancelled; a send
// to a rank that is gone is abandoned with its memory (leaked on purpose).
#pragma once

#include <mpi.h>

#include <string>

#include "nvgroup/status.h"

namespace nvgroup {

constexpr int kArrivalTag = 0x4e56;         // "NV"
constexpr int kArrivalVerdictTag = 0x4e57;
constexpr double kArrivalGraceS = 2.0;

// OK when every rank arrived; else kUnavailable naming the missing ranks (or
// rank 0). `*ranks_text` says what this rank learned, for the init watchdog.
Status CheckArrival(MPI_Comm comm, int rank, int size, double timeout_s, std::string* ranks_text);

}  // namespace nvgroup
