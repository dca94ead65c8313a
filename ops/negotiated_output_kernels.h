// Kernels of the collectives whose output the engine produces after
// negotiation (reducescatter, grouped reducescatter, alltoall, grouped
// allgather: the output shape; join: the last rank to join), on the same
// pattern as adapter.h: validate what only this rank can see, build engine
// requests, hand the engine a callback that allocates the output once
// negotiation fixed its shape, Submit(). Every op carries "tensor_name" (the
// engine name, set by nvgroup_tf/mpi_ops.py) and "process_set_id".
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ops/adapter.h"

namespace nvgroup {
namespace tf_adapter {

// The allocate-output callback for output `index` of `context` (alive until
// done(): AsyncOpKernel contract; the engine calls it before `done`).
inline AllocateOutputFn AllocatorForOutput(tf::OpKernelContext* context, int index) {
  return [context, index](const std::vector<int64_t>& shape, void** out) -> Status {
    tf::TensorShape tf_shape;
    absl::Status built = tf::TensorShape::BuildTensorShape(shape, &tf_shape);
    if (!built.ok()) return FromTfStatus(built);
    tf::Tensor* output = nullptr;
    absl::Status allocated = context->allocate_output(index, tf_shape, &output);
    if (!allocated.ok()) return FromTfStatus(allocated);
    *out = const_cast<char*>(output->tensor_data().data());
    return Status::Ok();
  };
}

// Input `index` as a request of `type` whose output the engine allocates.
inline absl::Status MakeAllocatedRequest(tf::OpKernelContext* context, int index, CollectiveType type,
                                         const std::string& name, int process_set_id,
                                         CollectiveRequest* request) {
  const tf::Tensor& input = context->input(index);
  if (input.dims() < 1)
    return absl::InvalidArgumentError(std::string(CollectiveTypeName(type)) + " of '" + name +
                                      "' needs a tensor of rank >= 1 (it splits or concatenates along the "
                                      "first dimension); got a scalar");
  TF_RETURN_IF_ERROR(ToTfStatus(ToEngineDataType(input.dtype(), &request->dtype)));
  request->name = name;
  request->type = type;
  request->shape = ToEngineShape(input.shape());
  request->input = input.tensor_data().data();
  request->allocate_output = AllocatorForOutput(context, index);
  request->process_set_id = process_set_id;
  return absl::OkStatus();
}

// N inputs -> N outputs of `type`, one request per input ("<name>[i]" when N > 1
// or the op is grouped); reducescatter attrs when `reduce`.
template <typename Traits>
class AllocatedCollectiveOp : public tf::AsyncOpKernel {
 public:
  AllocatedCollectiveOp(tf::OpKernelConstruction* context, CollectiveType type, bool grouped)
      : AsyncOpKernel(context), type_(type), grouped_(grouped) {
    if (type == CollectiveType::kReducescatter) {
      OP_REQUIRES_OK(context, attrs_.Read(context));
    } else {
      OP_REQUIRES_OK(context, context->GetAttr("tensor_name", &attrs_.tensor_name));
    }
    OP_REQUIRES_OK(context, context->GetAttr("process_set_id", &process_set_id_));
    name_ = CollectiveName(*this, attrs_.tensor_name);
  }

  void ComputeAsync(tf::OpKernelContext* context, DoneCallback done) override {
    const int n = context->num_inputs();
    std::vector<CollectiveRequest> requests(n);
    for (int i = 0; i < n; ++i) {
      const std::string name = grouped_ ? name_ + "[" + std::to_string(i) + "]" : name_;
      OP_REQUIRES_OK_ASYNC(context,
                           MakeAllocatedRequest(context, i, type_, name, process_set_id_, &requests[i]),
                           done);
      requests[i].op = attrs_.op;
      requests[i].prescale_factor = attrs_.prescale_factor;
      requests[i].postscale_factor = attrs_.postscale_factor;
    }
    Submit<Traits>(context, std::move(requests), std::move(done));
  }

