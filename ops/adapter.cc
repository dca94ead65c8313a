// Conversions shared by the CPU and GPU kernels (see adapter.h).
#include "ops/adapter.h"

#include <atomic>
#include <utility>

#include "common/env.h"

namespace nvgroup {
namespace tf_adapter {

absl::Status ToTfStatus(const Status& status) {
  const std::string& m = status.message();
  switch (status.code()) {
    case StatusCode::kOk: return absl::OkStatus();
    case StatusCode::kInvalidArgument: return absl::InvalidArgumentError(m);
    case StatusCode::kFailedPrecondition: return absl::FailedPreconditionError(m);
    case StatusCode::kAborted: return absl::AbortedError(m);
    case StatusCode::kUnavailable: return absl::UnavailableError(m);
    case StatusCode::kDeadlineExceeded: return absl::DeadlineExceededError(m);
    case StatusCode::kUnimplemented: return absl::UnimplementedError(m);
    case StatusCode::kInternal: return absl::InternalError(m);
  }
  return absl::InternalError("unknown nvgroup status code " +
                             std::to_string(static_cast<int>(status.code())) + ": " + m);
}

Status FromTfStatus(const absl::Status& status) {
  if (status.ok()) return Status::Ok();
  const std::string m(status.message());
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument: return Status::InvalidArgument(m);
    case absl::StatusCode::kFailedPrecondition: return Status::FailedPrecondition(m);
    case absl::StatusCode::kUnimplemented: return Status::Unimplemented(m);
    default:  // allocation failures (kResourceExhausted) and the rest
      return Status::Internal("TensorFlow: " + status.ToString());
  }
}

Status ToEngineDataType(tf::DataType tf_dtype, DataType* dtype) {
  switch (tf_dtype) {
    case tf::DT_UINT8: *dtype = DataType::kUint8; return Status::Ok();
    case tf::DT_INT8: *dtype = DataType::kInt8; return Status::Ok();
    case tf::DT_BOOL: *dtype = DataType::kBool; return Status::Ok();
    case tf::DT_HALF: *dtype = DataType::kFloat16; return Status::Ok();
    case tf::DT_BFLOAT16: *dtype = DataType::kBFloat16; return Status::Ok();
    case tf::DT_FLOAT: *dtype = DataType::kFloat32; return Status::Ok();
    case tf::DT_DOUBLE: *dtype = DataType::kFloat64; return Status::Ok();
    case tf::DT_INT32: *dtype = DataType::kInt32; return Status::Ok();
    case tf::DT_INT64: *dtype = DataType::kInt64; return Status::Ok();
    case tf::DT_UINT16: *dtype = DataType::kUint16; return Status::Ok();
    case tf::DT_INT16: *dtype = DataType::kInt16; return Status::Ok();
    default:
      return Status::InvalidArgument(std::string("nvgroup_tf does not support tensors of type ") +
                                     tf::DataTypeString(tf_dtype));
  }
}

std::vector<int64_t> ToEngineShape(const tf::TensorShape& shape) {
  std::vector<int64_t> dims;
  dims.reserve(shape.dims());
  for (int i = 0; i < shape.dims(); ++i) dims.push_back(shape.dim_size(i));
  return dims;
}

absl::Status ParseReduceOp(const std::string& text, ReduceOp* op) {
  if (text == "sum") *op = ReduceOp::kSum;
  else if (text == "average") *op = ReduceOp::kAverage;
  else if (text == "min") *op = ReduceOp::kMin;
  else if (text == "max") *op = ReduceOp::kMax;
  else if (text == "product") *op = ReduceOp::kProduct;
  else
    return absl::InvalidArgumentError("reduce_op must be one of sum, average, min, max, product; got '" +
                                      text + "'");
  return absl::OkStatus();
}

std::string CollectiveName(const tf::OpKernel& kernel, const std::string& tensor_name_attr) {
  if (!tensor_name_attr.empty()) return tensor_name_attr;
  return kernel.type_string() + "_" + kernel.name();
}

absl::Status MakeAllreduceRequest(tf::OpKernelContext* context, int index, const std::string& name,
                                  const AllreduceAttrs& attrs, CollectiveRequest* request) {
  const tf::Tensor& input = context->input(index);
  tf::Tensor* output = nullptr;
  TF_RETURN_IF_ERROR(context->forward_input_or_allocate_output({index}, index, input.shape(), &output));
  return FillAllreduceRequest(input, const_cast<char*>(output->tensor_data().data()), name, attrs, request);
}

absl::Status FillAllreduceRequest(const tf::Tensor& input, void* output, const std::string& name,
                                  const AllreduceAttrs& attrs, CollectiveRequest* request) {
  TF_RETURN_IF_ERROR(ToTfStatus(ToEngineDataType(input.dtype(), &request->dtype)));
  request->name = name;
  request->type = CollectiveType::kAllreduce;
  request->shape = ToEngineShape(input.shape());
  request->input = input.tensor_data().data();
  request->output = output;
  request->op = attrs.op;
  request->prescale_factor = attrs.prescale_factor;
  request->postscale_factor = attrs.postscale_factor;
  request->process_set_id = attrs.process_set_id;
  return absl::OkStatus();
}

namespace {
std::atomic<int64_t> grouped_registrations{0}, grouped_launches{0}, grouped_by_name{0};
}  // namespace

GroupedSubmissionStats GetGroupedSubmissionStats() {
  GroupedSubmissionStats stats;
  stats.registrations = grouped_registrations.load(std::memory_order_relaxed);
  stats.launches = grouped_launches.load(std::memory_order_relaxed);
  stats.by_name = grouped_by_name.load(std::memory_order_relaxed);
  return stats;
}

void CountGroupedSubmission(GroupedSubmission what) {
  std::atomic<int64_t>& c = what == GroupedSubmission::kRegistration ? grouped_registrations
                            : what == GroupedSubmission::kLaunch     ? grouped_launches
                                                                     : grouped_by_name;
  c.fetch_add(1, std::memory_order_relaxed);
}

StatusOr<bool> RegisteredGroupsEnabled() {
  static const std::pair<Status, bool> parsed = [] {
    Knobs knobs;
    Status status = ParseSettingFromEnvironment("NVGROUP_TF_REGISTERED_GROUPS", &knobs);
    return std::make_pair(status, knobs.tf_registered_groups);
  }();
  if (!parsed.first.ok()) return parsed.first;
  return parsed.second;
}

#if !GOOGLE_CUDA
GpuEventStats GetGpuEventStats() { return GpuEventStats(); }  // no GPU kernels, no events
#endif

}  // namespace tf_adapter
}  // namespace nvgroup
