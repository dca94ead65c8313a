// The tf2xla kernels of the Nvgroup* ops (every XLA device: XLA_CPU_JIT,
// XLA_GPU_JIT): each op lowers to one custom call or a start/done pair
// (xla_ops.h), ordered per XLA computation; and the entry point that makes TF
// register them.
#include "ops/xla_ops.h"

#include <algorithm>
#include <cinttypes>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <string>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/env.h"
#include "ops/adapter.h"
#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/layout_util.h"
#include "xla/shape_util.h"

namespace nvgroup {
namespace xla_adapter {

namespace tf = ::tensorflow;

StatusOr<bool> LowerToStartDone(bool for_gpu) {
  static const StatusOr<int> setting = []() -> StatusOr<int> {
    Knobs knobs;
    Status parsed = ParseSettingFromEnvironment("NVGROUP_XLA_START_DONE", &knobs);
    if (!parsed.ok()) return parsed;
    return knobs.xla_start_done;
  }();
  if (!setting.ok()) return setting.status();
  return setting.value() == 1 || (setting.value() < 0 && for_gpu);
}

// ---------------------------------------------------------------------------
// Lowering: tf2xla kernels.

namespace {

using tf::XlaOpKernel;
using tf::XlaOpKernelContext;

absl::Status StaticShapeWithLayout(XlaOpKernelContext* ctx, int index, const std::string& name,
                                   ::xla::Shape* shape) {
  TF_ASSIGN_OR_RETURN(*shape, ctx->InputXlaShape(index));
  if (!shape->is_static())
    return absl::InvalidArgumentError("nvgroup collective '" + name +
                                      "' under XLA needs static shapes; input " + std::to_string(index) +
                                      " is " + shape->ToString());
  ::xla::LayoutUtil::SetToDefaultLayout(shape);  // row-major: what the engine's buffers are
  return absl::OkStatus();
}

// NVGROUP_XLA_ASYNC (the settings table, cc/common/env.h; parsed once per
// process): 1 lowers to the asynchronous host handler, unset or 0 to the
// synchronous one; a malformed value fails the compilation naming it.
absl::Status XlaTarget(const char** target) {
  static const StatusOr<bool> async = []() -> StatusOr<bool> {
    Knobs knobs;
    Status parsed = ParseSettingFromEnvironment("NVGROUP_XLA_ASYNC", &knobs);
    if (!parsed.ok()) return parsed;
    return knobs.xla_async;
  }();
  if (!async.ok()) return tf_adapter::ToTfStatus(async.status());
  *target = async.value() ? kXlaAsyncTarget : kXlaTarget;
  return absl::OkStatus();
}

// The order token every call and start returns as its last result (xla_ops.h,
// "Order"): u8[kOrderTokenElements], never written or read.
::xla::Shape OrderTokenShape() {
  ::xla::Shape token = ::xla::ShapeUtil::MakeShape(::xla::U8, {kOrderTokenElements});
  ::xla::LayoutUtil::SetToDefaultLayout(&token);
  return token;
}

// The order of the collective calls of one XLA computation (xla_ops.h,
// "Order"): per XlaBuilder, the last collective call's order token. Builders live
// only while TF compiles one function and may be built on several threads at
// once; an entry whose builder was destroyed is never used again, because an
// op is taken only while it still belongs to the builder at that address and
// the builder knows its shape (a new builder reusing the address fails that
// check or, at worst, hands an earlier op of its own, which orders nothing
// wrongly: the chain between its own collectives is what counts).
class CollectiveOrder {
 public:
  // The operand that puts the next collective call of `builder` after its
  // previous one: that call's order token, or for the first one an empty u8[0].
  static ::xla::XlaOp Previous(::xla::XlaBuilder* builder) {
    {
      std::lock_guard<std::mutex> lock(mu());
      auto it = last().find(builder);
      if (it != last().end() && it->second.builder() == builder && builder->GetShape(it->second).ok())
        return it->second;
    }
    return ::xla::ConstantR1<uint8_t>(builder, {});
  }
  static void Record(::xla::XlaBuilder* builder, ::xla::XlaOp op) {
    std::lock_guard<std::mutex> lock(mu());
    last()[builder] = op;
  }

