// CrossExchange: the cross-group step of the hierarchical allreduce (step 2 of
// cc/algorithms/hierarchical_allreduce.h), written once for the CPU and the GPU.
//
// What it computes. Every rank of the cross communicator (the *peers*: the
// ranks of one group_rank in every group, ordered by group_index) holds a slice
// of n elements. Afterwards every peer holds, element for element, the left fold
// s_0 (op) s_1 (op) ... (op) s_{P-1} of the P slices in group_index order (the
// final Average division included when asked), bitwise identical on all peers.
//
// How (bandwidth-optimal: reduce-scatter + allgather). The slice is cut into P
// *parts* (ChunkSlices geometry: 16-byte aligned, part p owned by peer p).
//   1. MPI_Ialltoallv: part p of every peer's slice goes to peer p
//      (`send` -> `recv`, P copies of our part, in peer order);
//   2. fold: the P copies, in peer order, into our part of `result` (the Fold
//      callback: ReduceFold on the host, or the device fold kernel when MPI
//      reads device memory);
//   3. MPI_Iallgatherv (in place on `result`): every peer gets every part.
// Each peer sends (P-1)/P of the slice in each collective, 2 (P-1)/P in all,
// and receives as much (an allgather of whole slices followed by a local fold
// receives P-1 slices: P/2 times more). BytesSent() counts what was posted.
//
// Pipelining. Start() queues a job and returns at once; Wait() blocks until it
// finished. Jobs are progressed by one progress thread per exchange (MPI
// nonblocking collectives completed with MPI_Test), so the caller's thread keeps
// issuing the next chunk's group step, copies and kernels while this chunk is in
// flight. Without MPI_THREAD_MULTIPLE there is no thread: Wait() progresses the
// jobs itself (still nonblocking, still overlapping the jobs in flight).
//
// Ordering across ranks. MPI requires the collectives of a communicator to be
// posted in the same order on every rank. The alltoallvs run on one duplicate of
// the cross communicator and the allgathervs on another, each posted strictly in
// job order, so every rank posts the same sequence on each communicator whatever
// the timing (an alltoallv of job c+1 may overtake the allgatherv of job c).
//
// Buffers. A job owns its send/recv/result buffers from Start() until Wait()
// returned: the caller must not touch them (nor free them) in between. The
// `ready` predicate (polled on the progress thread, may be empty) gates the
// alltoallv: the GPU uses it for "the copy of the slice into `send` landed";
// `done` runs on the progress thread after the allgatherv (the GPU enqueues the
// copy back to the device there). A posted MPI request is always completed,
// never abandoned (MPI cannot cancel collectives: see Note [Blocking MPI
// steps] in cc/cpu/cpu_communicator.h): a peer lost mid-exchange is reported by
// MPI, and the destructor waits for the jobs in flight.
#pragma once

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "nvgroup/status.h"

namespace nvgroup {

class CrossExchange {
 public:
  // Folds `num_sources` contiguous copies of `count` elements at `sources`
  // (copy k at sources + k * count elements, k = peer order) into `dst`.
  using Fold = std::function<Status(const void* sources, int num_sources, void* dst, size_t count)>;

  struct Job {
    const void* send = nullptr;  // our slice (`count` elements)
    void* recv = nullptr;        // scratch: at least RecvBytes(count, esize)
    void* result = nullptr;      // the reduced slice lands here (may be `send`)
    size_t count = 0;            // elements of the slice
    size_t element_size = 4;
    Fold fold;
    std::function<Status(bool* ready)> ready;  // optional: *ready once `send` holds the slice
    std::function<Status()> done;  // optional: after the allgatherv, on the progress thread
  };

  // Duplicates `cross` twice (collective over it). `use_thread` false forces
  // progress inside Wait() (also chosen when MPI lacks MPI_THREAD_MULTIPLE).
  static StatusOr<std::unique_ptr<CrossExchange>> Create(MPI_Comm cross, bool use_thread = true);
  ~CrossExchange();

  int peers() const { return peers_; }
  int peer_index() const { return me_; }
  // Scratch `recv` needs for a slice of `count` elements.
  size_t RecvBytes(size_t count, size_t element_size) const;

