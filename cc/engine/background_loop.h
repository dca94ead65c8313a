// The engine's background loop: negotiation, fusion and execution.
//
// How it works (Horovod's pipeline; see STYLE.md §A.4):
//   1. Enqueue validates the request on this rank and puts a self-contained
//      TensorEntry into the TensorQueue, waking the background thread.
//   2. Each cycle the background loop takes the queued entries, then all ranks
//      agree on what is ready everywhere: first through the response cache
//      (one bitwise-AND allreduce, see response_cache.h), then, only when some
//      rank has something rank 0 has not seen, through rank 0 (gather the
//      request lists, Coordinator builds responses, broadcast the response list).
//   3. The cycle's responses (cache hits in slot order, then rank 0's list) are
//      planned into fusion buckets (fusion.h) and run through a Communicator.
//   4. Each request's `done` runs once, with OK or the error.
//
// Design constraints of the background loop (written down as Horovod does):
//  * Only the background thread calls MPI after Init, on the engine's own
//    duplicate of the user's communicator, so negotiation never interleaves with
//    the user's MPI traffic and needs no locks around MPI.
//  * Every rank runs the same sequence of collectives: each cycle is exactly one
//    cache-bit allreduce, then the negotiation round if that allreduce says any
//    rank needs it (all ranks read the same bits), then the same buckets in the
//    same order (all ranks hold the same response list and cache).
//  * Ranks may submit in any order and at any time: names, not submission order,
//    match collectives across ranks.
//  * Mismatches are errors, not hangs: rank 0 turns disagreement into an error
//    response that every rank receives.
//  * No negotiation wait is unbounded: every MPI call is non-blocking and polled
//    with an abort flag and NVGROUP_TIMEOUT; a silent peer fails every pending
//    request with kUnavailable and stops the loop.
//  * Abort (engine_control.h, for a liveness monitor) raises a flag every wait
//    polls; the loop then fails everything with the abort's reason. Memory an
//    abandoned MPI operation may still touch is never freed (CycleBuffers).
//  * Shutdown is agreed: a rank that wants to stop clears a bit in the cycle's
//    allreduce, and all ranks leave the loop after that same cycle, so no rank
//    is left inside a collective.
#pragma once

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/env.h"
#include "engine/controller.h"
#include "engine/fusion.h"
#include "engine/mpi_wait.h"
#include "engine/response_cache.h"
#include "engine/stall_inspector.h"
#include "engine/tensor_queue.h"
#include "engine/timeline.h"
#include "nvgroup/communicator.h"
#include "transport/liveness.h"

namespace nvgroup {

class Finalizer;  // background_loop.cc: runs CUDA completions off the loop

// One running engine (Init to Shutdown): the queue, the background thread and
// everything it owns.
class Engine {
 public:
  // Starts the background thread. `comm` (the engine's duplicate of the user's
  // communicator) and `cpu` are owned from here on.
  // `cuda`, when given, is the CUDA communicator Init created already
  // (EngineOptions::cuda_at_init); otherwise the first CUDA response creates it.
  Engine(const Knobs& knobs, MPI_Comm comm, int rank, int size, std::unique_ptr<Communicator> cpu,
         std::unique_ptr<Communicator> cuda = nullptr);
  ~Engine();

  const Topology& topology() const { return topology_; }
  int size() const { return size_; }
  Status Submit(std::vector<TensorEntry> entries) { return queue_.Push(std::move(entries)); }
  // Agrees on shutdown with the other ranks, fails what is in flight with
  // kAborted, joins the thread and frees the communicators. Idempotent.
  Status Stop();
  // Makes every wait in flight return and the loop stop, failing every pending
  // and later request with `reason` (see engine_control.h). Any thread; the
  // first reason wins.
  void Abort(const Status& reason);
  // True on the engine's own threads (where done callbacks run): Stop() must
  // not be called there, it would join itself.
  bool OnEngineThread() const;

 private:
  struct Pending {
    TensorEntry entry;
    bool reported = false;  // sent to rank 0 in a negotiation round
    double since = 0;       // when the loop took it from the queue
  };
  // A response with this rank's entry (absent for error responses about names
  // this rank never submitted).
  struct Work {
    ResponseMessage response;
    std::unique_ptr<Pending> pending;
  };

