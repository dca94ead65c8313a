// The TensorFlow adapter: AsyncOpKernels that turn one op invocation into
// engine requests (cc/include/nvgroup/engine.h) and nothing more.
//
// How it works. ComputeAsync validates what only this rank can see (dtype, rank
// of an allgather input), allocates the output (allreduce, broadcast) or hands
// the engine a callback that allocates it once the gathered shape is known
// (allgather), and submits the request(s) with Submit(). Submit() asks the
// device traits for the engine Device and a readiness signal (CPU: none; GPU: a
// cudaEvent recorded on TF's compute stream, see nvgroup_ops_gpu.cc) and
// enqueues. Every outcome reaches TF through the single ToTfStatus() below, and
// done() runs exactly once:
//   * Enqueue/EnqueueGroup rejects the request synchronously -> the engine never
//     calls back; Submit() sets the status and calls done() itself;
//   * otherwise the engine calls each request's callback exactly once (engine.h
//     contract); the last of them sets the first error, if any, and calls done().
//
// The kernels are templates on a DeviceTraits type, so CPU and GPU share one
// body; the traits provide
//   static absl::Status Prepare(OpKernelContext*, nvgroup::Device*, void** event);
//     the engine Device and the readiness event (GPU: one from a pool, recorded
//     on TF's compute stream; CPU: none)
//   static absl::Status RecordReady(OpKernelContext*, void* event);
//     records `event` again, on the engine thread, right after allgather's
//     output was allocated (below)
//   static constexpr bool kDeviceCompletion;
//   static absl::Status WaitOnCompletion(OpKernelContext*, void* completion_event);
//     GPU: TF's compute stream waits on the engine's completion event
//   static void Release(const nvgroup::Device&, void* event);  // after done
//
// GPU ordering (what each step rests on):
//   * readiness: the engine's stream waits on `event`, recorded on TF's compute
//     stream after everything TF enqueued before the op, so the engine reads
//     the inputs only once they are produced.
//   * allgather's output is allocated on the engine thread after negotiation.
//     TF's GPU allocator hands out memory as soon as its previous owner's host
//     reference is gone, relying on that owner's kernels being queued earlier
//     *on the compute stream*; kernels TF enqueued after `event` may still use
//     that memory. So the callback records `event` again after the allocation
//     (Horovod records its ready event after allocating for the same reason),
//     and the engine's wait, which follows it, covers them.
//   * completion (kDeviceCompletion): the engine records a completion event
//     after each bucket's device work and hands it over first
//     (engine.h completion_event_ready); TF's compute stream waits on it and
//     done() follows at once, so TF runs ahead without a host sync; every later use of the outputs, and every later reuse of the
//     inputs' memory, is ordered behind that wait because TF orders all of them
//     after the compute stream (its copy streams wait on it). One wait per op
//     suffices: the engine runs an op's requests in order on one stream, so the
//     event recorded for the op's last request covers the earlier ones.
//     That is NVGROUP_TF_CUDA_WAIT=stream. Every kernel TF queues on its
//     stream after the wait (the rest of backward, for a gradient) then runs
//     only after the collective. With NVGROUP_TF_CUDA_WAIT=host (the default)
//     no completion_event_ready is asked for: done() arrives on the engine's
//     finalizer thread after the host saw the bucket's event complete, so the
//     outputs are written and the inputs read before TF sees the op finish,
//     and only the kernels that use the outputs wait (Horovod's order).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "nvgroup/engine.h"
#include "nvgroup/status.h"
#include "nvgroup/types.h"
#include "ops/grouped_submissions.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace nvgroup {
namespace tf_adapter {

namespace tf = ::tensorflow;

// The one conversion from engine Status to TF's status.
absl::Status ToTfStatus(const Status& status);
// The reverse, for the allocate-output callback the engine calls.
Status FromTfStatus(const absl::Status& status);

// TF element type -> engine element type; kInvalidArgument for types the
// engine does not carry.
Status ToEngineDataType(tf::DataType tf_dtype, DataType* dtype);

std::vector<int64_t> ToEngineShape(const tf::TensorShape& shape);

// Parses the "reduce_op" attr ("sum", "average", "min", "max", "product").
absl::Status ParseReduceOp(const std::string& text, ReduceOp* op);

// Name the engine matches across ranks: the "tensor_name" attr the Python layer
// sets (deterministic, see nvgroup_tf/mpi_ops.py), else "<OpType>_<node name>".
std::string CollectiveName(const tf::OpKernel& kernel, const std::string& tensor_name_attr);

// Shared by the requests of one op invocation; finishes the op toward TF
// once: early, when the last request's completion event arrives (engine.h
// completion_event_ready) and TF's stream waits on it; otherwise (an error, or
// no event) when the last request's `done` arrives.
template <typename Traits>
class Completion {
 public:
  Completion(tf::OpKernelContext* context, tf::AsyncOpKernel::DoneCallback done, int pending,
             const Device& device, void* event)
      : context_(context),
        done_(std::move(done)),
        pending_(pending),
        device_pending_(pending),
        device_(device),
        event_(event) {}