  // Queues the exchange of one slice; *ticket identifies it for Wait().
  Status Start(Job job, uint64_t* ticket);

  // The reduce-scatter half alone, with parts of any size (the hierarchical
  // reduce-scatter, cc/algorithms/hierarchical_reduce_scatter.h): `send` holds
  // part p for peer p (part_counts[p] elements), consecutive in peer order;
  // the P copies of our part arrive in `recv` (P * part_counts[me] elements,
  // peer order) and `fold` folds them into `result` (part_counts[me]
  // elements). Stage 3 (the allgatherv) is left out: `done` runs after the
  // fold. Same queue, posting order and buffer rules as Start().
  struct ScatterJob {
    const void* send = nullptr;
    const size_t* part_counts = nullptr;  // peers() entries, read inside the call only
    void* recv = nullptr;
    void* result = nullptr;
    size_t element_size = 4;
    Fold fold;
    std::function<Status(bool* ready)> ready;
    std::function<Status()> done;
  };
  Status StartReduceScatter(ScatterJob job, uint64_t* ticket);
  // Blocks until the job of `ticket` finished; its status (the first error of
  // any job breaks the exchange: later calls return it).
  Status Wait(uint64_t ticket);

  // Bytes this process posted to other ranks in cross exchanges (all
  // exchanges of the process): per job the alltoallv's parts for the other
  // peers plus (P-1) times our part in the allgatherv (none for a
  // reduce-scatter-only job).
  static uint64_t BytesSent();

 private:
  struct Active;
  CrossExchange() = default;
  void ProgressLoop();
  // Advances every active job as far as it goes without blocking; returns true
  // if anything moved. mu_ is held only around the queue, never across MPI.
  bool ProgressOnce();
  Status Advance(Active& a, bool failed, bool* moved);
  Status Enqueue(std::shared_ptr<Active> a, uint64_t* ticket);

  MPI_Comm rs_comm_ = MPI_COMM_NULL;  // alltoallvs, in job order
  MPI_Comm ag_comm_ = MPI_COMM_NULL;  // allgathervs, in job order
  int peers_ = 1;
  int me_ = 0;
  bool threaded_ = false;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Active>> active_;  // in job order
  uint64_t next_ticket_ = 0;
  uint64_t finished_below_ = 0;  // every ticket < this finished
  Status failure_;               // first failure (then every job fails)
  bool stop_ = false;
  std::thread thread_;
  // Only the progressing thread touches these (posting order per communicator).
  uint64_t next_rs_post_ = 0;
  uint64_t next_ag_post_ = 0;
};

// The cross-step jobs of one skeleton call, by chunk parity, written once for
// every primitives type (HostPrimitives, HostScatterPrimitives,
// DevicePrimitives, DeviceScatterPrimitives). The skeletons
// (cc/algorithms/hierarchical_allreduce.h, hierarchical_reduce_scatter.h) keep
// two chunks in the cross step: chunk c reuses the buffers of chunk c - 2,
// which CrossFinish(c - 2) released. A chunk with nothing for this rank's
// group rank starts no job (the same on every peer); its Finish waits for
// nothing.
class CrossJobs {
 public:
  explicit CrossJobs(CrossExchange* cross) : cross_(cross) {}

  // kInternal when the buffers of the chunk's parity still belong to a job.
  Status CheckFree(size_t chunk_index) const;
  // Queue the chunk's job (CrossExchange::Start / StartReduceScatter).
  Status Start(size_t chunk_index, CrossExchange::Job job);
  Status StartReduceScatter(size_t chunk_index, CrossExchange::ScatterJob job);
  // The primitives' CrossFinish: waits for the chunk's job if one was started
  // (*waited, when given, says whether) and releases its buffers.
  Status Finish(size_t chunk_index, bool* waited = nullptr);

 private:
  CrossExchange* cross_;
  bool in_flight_[2] = {false, false};  // a job of that parity was started
  uint64_t ticket_[2] = {0, 0};
};

}  // namespace nvgroup