 private:
  static std::mutex& mu() {
    static std::mutex* m = new std::mutex();  // never destroyed: compilations may run until exit
    return *m;
  }
  static std::unordered_map<::xla::XlaBuilder*, ::xla::XlaOp>& last() {
    static auto* map = new std::unordered_map<::xla::XlaBuilder*, ::xla::XlaOp>();
    return *map;
  }
};

// The operands every call or start takes: the op's inputs, then the ordering
// operand (CollectiveOrder), with their row-major shapes appended to `shapes`
// (which holds the inputs' shapes). False (the kernel's status set) on failure.
bool OrderedOperands(XlaOpKernelContext* ctx, std::vector<::xla::XlaOp>* operands,
                     std::vector<::xla::Shape>* shapes) {
  ::xla::XlaBuilder* builder = ctx->builder();
  operands->clear();
  for (size_t i = 0; i < shapes->size(); ++i) operands->push_back(ctx->Input(static_cast<int>(i)));
  const ::xla::XlaOp previous = CollectiveOrder::Previous(builder);
  absl::StatusOr<::xla::Shape> previous_shape = builder->GetShape(previous);
  if (!previous_shape.ok()) {
    ctx->SetStatus(previous_shape.status());
    return false;
  }
  ::xla::LayoutUtil::SetToDefaultLayout(&previous_shape.value());
  operands->push_back(previous);
  shapes->push_back(*previous_shape);
  return true;
}

// The pair (Note [Start and done], xla_ops.h): a start taking the inputs and
// the ordering operand, returning (results..., token); a done taking the
// start's results, the inputs and the done-after operands (inputs
// [in_shapes.size(), ctx->num_inputs())), returning the results in the start's
// buffers. The next collective of the computation is ordered after the start.
std::vector<::xla::XlaOp> EmitStartDone(XlaOpKernelContext* ctx, const CallAttributes& attributes,
                                        std::vector<::xla::Shape> in_shapes,
                                        const std::vector<::xla::Shape>& out_shapes, bool tuple) {
  ::xla::XlaBuilder* builder = ctx->builder();
  const size_t n = out_shapes.size();
  std::vector<::xla::XlaOp> start_operands;
  std::vector<::xla::Shape> start_operand_shapes = in_shapes;
  if (!OrderedOperands(ctx, &start_operands, &start_operand_shapes)) return {};
  const std::vector<::xla::XlaOp> inputs(start_operands.begin(), start_operands.end() - 1);
  std::vector<::xla::Shape> start_results = out_shapes;
  start_results.push_back(OrderTokenShape());
  const std::string config = XlaAttributes(attributes);
  ::xla::XlaOp start = ::xla::CustomCallWithLayout(builder, kXlaStartTarget, start_operands,
                                                   ::xla::ShapeUtil::MakeTupleShape(start_results),
                                                   start_operand_shapes, config, /*has_side_effect=*/true,
                                                   /*output_operand_aliasing=*/{},
                                                   /*literal=*/nullptr,
                                                   ::xla::CustomCallSchedule::SCHEDULE_EARLIEST,
                                                   ::xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
  std::vector<::xla::XlaOp> done_operands;
  for (size_t i = 0; i < n; ++i)
    done_operands.push_back(::xla::GetTupleElement(start, static_cast<int64_t>(i)));
  for (const ::xla::XlaOp& in : inputs) done_operands.push_back(in);
  std::vector<::xla::Shape> done_operand_shapes = out_shapes;
  for (const ::xla::Shape& shape : in_shapes) done_operand_shapes.push_back(shape);
  for (int i = static_cast<int>(in_shapes.size()); i < ctx->num_inputs(); ++i) {  // done after
    absl::StatusOr<::xla::Shape> shape = builder->GetShape(ctx->Input(i));
    if (!shape.ok()) {
      ctx->SetStatus(shape.status());
      return {};
    }
    ::xla::LayoutUtil::SetToDefaultLayout(&shape.value());
    done_operands.push_back(ctx->Input(i));
    done_operand_shapes.push_back(*shape);
  }
  std::vector<std::pair<::xla::ShapeIndex, std::pair<int64_t, ::xla::ShapeIndex>>> aliasing;
  for (size_t i = 0; i < n; ++i)
    aliasing.push_back({tuple ? ::xla::ShapeIndex{static_cast<int64_t>(i)} : ::xla::ShapeIndex{},
                        {static_cast<int64_t>(i), ::xla::ShapeIndex{}}});
  const ::xla::Shape done_result = tuple ? ::xla::ShapeUtil::MakeTupleShape(out_shapes) : out_shapes[0];
  ::xla::XlaOp done = ::xla::CustomCallWithLayout(builder, kXlaDoneTarget, done_operands, done_result,
                                                  done_operand_shapes, config,
                                                  /*has_side_effect=*/true, aliasing, /*literal=*/nullptr,
                                                  ::xla::CustomCallSchedule::SCHEDULE_LATEST,
                                                  ::xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
  std::vector<::xla::XlaOp> outputs;
  if (!tuple) {
    outputs.push_back(done);
  } else {
    for (size_t i = 0; i < n; ++i) outputs.push_back(::xla::GetTupleElement(done, static_cast<int64_t>(i)));
  }
  CollectiveOrder::Record(builder, ::xla::GetTupleElement(start, static_cast<int64_t>(n)));
  return outputs;
}

// One custom call: inputs [0, in_shapes.size()) and the ordering operand
// (CollectiveOrder; the handlers skip it) -> (results..., order token),
// row-major layouts (`tuple` matters only to the pair's done). Done-after inputs are not operands of the single call:
// they would hold its start back.
std::vector<::xla::XlaOp> EmitCall(XlaOpKernelContext* ctx, const CallAttributes& attributes,
                                   std::vector<::xla::Shape> in_shapes,
                                   const std::vector<::xla::Shape>& out_shapes, bool tuple) {
  // The compilation device: XLA_GPU_JIT for a program compiled for a GPU.
  StatusOr<bool> pair = LowerToStartDone(ctx->op_kernel_context()->device()->device_type() ==
                                         tf::DEVICE_GPU_XLA_JIT);
  if (!pair.ok()) {
    ctx->SetStatus(tf_adapter::ToTfStatus(pair.status()));
    return {};
  }
  if (pair.value()) return EmitStartDone(ctx, attributes, std::move(in_shapes), out_shapes, tuple);
  const char* target = kXlaTarget;
  absl::Status chosen = XlaTarget(&target);
  if (!chosen.ok()) {
    ctx->SetStatus(chosen);
    return {};
  }
  ::xla::XlaBuilder* builder = ctx->builder();
  std::vector<::xla::XlaOp> operands;
  if (!OrderedOperands(ctx, &operands, &in_shapes)) return {};
  // (results..., order token): a tuple even for one result, so the token is an
  // element of its own (xla_ops.h, "Order").
  std::vector<::xla::Shape> results = out_shapes;
  results.push_back(OrderTokenShape());
  ::xla::XlaOp call = ::xla::CustomCallWithLayout(builder, target, operands,
                                                  ::xla::ShapeUtil::MakeTupleShape(results), in_shapes,
                                                  XlaAttributes(attributes),
                                                  /*has_side_effect=*/true, /*output_operand_aliasing=*/{},
                                                  /*literal=*/nullptr,
                                                  ::xla::CustomCallSchedule::SCHEDULE_NONE,
                                                  ::xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
  std::vector<::xla::XlaOp> outputs;
  for (size_t i = 0; i < out_shapes.size(); ++i)
    outputs.push_back(::xla::GetTupleElement(call, static_cast<int64_t>(i)));
  CollectiveOrder::Record(builder, ::xla::GetTupleElement(call, static_cast<int64_t>(out_shapes.size())));
  return outputs;
}

// This rank's place in the collective's process set (compile time).
Status PlaceInSet(const CallAttributes& a, int* rank, int* size) {
  StatusOr<int> r = ProcessSetRank(a.process_set_id);
  if (!r.ok())
    return r.status().WithContext("compiling " + std::string(CollectiveTypeName(a.type)) + " '" + a.name +
                                  "' for XLA");
  StatusOr<int> n = ProcessSetSize(a.process_set_id);
  if (!n.ok()) return n.status();
  if (r.value() < 0) {
    StatusOr<int> me = Rank();
    return Status::InvalidArgument("rank " + std::to_string(me.ok() ? me.value() : -1) +
                                   " is not a member of process set " + std::to_string(a.process_set_id) +
                                   "; '" + a.name + "' can only run on its members");
  }
  *rank = r.value();
  *size = n.value();
  return Status::Ok();
}

// The compile-time collectives (xla_ops.h, "Static shapes"): every set
// member's `mine` (one length on every rank), concatenated in set-rank order.
Status GatherAtCompileTime(const CallAttributes& a, const std::string& name, std::vector<int64_t> mine,
                           std::vector<int64_t>* all) {
  int rank = 0, size = 0;
  NVG_RETURN_IF_ERROR(PlaceInSet(a, &rank, &size));
  all->assign(mine.size() * static_cast<size_t>(size), 0);
  std::vector<CollectiveRequest> requests(1);
  CollectiveRequest& q = requests[0];
  q.name = name;
  q.type = CollectiveType::kAllgather;
  q.dtype = DataType::kInt64;
  q.shape = {static_cast<int64_t>(mine.size())};
  q.input = mine.data();
  q.process_set_id = a.process_set_id;
  q.allocate_output = [all](const std::vector<int64_t>& shape, void** out) {
    if (shape.size() != 1 || shape[0] != static_cast<int64_t>(all->size()))
      return Status::Internal("the compile-time allgather returned shape " + ShapeToString(shape));
    *out = all->data();
    return Status::Ok();
  };
  Status status = EnqueueAndWait(std::move(requests));
  if (!status.ok())
    return status.WithContext("compiling " + std::string(CollectiveTypeName(a.type)) + " '" + a.name +
                              "' for XLA");
  return Status::Ok();
}

// Allgather: the sum over the set of the first dimensions.
Status GatheredRows(const CallAttributes& a, const std::string& member, int64_t mine, int64_t* total) {
  std::vector<int64_t> all;
  NVG_RETURN_IF_ERROR(GatherAtCompileTime(a, member + "/xla_rows", {mine}, &all));
  *total = 0;
  for (int64_t r : all) *total += r;
  return Status::Ok();
}

// Alltoall: every member's splits are gathered, each rank checks its own (as
// the engine would at Enqueue) and sends a flag with them, so an invalid split
// fails the compilation on every rank rather than only on its own. Fills
// a->received_splits: row `rank` of the gathered splits matrix's columns.
Status AgreeOnSplits(CallAttributes* a, int64_t dim0) {
  int rank = 0, size = 0;
  NVG_RETURN_IF_ERROR(PlaceInSet(*a, &rank, &size));
  const std::string who = "alltoall of '" + a->name + "'";
  std::vector<int64_t> splits = a->splits;
  Status mine;
  if (splits.empty()) {
    if (dim0 % size != 0)
      mine = Status::InvalidArgument(who + ": alltoall without splits needs the first dimension (" +
                                     std::to_string(dim0) + ") to be divisible by the number of ranks (" +
                                     std::to_string(size) + ")");
    splits.assign(size, dim0 / size);
  } else if (static_cast<int>(splits.size()) != size) {
    mine = Status::InvalidArgument(who + ": alltoall splits has " + std::to_string(splits.size()) +
                                   " entries; it needs one per rank (" + std::to_string(size) + ")");
  } else {
    int64_t total = 0;
    for (int64_t v : splits) {
      if (v < 0 && mine.ok())
        mine = Status::InvalidArgument(who + ": alltoall splits must be >= 0, got " + ShapeToString(splits));
      total += v;
    }
    if (mine.ok() && total != dim0)
      mine = Status::InvalidArgument(who + ": alltoall splits " + ShapeToString(splits) + " sum to " +
                                     std::to_string(total) + ", not the first dimension " +
                                     std::to_string(dim0));
  }
  std::vector<int64_t> sent(1 + size, 0);  // [invalid, splits...]
  sent[0] = mine.ok() ? 0 : 1;
  if (mine.ok()) std::copy(splits.begin(), splits.end(), sent.begin() + 1);
  std::vector<int64_t> all;
  NVG_RETURN_IF_ERROR(GatherAtCompileTime(*a, a->name + "/xla_splits", sent, &all));
  if (!mine.ok()) return mine;
  a->received_splits.assign(size, 0);
  for (int k = 0; k < size; ++k) {
    const int64_t* row = all.data() + static_cast<size_t>(k) * (1 + size);
    if (row[0] != 0)
      return Status::InvalidArgument(who + " under XLA: the splits of rank " + std::to_string(k) +
                                     " of the process set are invalid (that rank's error says why)");
    a->received_splits[k] = row[1 + rank];
  }
  return Status::Ok();
}

// Every lowered op: reads the TF kernel's attrs, compiles the result shapes
// (xla_ops.h, "Static shapes") and emits one custom call.
class CollectiveXlaOp : public XlaOpKernel {
 public:
  CollectiveXlaOp(tf::OpKernelConstruction* context, CollectiveType type) : XlaOpKernel(context) {
    attributes_.type = type;
    attributes_.grouped = type_string().find("Grouped") != std::string::npos;
    std::string tensor_name;
    int process_set_id = 0;
    if (type == CollectiveType::kAllreduce || type == CollectiveType::kReducescatter) {
      tf_adapter::AllreduceAttrs attrs;
      OP_REQUIRES_OK(context, attrs.Read(context));
      tensor_name = attrs.tensor_name;
      process_set_id = attrs.process_set_id;
      attributes_.op = attrs.op;
      attributes_.prescale_factor = attrs.prescale_factor;
      attributes_.postscale_factor = attrs.postscale_factor;
    } else {
      OP_REQUIRES_OK(context, context->GetAttr("tensor_name", &tensor_name));
      OP_REQUIRES_OK(context, context->GetAttr("process_set_id", &process_set_id));
    }
    if (type == CollectiveType::kBroadcast)
      OP_REQUIRES_OK(context, context->GetAttr("root_rank", &attributes_.root_rank));
    attributes_.process_set_id = process_set_id;
    attributes_.name = tf_adapter::CollectiveName(*this, tensor_name);
    if (context->HasAttr("Tafter")) {
      tf::DataTypeVector after;
      OP_REQUIRES_OK(context, context->GetAttr("Tafter", &after));
      done_after_ = static_cast<int>(after.size());
    }
  }

  void Compile(XlaOpKernelContext* ctx) override {
    CallAttributes attributes = attributes_;
    const bool alltoall = attributes.type == CollectiveType::kAlltoall;
    // alltoall's splits are an attribute; NvgroupXlaGroupedAllreduce's done_after inputs come last
    const int n = alltoall ? 1 : ctx->num_inputs() - done_after_;
    std::vector<::xla::Shape> in(n);
    for (int i = 0; i < n; ++i) OP_REQUIRES_OK(ctx, StaticShapeWithLayout(ctx, i, attributes.name, &in[i]));
    std::vector<::xla::Shape> out = in;
    if (alltoall) OP_REQUIRES_OK(ctx, ctx->ConstantInputAsIntVector(1, &attributes.splits));
    OP_REQUIRES_OK(ctx, tf_adapter::ToTfStatus(ResultShapes(&attributes, &out)));
    std::vector<::xla::XlaOp> outputs = EmitCall(ctx, attributes, in, out, attributes.grouped);
    for (size_t i = 0; i < outputs.size(); ++i) ctx->SetOutput(static_cast<int>(i), outputs[i]);
    if (alltoall && !outputs.empty()) {
      std::vector<int32_t> received(attributes.received_splits.begin(), attributes.received_splits.end());
      ctx->SetOutput(1, ::xla::ConstantR1<int32_t>(ctx->builder(), received));
    }
  }

 private:
  // `out` starts as the input shapes.
  Status ResultShapes(CallAttributes* a, std::vector<::xla::Shape>* out) {
    if (a->type == CollectiveType::kAllreduce || a->type == CollectiveType::kBroadcast) return Status::Ok();
    for (size_t i = 0; i < out->size(); ++i) {
      ::xla::Shape& shape = (*out)[i];
      if (shape.dimensions().size() < 1)
        return Status::InvalidArgument(
            std::string(CollectiveTypeName(a->type)) + " of '" + a->name +
            "' needs a tensor of rank >= 1 (it splits or concatenates along the first "
            "dimension); got a scalar");
      const int64_t dim0 = shape.dimensions(0);
      int64_t rows = 0;
      if (a->type == CollectiveType::kReducescatter) {
        int rank = 0, size = 0;
        NVG_RETURN_IF_ERROR(PlaceInSet(*a, &rank, &size));
        rows = ReducescatterRows(dim0, rank, size);
      } else if (a->type == CollectiveType::kAllgather) {
        const std::string member = a->grouped ? a->name + "[" + std::to_string(i) + "]" : a->name;
        NVG_RETURN_IF_ERROR(GatheredRows(*a, member, dim0, &rows));
      } else {  // alltoall
        NVG_RETURN_IF_ERROR(AgreeOnSplits(a, dim0));
        for (int64_t r : a->received_splits) rows += r;
      }
      shape.set_dimensions(0, rows);
    }
    return Status::Ok();
  }

  CallAttributes attributes_;
  int done_after_ = 0;  // trailing inputs that only order the done (NvgroupXlaGroupedAllreduce)
};

template <CollectiveType kType>
class XlaOpOf : public CollectiveXlaOp {
 public:
  explicit XlaOpOf(tf::OpKernelConstruction* context) : CollectiveXlaOp(context, kType) {}
};

REGISTER_XLA_OP(Name("NvgroupAllreduce"), XlaOpOf<CollectiveType::kAllreduce>);
REGISTER_XLA_OP(Name("NvgroupGroupedAllreduce"), XlaOpOf<CollectiveType::kAllreduce>);
REGISTER_XLA_OP(Name("NvgroupXlaGroupedAllreduce"), XlaOpOf<CollectiveType::kAllreduce>);
REGISTER_XLA_OP(Name("NvgroupAllgather"), XlaOpOf<CollectiveType::kAllgather>);
REGISTER_XLA_OP(Name("NvgroupGroupedAllgather"), XlaOpOf<CollectiveType::kAllgather>);
REGISTER_XLA_OP(Name("NvgroupBroadcast"), XlaOpOf<CollectiveType::kBroadcast>);
REGISTER_XLA_OP(Name("NvgroupReducescatter"), XlaOpOf<CollectiveType::kReducescatter>);
REGISTER_XLA_OP(Name("NvgroupGroupedReducescatter"), XlaOpOf<CollectiveType::kReducescatter>);
REGISTER_XLA_OP(Name("NvgroupAlltoall").CompileTimeConstantInput("splits"),
                XlaOpOf<CollectiveType::kAlltoall>);

}  // namespace
}  // namespace xla_adapter
}  // namespace nvgroup

// TF turns the tf2xla registrations above into kernels of the XLA compilation
// devices (XLA_CPU_JIT, XLA_GPU_JIT) once per process, at its first XLA
// compilation; registrations that arrive later are never seen. So the Python
// loader (nvgroup_tf/basics.py) calls this right after tf.load_op_library (the
// op definitions must be registered first, hence not from a static
// initializer). Returns 0, or 1 with a message when TF had already done it
// (something was XLA-compiled before nvgroup_tf's library was loaded).
extern "C" int nvgroup_tf_register_xla_kernels(char* msg, int msg_len) {
  ::tensorflow::XlaOpRegistry::RegisterCompilationKernels();  // no-op when TF already did it
  const std::string kernels = ::tensorflow::KernelsRegisteredForOp("NvgroupAllreduce");
  if (kernels.find("XLA_CPU_JIT") != std::string::npos) return 0;
  const std::string text =
      "nvgroup_tf: TensorFlow compiled a function with XLA before nvgroup_tf's library was loaded, "
      "so nvgroup_tf's collectives have no XLA kernels in this process: a jit_compile=True function "
      "that uses them fails with \"No registered 'Nvgroup...' OpKernel for XLA_..._JIT\". Call "
      "hvd.init() before the first XLA compilation.";
  if (msg != nullptr && msg_len > 0) {
    std::strncpy(msg, text.c_str(), static_cast<size_t>(msg_len) - 1);
    msg[msg_len - 1] = '\0';
  }
  return 1;
}