  // completion_event_ready of one request (engine thread, before its `done`).
  // One wait per op suffices: the engine runs an op's requests in order on one
  // stream, so the event of the op's last request covers the earlier ones.
  void OnDeviceEvent(void* completion_event) {
    std::lock_guard<std::mutex> lock(mu_);
    if (--device_pending_ != 0 || !first_error_.ok() || tf_done_) return;
    absl::Status waited = Traits::WaitOnCompletion(context_, completion_event);
    if (!waited.ok()) {
      first_error_ = FromTfStatus(waited);
      return;  // reported when the last `done` arrives
    }
    FinishTf();  // no host sync: TF's stream runs on the event
  }

  // Called once per request (engine callback) or once with the whole count
  // (synchronous rejection). The first non-OK status wins.
  void Finish(const Status& status, int count = 1) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status.ok() && first_error_.ok()) first_error_ = status;
    pending_ -= count;
    if (pending_ != 0 || tf_done_) return;
    // (A device-side failure after an early finish aborts the engine, so the
    // next collectives fail naming it; this op's status is already given.)
    if (!first_error_.ok()) context_->SetStatus(ToTfStatus(first_error_));
    FinishTf();
  }

 private:
  void FinishTf() {  // mu_ held; exactly once
    tf_done_ = true;
    Traits::Release(device_, event_);  // the engine's wait on it is enqueued (captured) already
    // done_ may destroy the kernel's context (and TF may free the tensors):
    // nothing touches them afterwards.
    done_();
  }

  tf::OpKernelContext* context_;
  tf::AsyncOpKernel::DoneCallback done_;
  std::mutex mu_;  // guards everything below
  int pending_;
  int device_pending_;
  bool tf_done_ = false;
  Status first_error_;
  const Device device_;
  void* event_;
};

// CPU tensors are complete when the kernel runs and when done() is called: no
// readiness or completion signal.
struct CpuTraits {
  static constexpr bool kDeviceCompletion = false;
  static absl::Status CompletesOnStream(bool* on_stream) {
    *on_stream = false;
    return absl::OkStatus();
  }
  static absl::Status Prepare(tf::OpKernelContext*, Device* device, void** event) {
    *device = Device::Cpu();
    *event = nullptr;
    return absl::OkStatus();
  }
  static absl::Status RecordReady(tf::OpKernelContext*, void*) { return absl::OkStatus(); }
  static absl::Status WaitOnCompletion(tf::OpKernelContext*, void*) { return absl::OkStatus(); }
  static void Release(const Device&, void*) {}
};

// Event-pool counters of the GPU kernels (c_api.cc exports them for tests);
// zeros without GOOGLE_CUDA.
struct GpuEventStats {
  int64_t created = 0;  // cudaEventCreate calls, ever
  int64_t recorded = 0;  // readiness records, ever
};
GpuEventStats GetGpuEventStats();

// What every submission of one op invocation takes from the device traits.
struct Prepared {
  Device device;
  void* event = nullptr;  // the readiness event (GPU), recorded on TF's stream
  bool on_stream = false;  // NVGROUP_TF_CUDA_WAIT (header comment, completion)
};

