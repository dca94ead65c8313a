// Op definitions (attrs, shape functions) and their CPU kernels.
//
// Every op carries a "tensor_name" attr: the name the engine matches across
// ranks. The Python layer always sets it, deterministically (see the naming
// note in nvgroup_tf/mpi_ops.py); left empty, the kernel falls back to
// "<OpType>_<node name>".
//
// The ops are stateful (SetIsStateful): never pruned when this rank does not
// use a result, never constant-folded, never merged by CSE. Inside
// tf.function the Python layer marks each one to run independently of TF's
// automatic control dependencies, so independent collectives are not chained
// in program order (Note [Stateful ops] in nvgroup_tf/mpi_ops.py). The GPU
// kernels of the same ops live in nvgroup_ops_gpu.cc (built only with
// GOOGLE_CUDA).
#include "ops/adapter.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/common_shape_fns.h"

namespace nvgroup {
namespace tf_adapter {
namespace {

using tf::shape_inference::InferenceContext;
using tf::shape_inference::ShapeHandle;

absl::Status AllgatherShape(InferenceContext* c) {
  ShapeHandle input, output;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &input));
  TF_RETURN_IF_ERROR(c->ReplaceDim(input, 0, c->UnknownDim(), &output));
  c->set_output(0, output);
  return absl::OkStatus();
}

absl::Status GroupedShape(InferenceContext* c) {
  for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->input(i));
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("NvgroupAllreduce")
    .Attr("T: {half, bfloat16, float, double, int32, int64, uint8, int8, uint16, int16}")
    .Attr("reduce_op: {'sum', 'average', 'min', 'max', 'product'} = 'sum'")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Output("reduced: T")
    .SetIsStateful()
    .SetShapeFn(tf::shape_inference::UnchangedShape)
    .Doc(R"doc(
Allreduce of `tensor` over all ranks (op reduce_op, input multiplied by
prescale_factor before and the result by postscale_factor after the reduction).
Ranks are matched by tensor_name.
)doc");

REGISTER_OP("NvgroupGroupedAllreduce")
    .Attr("T: list({half, bfloat16, float, double, int32, int64, uint8, int8, uint16, int16}) >= 1")
    .Attr("reduce_op: {'sum', 'average', 'min', 'max', 'product'} = 'sum'")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensors: T")
    .Output("reduced: T")
    .SetIsStateful()
    .SetShapeFn(GroupedShape)
    .Doc(R"doc(
Allreduce of every tensor in `tensors`, negotiated and fused as one unit;
tensor i is matched across ranks as "<tensor_name>[i]".
)doc");

// The gradient path's grouped allreduce inside XLA programs (no TF kernel: it
// exists only to be lowered, ops/xla_ops.h Note [Start and done], "Done
// after"). The `done_after` tensors are operands of the done only, so XLA
// cannot take the results before they exist: nvgroup_tf/gradient_reducer.py
// passes every other bucket's gradients, which puts each bucket's done after
// the end of backprop and leaves the rest of backprop between start and done.
REGISTER_OP("NvgroupXlaGroupedAllreduce")
    .Attr("T: list({half, bfloat16, float, double, int32, int64, uint8, int8, uint16, int16}) >= 1")
    .Attr("Tafter: list(type) >= 0")
    .Attr("reduce_op: {'sum', 'average', 'min', 'max', 'product'} = 'sum'")
    .Attr("prescale_factor: float = 1.0")
    .Attr("postscale_factor: float = 1.0")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensors: T")
    .Input("done_after: Tafter")
    .Output("reduced: T")
    .SetIsStateful()
    .SetShapeFn(GroupedShape)
    .Doc(R"doc(
NvgroupGroupedAllreduce for XLA programs: the same collective, whose results
XLA may use only once every `done_after` tensor exists. Compiled only by XLA.
)doc");

REGISTER_OP("NvgroupAllgather")
    .Attr("T: {uint8, int8, bool, half, bfloat16, float, double, int32, int64, uint16, int16}")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Output("gathered: T")
    .SetIsStateful()
    .SetShapeFn(AllgatherShape)
    .Doc(R"doc(
Concatenation of every rank's `tensor` along dimension 0 in rank order. The
first dimension may differ across ranks; the others must agree.
)doc");

REGISTER_OP("NvgroupBroadcast")
    .Attr("T: {uint8, int8, bool, half, bfloat16, float, double, int32, int64, uint16, int16}")
    .Attr("root_rank: int")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Output("broadcasted: T")
    .SetIsStateful()
    .SetShapeFn(tf::shape_inference::UnchangedShape)
    .Doc(R"doc(
`tensor` of rank root_rank, on every rank.
)doc");

REGISTER_KERNEL_BUILDER(Name("NvgroupAllreduce").Device(tf::DEVICE_CPU), AllreduceOp<CpuTraits>);
REGISTER_KERNEL_BUILDER(Name("NvgroupGroupedAllreduce").Device(tf::DEVICE_CPU),
                        GroupedAllreduceOp<CpuTraits>);
REGISTER_KERNEL_BUILDER(Name("NvgroupAllgather").Device(tf::DEVICE_CPU), AllgatherOp<CpuTraits>);
REGISTER_KERNEL_BUILDER(Name("NvgroupBroadcast").Device(tf::DEVICE_CPU), BroadcastOp<CpuTraits>);

}  // namespace tf_adapter
}  // namespace nvgroup
