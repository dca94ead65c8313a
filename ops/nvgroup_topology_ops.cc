// Topology queries as TF ops (Horovod's rank_op, size_op, local_rank_op,
// local_size_op; cross_rank_op/cross_size_op complete the set; and
// process_set_included_op, this rank's membership of a process set): the value is
// read when the op runs, not when the graph is built, so a graph built before
// init() (or before a re-init) reports the engine it runs against.
//
// The ops are stateful so that grappler never constant-folds them into the
// graph, and they run on the host (a scalar; with soft placement, a GPU
// placement request lands here). Before init() they fail with
// FAILED_PRECONDITION ("call hvd.init() first"), through the adapter's one
// ToTfStatus.
#include "nvgroup/engine.h"
#include "ops/adapter.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace nvgroup {
namespace tf_adapter {
namespace {

template <StatusOr<int> (*Query)()>
class TopologyOp : public tf::OpKernel {
 public:
  explicit TopologyOp(tf::OpKernelConstruction* context) : tf::OpKernel(context) {}

  void Compute(tf::OpKernelContext* context) override {
    StatusOr<int> value = Query();
    OP_REQUIRES_OK(context, ToTfStatus(value.status()));
    tf::Tensor* output = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, tf::TensorShape({}), &output));
    output->scalar<int32_t>()() = value.value();
  }
};

// Size of a process set (0 = all ranks): Horovod's size_op(process_set_id).
class SizeOp : public tf::OpKernel {
 public:
  explicit SizeOp(tf::OpKernelConstruction* context) : tf::OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("process_set_id", &process_set_id_));
  }

  void Compute(tf::OpKernelContext* context) override {
    StatusOr<int> value = ProcessSetSize(process_set_id_);
    OP_REQUIRES_OK(context, ToTfStatus(value.status()));
    tf::Tensor* output = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, tf::TensorShape({}), &output));
    output->scalar<int32_t>()() = value.value();
  }

 private:
  int process_set_id_ = 0;
};

}  // namespace

REGISTER_OP("NvgroupSize")
    .Attr("process_set_id: int = 0")
    .Output("value: int32")
    .SetIsStateful()
    .SetShapeFn(tf::shape_inference::ScalarShape)
    .Doc("Number of ranks in the process set (0 = all), read when the op runs.");
REGISTER_KERNEL_BUILDER(Name("NvgroupSize").Device(tf::DEVICE_CPU), SizeOp);

#define NVG_TOPOLOGY_OP(OpName, Query, what)                                       \
  REGISTER_OP(OpName)                                                              \
      .Output("value: int32")                                                      \
      .SetIsStateful()                                                             \
      .SetShapeFn(tf::shape_inference::ScalarShape)                                \
      .Doc(what " of this process in the running engine, read when the op runs."); \
  REGISTER_KERNEL_BUILDER(Name(OpName).Device(tf::DEVICE_CPU), TopologyOp<Query>)

NVG_TOPOLOGY_OP("NvgroupRank", Rank, "Rank");
NVG_TOPOLOGY_OP("NvgroupLocalRank", LocalRank, "Rank on its node");
NVG_TOPOLOGY_OP("NvgroupLocalSize", LocalSize, "Number of ranks on the node");
NVG_TOPOLOGY_OP("NvgroupCrossRank", CrossRank, "Index of the node");
NVG_TOPOLOGY_OP("NvgroupCrossSize", CrossSize, "Number of nodes");
#undef NVG_TOPOLOGY_OP

// Horovod's process_set_included_op: 1 if this rank belongs to the set, 0 if
// not; -1 before init, -3 for an unknown set (Horovod's error codes
// HOROVOD_PROCESS_SET_ERROR_INIT and _UNKNOWN_SET).
class ProcessSetIncludedOp : public tf::OpKernel {
 public:
  explicit ProcessSetIncludedOp(tf::OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("process_set_id", &process_set_id_));
  }
  void Compute(tf::OpKernelContext* context) override {
    tf::Tensor* output = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, tf::TensorShape({}), &output));
    int32_t value = -1;
    if (IsInitialized()) {
      StatusOr<int> r = ProcessSetRank(process_set_id_);
      value = !r.ok() ? -3 : (r.value() >= 0 ? 1 : 0);
    }
    output->scalar<int32_t>()() = value;
  }

 private:
  int process_set_id_ = 0;
};

REGISTER_OP("NvgroupProcessSetIncluded")
    .Attr("process_set_id: int = 0")
    .Output("included: int32")
    .SetIsStateful()
    .SetShapeFn(tf::shape_inference::ScalarShape)
    .Doc(R"doc(
1 if this rank belongs to the process set, 0 if not, -1 before init, -3 for an
unknown set (Horovod's process_set_included_op).
)doc");
REGISTER_KERNEL_BUILDER(Name("NvgroupProcessSetIncluded").Device(tf::DEVICE_CPU), ProcessSetIncludedOp);

}  // namespace tf_adapter
}  // namespace nvgroup