template <typename Traits>
absl::Status PrepareSubmission(tf::OpKernelContext* context, Prepared* prepared) {
  TF_RETURN_IF_ERROR(Traits::CompletesOnStream(&prepared->on_stream));
  return Traits::Prepare(context, &prepared->device, &prepared->event);
}

// Fills device/ready_event/done of every request and enqueues them (one request:
// Enqueue; several: EnqueueGroup, so they are negotiated and fused as a unit).
template <typename Traits>
void SubmitPrepared(tf::OpKernelContext* context, std::vector<CollectiveRequest> requests,
                    tf::AsyncOpKernel::DoneCallback done, const Prepared& prepared) {
  const Device device = prepared.device;
  void* const event = prepared.event;
  const bool on_stream = prepared.on_stream;
  auto completion = std::make_shared<Completion<Traits>>(context, std::move(done),
                                                         static_cast<int>(requests.size()), device, event);
  for (CollectiveRequest& request : requests) {
    request.device = device;
    request.ready_event = event;
    request.done = [completion](const Status& status) { completion->Finish(status); };
    if (Traits::kDeviceCompletion && on_stream)
      request.completion_event_ready = [completion](void* e) { completion->OnDeviceEvent(e); };
    if (request.allocate_output) {  // readiness after the allocation (header comment)
      request.allocate_output = [allocate = std::move(request.allocate_output), context,
                                 event](const std::vector<int64_t>& shape, void** out) -> Status {
        Status allocated = allocate(shape, out);
        if (!allocated.ok()) return allocated;
        return FromTfStatus(Traits::RecordReady(context, event));
      };
    }
  }
  const int count = static_cast<int>(requests.size());
  Status status = count == 1 ? Enqueue(std::move(requests[0])) : EnqueueGroup(std::move(requests));
  // Rejected: the engine dropped the callbacks without calling them.
  if (!status.ok()) completion->Finish(status, count);
}

template <typename Traits>
void Submit(tf::OpKernelContext* context, std::vector<CollectiveRequest> requests,
            tf::AsyncOpKernel::DoneCallback done) {
  Prepared prepared;
  absl::Status status = PrepareSubmission<Traits>(context, &prepared);
  if (!status.ok()) {
    context->SetStatus(status);
    done();
    return;
  }
  SubmitPrepared<Traits>(context, std::move(requests), std::move(done), prepared);
}

// One launch of registered group `group` with the step's pointers, finishing
// the op like SubmitPrepared (one `done`, one completion event per launch).
template <typename Traits>
void LaunchPrepared(tf::OpKernelContext* context, uint64_t group, const std::vector<const void*>& inputs,
                    const std::vector<void*>& outputs, tf::AsyncOpKernel::DoneCallback done,
                    const Prepared& prepared) {
  auto completion = std::make_shared<Completion<Traits>>(context, std::move(done), 1, prepared.device,
                                                         prepared.event);
  GroupLaunch launch;
  launch.inputs = inputs.data();
  launch.outputs = outputs.data();
  launch.count = inputs.size();
  launch.ready_event = prepared.event;
  launch.done = [completion](const Status& status) { completion->Finish(status); };
  if (Traits::kDeviceCompletion && prepared.on_stream)
    launch.completion_event_ready = [completion](void* e) { completion->OnDeviceEvent(e); };
  Status status = EnqueueRegisteredGroup(group, std::move(launch));
  if (!status.ok()) completion->Finish(status);  // rejected: no callback will come
}

// Attributes every allreduce kernel reads.
struct AllreduceAttrs {
  ReduceOp op = ReduceOp::kSum;
  double prescale_factor = 1.0;
  double postscale_factor = 1.0;
  std::string tensor_name;
  int process_set_id = 0;

  absl::Status Read(tf::OpKernelConstruction* context) {
    std::string op_text;
    float prescale = 1.0f, postscale = 1.0f;
    TF_RETURN_IF_ERROR(context->GetAttr("reduce_op", &op_text));
    TF_RETURN_IF_ERROR(ParseReduceOp(op_text, &op));
    TF_RETURN_IF_ERROR(context->GetAttr("prescale_factor", &prescale));
    TF_RETURN_IF_ERROR(context->GetAttr("postscale_factor", &postscale));
    TF_RETURN_IF_ERROR(context->GetAttr("tensor_name", &tensor_name));
    TF_RETURN_IF_ERROR(context->GetAttr("process_set_id", &process_set_id));
    prescale_factor = prescale;
    postscale_factor = postscale;
    return absl::OkStatus();
  }
};

