// CrossExchange: the cross-group step of the hierarchical allreduce (step 2 of
// cc/algorithms/hierarchical_allreduce.h), written once for the CPU and the GPU.
//
// What it computes. Every rank of the cross communicator (the *peers*: the
// ranks of one group_rank in every group, ordered by group_index) holds a slice
// of n elements. Afterwards every peer holds, element for element, the left fold
// s_0 (op) s_1 (op) ... (op) s_{P-1} of the P slices in group_index order (the
// final Average division included when asked), bitwise identical on all peers.
//
// How: one of two variants per slice, chosen from the slice's size alone
// (VariantFor), so every peer picks the same one for the same job. Each
// *round* is point-to-point: every peer posts its receives from the other
// peers, then its sends to them, and the round is complete when all of them
// are (MPI_Testall); a first round's receives are posted as soon as the job is
// taken, its sends once `ready` (below), so a peer that staged its slice
// sooner finds them waiting. Our own share of a first round is not moved: the fold
// reads it where it lies in `send` (Options::host_memory; on device memory,
// with CUDA-aware MPI, it is a message to ourselves instead, so the device fold
// reads P contiguous copies in `recv`). Rounds of all peers run at once: no
// schedule of a nonblocking collective to step through.
//  * Reduce-scatter + allgather (bandwidth-optimal, two rounds). The slice is
//    cut into P *parts* (ChunkSlices geometry: whole units, part p owned by
//    peer p; the words: Note [Vocabulary], cc/algorithms/hierarchical_allreduce.h).
//     1. reduce-scatter round: part p of every peer's slice goes to peer p
//        (`send` -> `recv`, the other peers' copies of our part);
//     2. fold: the P copies, in peer order, into our part of `result` (the
//        Fold callback: ReduceFold on the host, or the device fold kernel when
//        MPI reads device memory);
//     3. allgather round (in place on `result`): our part to every other
//        peer, theirs into their place.
//    Each peer sends (P-1)/P of the slice in each round, 2 (P-1)/P in all.
//  * Allgather + fold (latency-optimal, one round), for slices whose (P-1)
//    copies are at most Options::allgather_max_bytes (twice that for P = 2:
//    AllgatherLimitBytes):
//     1. allgather round: every peer's whole slice to every peer (`send` ->
//        `recv`, the other peers' slices);
//     2. fold: the P slices, in peer order, into the whole of `result`.
//    Each peer sends (P-1) slices: the same bytes as the other variant for
//    P = 2, P/2 times more above; it folds the whole slice instead of one
//    part. The fold is the same function on the same operands in the same
//    order, element for element, so both variants give the same bits.
// BytesSent() counts what was posted.
//
// Pipelining. Start() queues a job and returns at once; Wait() returns once it
// finished. While no caller waits, the jobs are progressed by one progress
// thread per exchange, so the caller's thread keeps issuing the next chunk's
// group step, copies and kernels while this chunk is in flight; a caller in
// Wait() progresses them itself. Without MPI_THREAD_MULTIPLE there is no
// thread: Start() and Wait() progress the jobs (still nonblocking, still
// overlapping the jobs in flight).
//
// Note [Cross exchange protocol]
// Who waits for what. The jobs' state (the taken jobs, the posting counters)
// is advanced by ProgressOnce under `progressing_`, an atomic try-lock
// (acquire on taking it, release on leaving it, so whoever takes it next sees
// the jobs as the last holder left them); the caller and the progress thread
// both take it, never blocking on it.
//  * Caller -> jobs (Start). The job goes into `incoming_` under mu_ and
//    `submitted_` is bumped there; then the caller progresses once itself, so
//    a round that can be posted at once is posted on the caller's thread. A
//    sleeping progress thread is not woken: the skeletons wait for every
//    chunk they start after at most one more Start (which progresses again),
//    and Wait hands what is left in flight to the thread (below). Waking it
//    here cost the fixed cost of a small exchange several times over on the
//    2-core VM (cc/tools/cross_exchange_cost: a woken thread competes with
//    the polling ranks for a core).
//  * Polling MPI. Whoever progresses polls without sleeping while any job is
//    in flight: MPI_Testall on every posted round, and on the receives a job
//    posted while it waits for `ready` (Open MPI moves a transfer's
//    fragments only inside MPI calls, so a poll that sleeps stalls the
//    transfer itself), `ready` / `writable` of the jobs waiting for them;
//    back to back for kBackToBackPollS after anything moved, then yielding
//    the core between polls.
//  * Caller waits (Wait). It raises `waiting_callers_` and progresses the jobs
//    itself until its ticket is below finished_below_ (or the exchange
//    failed): the completion is seen by the thread that polled it, with no
//    condition-variable wake-up on the path. The progress thread, seeing a
//    waiting caller, sleeps on work_cv_ (one thread per rank polls, not two:
//    ranks may outnumber cores). Leaving Wait, the caller lowers the count
//    under mu_ and notifies a sleeping progress thread if jobs are left in
//    flight (the next chunk's), which it takes over.
//  * The progress thread sleeps (`sleeping_`, set under mu_) while no job is
//    in flight or a caller waits, and until it is woken: by a caller leaving
//    Wait with jobs in flight, or the destructor's stop. Its predicate (stop,
//    jobs in flight, callers waiting) is read under mu_ and both wakers change
//    it under mu_ before they notify: no lost wake-up.
//  * Failure: failure_ is set under mu_, then failed_; Wait returns once it
//    saw failed_, with failure_ read under mu_.
// Memory ordering of the buffers: the caller writes `send` before Start (mu_
// and progressing_ order those writes before the MPI call that reads them;
// the GPU's device-side writes are ordered by `ready`); MPI writes `recv` and
// `result`, and the fold reads `recv` after MPI_Test reported completion
// (MPI's completion semantics) and our own share in `send` (written before
// Start, as above; MPI only reads it); the caller reads `result` after Wait saw
// finished_below_ with acquire (stored after the job's `done` by whoever
// progressed it).
// The GPU's streams and host buffers: the device primitives' header
// (cc/device/device_primitives.h) says which event gates `ready` and
// `writable` and where the copies run.
//
// Ordering across ranks. Messages of one (source, tag, communicator) match in
// the order they were posted. Every job posts its first round (reduce-scatter
// or allgather) on rs_comm_, its receives in job order and its sends in job
// order; only reduce-scatter + allgather
// jobs post a second round, on ag_comm_, in the order of those jobs. The
// variant, and so the sequence of rounds and their sizes on each
// communicator, depend only on the job sequence and the slices' sizes, the
// same on every peer, so round k of one peer meets round k of every other
// whatever the timing (the first round of job c+1 may overtake the second of
// job c; jobs finish in order). An empty message is skipped by both sides.
//
// Buffers. A job owns its send/recv/result buffers from Start() until Wait()
// returned: the caller must not touch them (nor free them) in between (MPI
// may write `recv` from the first progress after Start on). A Wait that
// returns the exchange's failure returns before the jobs still in flight
// completed (a receive already matched is not cancelled): their buffers stay
// MPI's until the exchange is destroyed, which completes them. The
// `ready` predicate (polled by whoever progresses, may be empty) gates the
// first round's sends: the GPU uses it for "the copy of the slice into `send`
// landed"; `writable` (may be empty) gates the fold, the first write of
// `result`: the GPU uses it for "the copy of chunk c - 2 out of this `result`
// landed". `done` runs after the last round, on the thread that completed it
// (the GPU enqueues the copy back to the device there). A posted MPI request
// is always completed, never abandoned (see Note [Blocking MPI steps] in
// cc/cpu/cpu_communicator.h: a request left behind writes into freed memory
// once the late peer arrives): a peer lost
// mid-exchange is reported by MPI, and the destructor waits for the jobs in
// flight.
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

