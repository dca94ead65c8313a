// Op definitions and CPU kernels of the collectives whose output the engine
// produces after negotiation: reducescatter, grouped reducescatter, alltoall,
// grouped allgather, join (kernels in negotiated_output_kernels.h; GPU
// registrations in nvgroup_ops_gpu.cc). Stateful like the ops of
// nvgroup_ops.cc (see the note there and Note [Stateful ops] in
// nvgroup_tf/mpi_ops.py).
#include "ops/negotiated_output_kernels.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace nvgroup {
namespace tf_adapter {
namespace {

using tf::shape_inference::InferenceContext;
using tf::shape_inference::ShapeHandle;

// CpuTraits: ops/adapter.h.

absl::Status FirstDimUnknown(InferenceContext* c) {
  for (int i = 0; i < c->num_inputs() && i < c->num_outputs(); ++i) {
    ShapeHandle input, output;
    TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(i), 1, &input));
    TF_RETURN_IF_ERROR(c->ReplaceDim(input, 0, c->UnknownDim(), &output));
    c->set_output(i, output);
  }
  return absl::OkStatus();
}

absl::Status AlltoallShape(InferenceContext* c) {
  ShapeHandle input, output, splits;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &input));
  TF_RETURN_IF_ERROR(c->ReplaceDim(input, 0, c->UnknownDim(), &output));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &splits));
  c->set_output(0, output);
  c->set_output(1, c->Vector(c->UnknownDim()));
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("NvgroupReducescatter")
    .Attr("T: {uint8, int8, uint16, int16, int32, int64, half, bfloat16, float, double}")
    .Attr("reduce_op: {'sum', 'average'} = 'sum'")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Output("reduced: T")
    .SetIsStateful()
    .SetShapeFn(FirstDimUnknown)
    .Doc(R"doc(
Reduction of `tensor` over the ranks of the process set, dimension 0 split
across them (ranks below dim0 % size get one more row, as Horovod).
)doc");

REGISTER_OP("NvgroupGroupedReducescatter")
    .Attr("T: list({uint8, int8, uint16, int16, int32, int64, half, bfloat16, float, double}) >= 1")
    .Attr("reduce_op: {'sum', 'average'} = 'sum'")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensors: T")
    .Output("reduced: T")
    .SetIsStateful()
    .SetShapeFn(FirstDimUnknown)
    .Doc(R"doc(
Reducescatter of every tensor, negotiated as one unit; tensor i is matched as
"<tensor_name>[i]".
)doc");

REGISTER_OP("NvgroupAlltoall")
    .Attr("T: {uint8, int8, uint16, int16, int32, int64, half, bfloat16, float, double, bool}")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Input("splits: int32")
    .Output("output: T")
    .Output("received_splits: int32")
    .SetIsStateful()
    .SetShapeFn(AlltoallShape)
    .Doc(R"doc(
Rows [sum(splits[:r]), sum(splits[:r+1])) of `tensor` go to rank r; the output
concatenates what every rank sent here, in rank order, and received_splits says
how many rows came from each. Empty splits: an even split of dimension 0.
)doc");

REGISTER_OP("NvgroupGroupedAllgather")
    .Attr("T: list({uint8, int8, uint16, int16, int32, int64, half, bfloat16, float, double, bool}) >= 1")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensors: T")
    .Output("gathered: T")
    .SetIsStateful()
    .SetShapeFn(FirstDimUnknown)
    .Doc(R"doc(
Allgather of every tensor, negotiated as one unit; tensor i is matched as
"<tensor_name>[i]".
)doc");

REGISTER_OP("NvgroupJoin")
    .Attr("process_set_id: int = 0")
    .Output("last_joined: int32")
    .SetIsStateful()
    .SetShapeFn(tf::shape_inference::ScalarShape)
    .Doc(R"doc(
This rank has run out of data: until every rank joined, the others'
allreduces and reducescatters complete with this rank contributing zeros.
Returns the last rank to join.
)doc");

REGISTER_KERNEL_BUILDER(Name("NvgroupReducescatter").Device(tf::DEVICE_CPU), ReducescatterOp<CpuTraits>);
REGISTER_KERNEL_BUILDER(Name("NvgroupGroupedReducescatter").Device(tf::DEVICE_CPU),
                        GroupedReducescatterOp<CpuTraits>);
REGISTER_KERNEL_BUILDER(Name("NvgroupAlltoall").Device(tf::DEVICE_CPU), AlltoallOp<CpuTraits>);
REGISTER_KERNEL_BUILDER(Name("NvgroupGroupedAllgather").Device(tf::DEVICE_CPU),
                        GroupedAllgatherOp<CpuTraits>);
REGISTER_KERNEL_BUILDER(Name("NvgroupJoin").Device(tf::DEVICE_CPU), JoinOp);

}  // namespace tf_adapter
}  // namespace nvgroup