// Builds the allreduce request for input `index`, output `index`.
absl::Status MakeAllreduceRequest(tf::OpKernelContext* context, int index, const std::string& name,
                                  const AllreduceAttrs& attrs, CollectiveRequest* request);
// The same for an input whose output exists already.
absl::Status FillAllreduceRequest(const tf::Tensor& input, void* output, const std::string& name,
                                  const AllreduceAttrs& attrs, CollectiveRequest* request);


template <typename Traits>
class AllreduceOp : public tf::AsyncOpKernel {
 public:
  explicit AllreduceOp(tf::OpKernelConstruction* context) : AsyncOpKernel(context) {
    OP_REQUIRES_OK(context, attrs_.Read(context));
    name_ = CollectiveName(*this, attrs_.tensor_name);
  }

  void ComputeAsync(tf::OpKernelContext* context, DoneCallback done) override {
    std::vector<CollectiveRequest> requests(1);
    OP_REQUIRES_OK_ASYNC(context, MakeAllreduceRequest(context, 0, name_, attrs_, &requests[0]), done);
    Submit<Traits>(context, std::move(requests), std::move(done));
  }

 private:
  AllreduceAttrs attrs_;
  std::string name_;
};

// N inputs -> N outputs, one grouped allreduce. Request i is named "<name>[i]".
//
// Note [Grouped kernels launch a registered group]
// A kernel object lives as long as its graph (for eager calls, as long as
// TF's kernel cache keeps it) and submits the same group at every step: the
// same names, dtypes and scales, and usually the same shapes. So it
// registers the group with the engine at its first step (RegisterGroup) and
// afterwards launches it with only the step's pointers, the readiness event
// and one done (EnqueueRegisteredGroup): no names, shapes or callbacks built
// per member (Note [Registered groups], cc/engine/registered_groups.h). A
// launch is the same collective as EnqueueGroup of the members, bit for bit
// and on the wire (engine.h), so ranks need not agree on which way a step
// goes. A step whose shapes differ registers again (the old registration is
// dropped), as does a step after the engine restarted or lost the process
// set (RegisteredGroupUsable). The old registration cannot be dropped while a
// launch of it is in flight (a call of another thread overlapping this one):
// the kernel keeps it, submits this step by name and drops it at a later
// step, as the XLA call sites do (ops/xla_handler_common.cc), so the new
// shapes register once it is gone. When registering fails, the kernel submits by
// name (EnqueueGroup) until its shapes change: a name registered by another
// kernel (a second trace of one function keeps the names) is lent to it
// while that registration has no launch in flight (Note [Registered names],
// cc/engine/tensor_queue.h), and a member the engine refuses gets the
// refusal EnqueueGroup gives. NVGROUP_TF_REGISTERED_GROUPS=0 submits by
// name always. Steps of one kernel may overlap (two calls of a function
// from two threads): the registration is guarded by mu_, and a launch while
// the previous one is in flight is refused like the same names in flight.
template <typename Traits>
class GroupedAllreduceOp : public tf::AsyncOpKernel {
 public:
  explicit GroupedAllreduceOp(tf::OpKernelConstruction* context) : AsyncOpKernel(context) {
    OP_REQUIRES_OK(context, attrs_.Read(context));
    StatusOr<bool> enabled = RegisteredGroupsEnabled();
    OP_REQUIRES_OK(context, ToTfStatus(enabled.status()));
    register_ = enabled.value();
    name_ = CollectiveName(*this, attrs_.tensor_name);
  }

  ~GroupedAllreduceOp() override {
    // nothing is in flight once TF drops the kernel
    if (group_ != 0) (void)UnregisterGroup(group_);
    if (stale_ != 0) (void)UnregisterGroup(stale_);
  }