struct CrossExchangeOptions {
  // false forces progress inside Wait() (also chosen when MPI lacks
  // MPI_THREAD_MULTIPLE).
  bool use_thread = true;
  // Slices whose allgather sends at most this many bytes per peer ((P-1)
  // slices) take the one-round allgather + fold; 0: never
  // (NVGROUP_CROSS_ALLGATHER_MAX_BYTES; the same on every peer).
  size_t allgather_max_bytes = 0;
  // The jobs' buffers are host memory: our own share of a first round stays
  // in `send`, where the fold reads it. false (device buffers, CUDA-aware
  // MPI): a message to ourselves, so the P copies are contiguous in `recv`.
  bool host_memory = true;
};

class CrossExchange {
 public:
  // Folds `num_sources` copies of `count` elements, sources[k] = peer k's,
  // into `dst` in peer order. On host memory sources[me] lies in the job's
  // `send` (and `dst` may be that very place: element for element, as
  // ReduceFold allows); on device memory the P copies are contiguous in
  // `recv` (sources[k] = sources[0] + k * count elements).
  using Fold = std::function<Status(const void* const* sources, int num_sources, void* dst, size_t count)>;
  using Predicate = std::function<Status(bool* yes)>;

  struct Job {
    const void* send = nullptr;  // our slice (`count` elements)
    void* recv = nullptr;        // scratch: at least RecvBytes(count, esize)
    void* result = nullptr;      // the reduced slice lands here (may be `send`)
    size_t count = 0;            // elements of the slice
    size_t element_size = 4;
    Fold fold;
    Predicate ready;     // optional: *yes once `send` holds the slice
    Predicate writable;  // optional: *yes once `result` may be written
    std::function<Status()> done;  // optional: after the last round, on the thread that completed it
  };

  enum class Variant { kReduceScatterAllgather, kAllgatherFold };

  using Options = CrossExchangeOptions;

  // Duplicates `cross` twice (collective over it).
  static StatusOr<std::unique_ptr<CrossExchange>> Create(MPI_Comm cross, Options options = Options());
  ~CrossExchange();