 private:
  CollectiveType type_;
  bool grouped_;
  AllreduceAttrs attrs_;
  int process_set_id_ = 0;
  std::string name_;
};

template <typename Traits>
class ReducescatterOp : public AllocatedCollectiveOp<Traits> {
 public:
  explicit ReducescatterOp(tf::OpKernelConstruction* c)
      : AllocatedCollectiveOp<Traits>(c, CollectiveType::kReducescatter, false) {}
};
template <typename Traits>
class GroupedReducescatterOp : public AllocatedCollectiveOp<Traits> {
 public:
  explicit GroupedReducescatterOp(tf::OpKernelConstruction* c)
      : AllocatedCollectiveOp<Traits>(c, CollectiveType::kReducescatter, true) {}
};
template <typename Traits>
class GroupedAllgatherOp : public AllocatedCollectiveOp<Traits> {
 public:
  explicit GroupedAllgatherOp(tf::OpKernelConstruction* c)
      : AllocatedCollectiveOp<Traits>(c, CollectiveType::kAllgather, true) {}
};

// (tensor, splits: int32 host) -> (output, received_splits: int32 host).
template <typename Traits>
class AlltoallOp : public tf::AsyncOpKernel {
 public:
  explicit AlltoallOp(tf::OpKernelConstruction* context) : AsyncOpKernel(context) {
    std::string tensor_name;
    OP_REQUIRES_OK(context, context->GetAttr("tensor_name", &tensor_name));
    OP_REQUIRES_OK(context, context->GetAttr("process_set_id", &process_set_id_));
    name_ = CollectiveName(*this, tensor_name);
  }

  void ComputeAsync(tf::OpKernelContext* context, DoneCallback done) override {
    std::vector<CollectiveRequest> requests(1);
    CollectiveRequest& request = requests[0];
    OP_REQUIRES_OK_ASYNC(context,
                         MakeAllocatedRequest(context, 0, CollectiveType::kAlltoall, name_, process_set_id_,
                                              &request),
                         done);
    const tf::Tensor& splits = context->input(1);
    OP_REQUIRES_ASYNC(context, splits.dims() == 1,
                      absl::InvalidArgumentError("alltoall of '" + name_ + "': splits must be a vector"),
                      done);
    auto flat = splits.flat<int32_t>();
    for (int64_t i = 0; i < flat.size(); ++i) request.splits.push_back(flat(i));
    // Received rows: written by the engine before it allocates output 0, then
    // copied into output 1 by the same callback.
    auto received = std::make_shared<std::vector<int64_t>>();
    request.received_splits = received.get();
    AllocateOutputFn data_output = AllocatorForOutput(context, 0);
    request.allocate_output = [context, received, data_output](const std::vector<int64_t>& shape,
                                                               void** out) -> Status {
      tf::Tensor* recv = nullptr;
      absl::Status allocated =
          context->allocate_output(1, tf::TensorShape({static_cast<int64_t>(received->size())}), &recv);
      if (!allocated.ok()) return FromTfStatus(allocated);
      auto r = recv->flat<int32_t>();
      for (size_t i = 0; i < received->size(); ++i) r(i) = static_cast<int32_t>((*received)[i]);
      return data_output(shape, out);
    };
    Submit<Traits>(context, std::move(requests), std::move(done));
  }

 private:
  int process_set_id_ = 0;
  std::string name_;
};

// () -> last rank to join (int32 scalar). CPU only: it carries no data.
class JoinOp : public tf::AsyncOpKernel {
 public:
  explicit JoinOp(tf::OpKernelConstruction* context) : AsyncOpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("process_set_id", &process_set_id_));
  }

  void ComputeAsync(tf::OpKernelContext* context, DoneCallback done) override {
    tf::Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(context, context->allocate_output(0, tf::TensorShape({}), &output), done);
    std::vector<CollectiveRequest> requests(1);
    requests[0].type = CollectiveType::kJoin;
    requests[0].output = const_cast<char*>(output->tensor_data().data());
    requests[0].process_set_id = process_set_id_;
    Submit<CpuJoinTraits>(context, std::move(requests), std::move(done));
  }

 private:
  using CpuJoinTraits = CpuTraits;  // ops/adapter.h
  int process_set_id_ = 0;
};

}  // namespace tf_adapter
}  // namespace nvgroup