  void ComputeAsync(tf::OpKernelContext* context, DoneCallback done) override {
    const int n = context->num_inputs();  // >= 1 (op definition)
    std::vector<const void*> inputs(n);
    std::vector<void*> outputs(n);
    for (int i = 0; i < n; ++i) {
      const tf::Tensor& input = context->input(i);
      tf::Tensor* output = nullptr;
      OP_REQUIRES_OK_ASYNC(context, context->forward_input_or_allocate_output({i}, i, input.shape(), &output),
                           done);
      inputs[i] = input.tensor_data().data();
      outputs[i] = const_cast<char*>(output->tensor_data().data());
    }
    Prepared prepared;
    OP_REQUIRES_OK_ASYNC(context, PrepareSubmission<Traits>(context, &prepared), done);
    if (register_) {
      std::lock_guard<std::mutex> lock(mu_);
      if (Registered(context, prepared.device)) {
        CountGroupedSubmission(GroupedSubmission::kLaunch);
        LaunchPrepared<Traits>(context, group_, inputs, outputs, std::move(done), prepared);
        return;
      }
    }
    CountGroupedSubmission(GroupedSubmission::kByName);
    std::vector<CollectiveRequest> requests;
    absl::Status built = Requests(context, inputs, outputs, &requests);
    if (!built.ok()) {
      Traits::Release(prepared.device, prepared.event);
      context->SetStatus(built);
      done();
      return;
    }
    SubmitPrepared<Traits>(context, std::move(requests), std::move(done), prepared);
  }

 private:
  // The members' requests for this step's tensors (device etc. filled by
  // SubmitPrepared).
  absl::Status Requests(tf::OpKernelContext* context, const std::vector<const void*>& inputs,
                        const std::vector<void*>& outputs, std::vector<CollectiveRequest>* requests) const {
    const int n = static_cast<int>(inputs.size());
    requests->resize(n);
    for (int i = 0; i < n; ++i)
      TF_RETURN_IF_ERROR(FillAllreduceRequest(context->input(i), outputs[i],
                                              name_ + "[" + std::to_string(i) + "]", attrs_,
                                              &(*requests)[i]));
    return absl::OkStatus();
  }

  // mu_ held: whether group_ is a usable registration of this step's shapes
  // on `device`, registering it when it is not and registering may succeed.
  bool Registered(tf::OpKernelContext* context, const Device& device) {
    const int n = context->num_inputs();
    bool same = static_cast<int>(shapes_.size()) == n && device == device_;
    for (int i = 0; same && i < n; ++i) same = context->input(i).shape() == shapes_[i];
    if (!same) {  // new shapes: a new registration, which may succeed where the old one failed
      if (group_ != 0) stale_ = group_;  // stale_ was 0: nothing registers while it is set
      group_ = 0;
      by_name_ = false;
      device_ = device;
      shapes_.clear();
      for (int i = 0; i < n; ++i) shapes_.push_back(context->input(i).shape());
    }
    if (stale_ != 0) {  // the registration of older shapes holds the names until it is dropped
      if (!UnregisterGroup(stale_).ok() && RegisteredGroupUsable(stale_)) return false;  // in flight
      stale_ = 0;
    }
    if (by_name_) return false;
    if (group_ != 0 && RegisteredGroupUsable(group_)) return true;
    group_ = 0;
    std::vector<CollectiveRequest> members;
    std::vector<const void*> no_inputs(n, nullptr);
    std::vector<void*> no_outputs(n, nullptr);
    if (!Requests(context, no_inputs, no_outputs, &members).ok()) {
      by_name_ = true;  // EnqueueGroup reports what is wrong
      return false;
    }
    for (CollectiveRequest& m : members) m.device = device;
    StatusOr<uint64_t> registered = RegisterGroup(std::move(members));
    if (!registered.ok()) {
      by_name_ = true;
      return false;
    }
    CountGroupedSubmission(GroupedSubmission::kRegistration);
    group_ = registered.value();
    return true;
  }

