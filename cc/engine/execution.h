// Execution: runs the cycle's agreed responses through a Communicator. It
// owns the communicators (the CPU one from Init, the CUDA one from Init or
// the first CUDA response), the completions (completion.h), and one runner
// per collective type; the loop hands it fusion buckets (fusion.h) of the
// cycle's work (cycle_work.h), CachedGroups hands it the buckets of a plan.
// How each type runs is described in execution.cc.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <memory>
#include <thread>
#include <vector>

#include "common/env.h"
#include "engine/abort_signal.h"
#include "engine/completion.h"
#include "engine/counters.h"
#include "engine/cycle_work.h"
#include "engine/fusion.h"
#include "engine/tensor_queue.h"
#include "engine/timeline.h"
#include "nvgroup/communicator.h"

namespace nvgroup {

class Execution {
 public:
  // `cpu` (and `cuda`, when Init created it: EngineOptions::cuda_at_init) are
  // owned from here on and registered with `abort`; `comm` (the Engine's)
  // creates the CUDA communicator when the first CUDA response needs it.
  Execution(const Knobs& knobs, MPI_Comm comm, int rank, int size, std::unique_ptr<Communicator> cpu,
            std::unique_ptr<Communicator> cuda, TensorQueue* queue, AbortSignal* abort,
            EngineCounters* counters, Timeline* timeline);

  // The fusion threshold buckets are planned with: NVGROUP_FUSION_THRESHOLD,
  // at most the CPU communicator's registered buffer.
  size_t fusion_threshold() const {
    return std::min(knobs_.fusion_threshold, cpu_comm_->registered_capacity());
  }
  // Runs `bucket` (PlanFusion's, indices into *work) and fails its requests
  // with the cause if it fails; returns the error that ends the loop, if any.
  Status RunBucket(const FusionBucket& bucket, std::vector<Work>* work);
  // An allreduce bucket over `members` (one per bucket.offsets entry), then
  // on failure what RunBucket does.
  Status RunMembers(const FusionBucket& bucket, const BucketMember* members);

  void Complete(TensorEntry* e, const Status& status) { completion_.Complete(e, status); }
  void Complete(Pending* p, const Status& status) { completion_.Complete(&p->entry, status); }
  // The Finalizer's thread (where CUDA `done` callbacks run), if started.
  std::thread::id finalizer_thread() const { return completion_.finalizer_thread(); }
  // The loop failed: every communicator's spin waits return.
  void AbortCommunicators() {
    cpu_comm_->Abort();
    if (cuda_comm_) cuda_comm_->Abort();
  }
  // Engine::Stop, after the loop exited: runs the remaining completions,
  // closes the abort signal (no Raise inside a communicator being freed) and
  // frees the communicators.
  void Stop();

 private:
  Status RunAllreduceBucket(const FusionBucket& bucket, const BucketMember* members);
  // `s` OK: OK. Else fails the entries not completed yet with the cause and
  // returns it if it ends the loop (a lost or aborted peer), else OK.
  Status FailEntries(const Status& s, TensorEntry* const* entries, size_t n);
  Status RunAllreduceAlone(const BucketMember& m);
  // The single-request runners (allgather, broadcast, reducescatter, alltoall)
  // around their communicator call: BeginSingle orders it after the input
  // was produced (a GPU-side wait on the request's ready event) and opens the
  // timeline phase; FinishSingle closes the phase and completes the request,
  // with `failure` (a NegotiatedOutput's) or after the stream.
  Status BeginSingle(Communicator* comm, const CollectiveRequest& q, const char* phase);
  void FinishSingle(Communicator* comm, Work* w, const char* phase, const Status& failure);
  // An output sized by negotiation (Note [Outputs sized by negotiation] in
  // execution.cc): where the collective writes, and the allocation's failure
  // on this rank, reported after the collective.
  struct NegotiatedOutput {
    void* data = nullptr;
    Status failure;
    std::vector<char> scratch;  // host memory a failed CPU allocation takes part with
  };
  // `bytes`: the output's size. Non-OK only for a failure that cannot take
  // part (a CUDA request).
  Status AllocateOutput(const CollectiveRequest& q, const std::vector<int64_t>& shape, size_t bytes,
                        const char* collective, NegotiatedOutput* out);
  Status RunAllgather(Work* w);
  Status RunBroadcast(Work* w);
  Status RunReducescatter(Work* w);
  Status RunAlltoall(Work* w);
  Status RunJoin(Work* w);
  StatusOr<Communicator*> GetCommunicator(const Device& device);

  const Knobs& knobs_;  // the Engine's
  MPI_Comm comm_;
  const int rank_;
  const int size_;
  AbortSignal* const abort_;
  EngineCounters* const counters_;
  Timeline* const timeline_;
  Completion completion_;
  std::unique_ptr<Communicator> cpu_comm_;
  std::unique_ptr<Communicator> cuda_comm_;  // created by the first CUDA response
  int cuda_ordinal_ = -1;
  std::vector<BucketMember> bucket_members_;  // RunBucket's members of an allreduce bucket
  struct BucketScratch {                      // RunAllreduceBucket's lists, reused across buckets
    std::vector<Communicator::FusedMember> members;
    std::vector<TensorEntry*> done;
    std::vector<void*> events;
  };
  BucketScratch bucket_scratch_;
};

}  // namespace nvgroup
