// Execution of the collectives added after allreduce/allgather/broadcast:
// reducescatter, alltoall and join (Engine::Run* in collectives_extra.cc), and
// the arithmetic they share with the allreduce path.
//
// How it works. Each runs as a bucket of its own, after negotiation agreed on
// every parameter (controller.cc), through the Communicator:
//  * reducescatter: Communicator::ReduceScatter with Horovod's row split (ranks
//    below dim0 % size get one more row), scale factors applied as allreduce
//    applies them (prescale into a scratch copy of the input, postscale on the
//    output), so every row holds the bits the allreduce would give it;
//  * alltoall: the negotiated size x size splits matrix gives this rank's send
//    and receive byte counts; Communicator::Alltoallv moves the rows;
//  * join: writes the last rank to join (the coordinator's answer) and clears
//    this rank's joined state. While joined, the rank stands in for the
//    allreduces/reducescatters of the others with a zero input
//    (MakeJoinStandIn), both for negotiated and cached responses.
#pragma once

#include "engine/wire_format.h"
#include "nvgroup/engine.h"

namespace nvgroup {

// Whether an Average of `r` runs as Sum with postscale / size (floats always;
// integers when a scale factor is given, as Horovod's ScaleBuffer does) rather
// than the communicator's truncating integer average.
bool AverageByPostscale(const ResponseMessage& r);

// ReducescatterRows (Horovod's split): nvgroup/engine.h.

}  // namespace nvgroup