  AllreduceAttrs attrs_;
  std::string name_;
  bool register_ = true;  // NVGROUP_TF_REGISTERED_GROUPS
  std::mutex mu_;  // guards the five below
  uint64_t group_ = 0;  // the registration of shapes_ on device_ (0: none)
  uint64_t stale_ = 0;  // a registration of older shapes not dropped yet (its launch was in flight)
  std::vector<tf::TensorShape> shapes_;
  Device device_;
  bool by_name_ = false;  // registering shapes_ failed: submit by name until they change
};

template <typename Traits>
class AllgatherOp : public tf::AsyncOpKernel {
 public:
  explicit AllgatherOp(tf::OpKernelConstruction* context) : AsyncOpKernel(context) {
    std::string tensor_name;
    OP_REQUIRES_OK(context, context->GetAttr("tensor_name", &tensor_name));
    OP_REQUIRES_OK(context, context->GetAttr("process_set_id", &process_set_id_));
    name_ = CollectiveName(*this, tensor_name);
  }

  void ComputeAsync(tf::OpKernelContext* context, DoneCallback done) override {
    const tf::Tensor& input = context->input(0);
    OP_REQUIRES_ASYNC(context, input.dims() >= 1,
                      absl::InvalidArgumentError("allgather of '" + name_ +
                                                 "' needs a tensor of rank >= 1 (it "
                                                 "concatenates along the first dimension); got a scalar"),
                      done);
    std::vector<CollectiveRequest> requests(1);
    CollectiveRequest& request = requests[0];
    Status dtype_status = ToEngineDataType(input.dtype(), &request.dtype);
    OP_REQUIRES_OK_ASYNC(context, ToTfStatus(dtype_status), done);
    request.name = name_;
    request.type = CollectiveType::kAllgather;
    request.process_set_id = process_set_id_;
    request.shape = ToEngineShape(input.shape());
    request.input = input.tensor_data().data();
    // Runs on an engine thread after negotiation, before `done`: the context is
    // alive until done() (AsyncOpKernel contract).
    request.allocate_output = [context](const std::vector<int64_t>& shape, void** out) -> Status {
      tf::TensorShape tf_shape;
      absl::Status built = tf::TensorShape::BuildTensorShape(shape, &tf_shape);
      if (!built.ok()) return FromTfStatus(built);
      tf::Tensor* output = nullptr;
      absl::Status allocated = context->allocate_output(0, tf_shape, &output);
      if (!allocated.ok()) return FromTfStatus(allocated);
      *out = const_cast<char*>(output->tensor_data().data());
      return Status::Ok();
    };
    Submit<Traits>(context, std::move(requests), std::move(done));
  }

 private:
  int process_set_id_ = 0;
  std::string name_;
};

template <typename Traits>
class BroadcastOp : public tf::AsyncOpKernel {
 public:
  explicit BroadcastOp(tf::OpKernelConstruction* context) : AsyncOpKernel(context) {
    std::string tensor_name;
    OP_REQUIRES_OK(context, context->GetAttr("tensor_name", &tensor_name));
    OP_REQUIRES_OK(context, context->GetAttr("root_rank", &root_rank_));
    OP_REQUIRES_OK(context, context->GetAttr("process_set_id", &process_set_id_));
    name_ = CollectiveName(*this, tensor_name);
  }

  void ComputeAsync(tf::OpKernelContext* context, DoneCallback done) override {
    const tf::Tensor& input = context->input(0);
    tf::Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(context, context->forward_input_or_allocate_output({0}, 0, input.shape(), &output),
                         done);
    std::vector<CollectiveRequest> requests(1);
    CollectiveRequest& request = requests[0];
    OP_REQUIRES_OK_ASYNC(context, ToTfStatus(ToEngineDataType(input.dtype(), &request.dtype)), done);
    request.name = name_;
    request.type = CollectiveType::kBroadcast;
    request.shape = ToEngineShape(input.shape());
    request.input = input.tensor_data().data();
    request.output = const_cast<char*>(output->tensor_data().data());
    request.root_rank = root_rank_;
    request.process_set_id = process_set_id_;
    Submit<Traits>(context, std::move(requests), std::move(done));
  }

 private:
  int process_set_id_ = 0;
  int root_rank_ = 0;
  std::string name_;
};

}  // namespace tf_adapter
}  // namespace nvgroup