  int peers() const { return peers_; }
  int peer_index() const { return me_; }
  // The variant of a slice of `count` elements (the same on every peer).
  Variant VariantFor(size_t count, size_t element_size) const;
  // The most bytes a slice's allgather may send in all ((P - 1) slices) for
  // the slice to take the one-round variant, given Options::allgather_max_bytes
  // and P peers: twice the setting with two peers, where both variants send the
  // same bytes (one slice in one round, or two halves in two rounds), so the
  // one round costs only the fold of the other half; the setting itself with
  // more peers, where the allgather sends P/2 times the bytes. Measured on one
  // H100, 2-4 ranks sharing it as groups of 1 (cross_step_bench's allgather
  // and rsag columns, 2026-12-07, 6 runs at 2 ranks, 4 at 3, 2 at 4): a 64 KiB
  // slice took 5-15% less by the allgather with 2 peers and 4-14% more with 3
  // and 4; a 256 KiB one between 1% less and 6% more with 2.
  static size_t AllgatherLimitBytes(size_t allgather_max_bytes, int peers);
  // Scratch `recv` needs for a slice of `count` elements (room for P copies
  // in peer order; on host memory our own slot is left unused).
  size_t RecvBytes(size_t count, size_t element_size) const;
  // The most RecvBytes asks for any slice of at most `max_slice_bytes`.
  size_t MaxRecvBytes(size_t max_slice_bytes) const;

  // Queues the exchange of one slice; *ticket identifies it for Wait().
  Status Start(Job job, uint64_t* ticket);

  // The reduce-scatter half alone, with parts of any size (the hierarchical
  // reduce-scatter, cc/algorithms/hierarchical_reduce_scatter.h): `send` holds
  // part p for peer p (part_counts[p] elements), consecutive in peer order;
  // the other peers' copies of our part arrive in `recv` (room for P *
  // part_counts[me] elements, peer order; ours as Start's) and `fold` folds
  // the P copies into `result` (part_counts[me] elements). Step 3 (the allgather round) is left out: `done` runs after the
  // fold. Same queue, posting order and buffer rules as Start().
  struct ScatterJob {
    const void* send = nullptr;
    const size_t* part_counts = nullptr;  // peers() entries, read inside the call only
    void* recv = nullptr;
    void* result = nullptr;
    size_t element_size = 4;
    Fold fold;
    Predicate ready;
    Predicate writable;
    std::function<Status()> done;
  };
  Status StartReduceScatter(ScatterJob job, uint64_t* ticket);
  // Returns once the job of `ticket` finished; its status (the first error of
  // any job breaks the exchange: later calls return it).
  Status Wait(uint64_t ticket);

  // Bytes this process posted to other ranks in cross exchanges (all
  // exchanges of the process): per reduce-scatter + allgather job the parts
  // for the other peers plus (P-1) times our part in the allgather round
  // (none for a reduce-scatter-only job); per allgather + fold job (P-1)
  // times the slice.
  static uint64_t BytesSent();
  // Jobs this process started as allgather + fold (all exchanges of the
  // process), for tests of the variant choice.
  static uint64_t AllgatherJobs();

 private:
  struct Active;
  CrossExchange() = default;
  void ProgressLoop();
  // Takes the submitted jobs and advances every job as far as it goes without
  // blocking; returns true if anything moved. Called only under progressing_.
  bool ProgressOnce();
  // ProgressOnce if progressing_ is free (false when it is not).
  bool TryProgress();
  Status Advance(Active& a, bool* moved);
  Status Enqueue(std::unique_ptr<Active> a, uint64_t* ticket);
  bool HasWork() const;  // a job started and not finished
  bool Finished(uint64_t ticket) const;
  Status FailureStatus();

  MPI_Comm rs_comm_ = MPI_COMM_NULL;  // every job's first round, in job order
  MPI_Comm ag_comm_ = MPI_COMM_NULL;  // second rounds (allgather of the parts), in the order of their jobs
  int peers_ = 1;
  int me_ = 0;
  bool threaded_ = false;
  size_t allgather_max_bytes_ = 0;
  bool host_memory_ = true;

  // Shared between the callers and the progress thread.
  std::mutex mu_;
  std::condition_variable work_cv_;  // the progress thread sleeps here
  std::deque<std::unique_ptr<Active>> incoming_;  // started, not taken yet (mu_)
  uint64_t next_ticket_ = 0;  // mu_
  uint64_t next_ag_index_ = 0;  // mu_: order of the second rounds
  Status failure_;  // mu_: first failure (then every job fails)
  bool stop_ = false;  // mu_
  bool sleeping_ = false;  // mu_: the progress thread waits on work_cv_
  std::atomic<uint64_t> submitted_{0};  // tickets handed out
  std::atomic<uint64_t> finished_below_{0};  // every ticket < this finished
  std::atomic<bool> failed_{false};
  std::atomic<int> waiting_callers_{0};  // callers inside Wait
  std::atomic<bool> progressing_{false};  // held while ProgressOnce runs
  std::thread thread_;
  // Only under progressing_.
  std::deque<std::unique_ptr<Active>> active_;  // taken, in job order
  uint64_t taken_ = 0;
  uint64_t next_rs_recv_post_ = 0;  // the next job whose first round's receives may be posted
  uint64_t next_rs_send_post_ = 0;  // ... and its sends
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