  void Loop();
  // `s`, or the reason given to Abort() when there is one: after an abort
  // (e.g. a peer died) every failure is a consequence of it.
  Status Cause(const Status& s);
  void Admit(TensorEntry entry, double now);
  bool FillCacheBits(double now, std::vector<uint64_t>* bits);
  std::vector<Work> TakeCacheHits(const std::vector<uint64_t>& bits);
  Status Negotiate(double now, std::vector<Work>* work);
  // The first `cache_hits` entries of `work` came from the response cache.
  Status Execute(std::vector<Work>* work, size_t cache_hits);
  Status RunAllreduceBucket(const FusionBucket& bucket, std::vector<Work>* work);
  Status RunAllreduceAlone(Work* w);
  Status RunAllgather(Work* w);
  Status RunBroadcast(Work* w);
  StatusOr<Communicator*> GetCommunicator(const Device& device);
  void Complete(Pending* p, const Status& status);
  // CPU: completes at once. CUDA: requests with wait_on_completion complete
  // at once after their stream wait is enqueued (device completion, engine.h);
  // the others after the communicator's stream drains.
  void CompleteAfterStream(Communicator* comm, std::vector<Pending*> done);
  // Device completion: a finalizer job syncs the stream off the loop and aborts
  // the engine if the device reported a failure (at most one job queued).
  void CheckDeviceHealthLater(Communicator* comm);
  std::atomic<bool> health_check_queued_{false};
  Status Wait(MPI_Request* request, const std::string& what) {
    return WaitMpi(request, what, knobs_.peer_timeout_s, abort_);
  }

  const Knobs knobs_;
  MPI_Comm comm_;
  const int rank_;
  const int size_;
  std::unique_ptr<Communicator> cpu_comm_;
  const Topology topology_;  // a copy: readable after Stop freed the communicators
  std::unique_ptr<Communicator> cuda_comm_;  // created by the first CUDA response
  int cuda_ordinal_ = -1;
  std::unique_ptr<Finalizer> finalizer_;  // with cuda_comm_
  std::atomic<std::thread::id> finalizer_thread_{};

  TensorQueue queue_;
  std::atomic<bool> abort_{false};  // polled by every negotiation wait
  std::mutex abort_mu_;              // guards the two below and the communicators' lifetime for Abort
  Status abort_status_;              // why Abort was called (OK if it was not)
  bool comms_freed_ = false;
  std::atomic<Communicator*> cuda_comm_for_abort_{nullptr};
  std::atomic<bool> loop_exited_{false};
  std::mutex exit_mu_;
  std::condition_variable exit_cv_;
  bool mpi_broken_ = false;  // a negotiation request never completed: leave comm_ alone
  bool stopped_ = false;

  // Memory that the cycle's non-blocking MPI operations read or write. An
  // operation abandoned after a timeout or an abort may still complete later,
  // so once that happened this memory is never freed (Stop leaks it).
  struct CycleBuffers {
    std::vector<uint64_t> bits;  // flag word + cache bits
    int my_length = 0;
    std::vector<int> lengths, displs;
    std::vector<uint8_t> request_bytes, gathered, response_bytes;
    uint64_t response_length = 0;
  };
  std::unique_ptr<CycleBuffers> mpi_buffers_ = std::make_unique<CycleBuffers>();

  // Background-thread state.
  std::unordered_map<std::string, std::unique_ptr<Pending>> pending_;
  std::vector<std::string> order_;  // pending_ names, oldest first
  ResponseCache cache_;
  const int cache_words_;
  double report_cached_after_s_;
  StallInspector stall_;      // rank 0
  Coordinator coordinator_;   // rank 0
  std::vector<ResponseMessage> stalled_;  // rank 0: stall errors for the next round
  Timeline timeline_;         // rank 0
  uint64_t cycle_ = 0;

  // Dead-rank detection (transport/liveness.h): calls Abort() when a peer
  // dies. Null when its setup failed (the job runs without it).
  std::unique_ptr<LivenessMonitor> liveness_;

  std::thread thread_;  // last: starts after everything it uses exists
};

}  // namespace nvgroup
