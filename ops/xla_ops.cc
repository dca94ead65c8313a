// tf2xla kernels of the Nvgroup* ops (every XLA device: XLA_CPU_JIT,
// XLA_GPU_JIT) and the custom-call handler for XLA's host platform. The design
// is described in xla_ops.h; the CUDA handler is in xla_ops_gpu.cc.
#include "ops/xla_ops.h"

#include <cinttypes>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "ops/adapter.h"
#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/layout_util.h"
#include "xla/shape_util.h"

// Defined in TensorFlow's library (declared in xla/ffi/ffi_api.h, which needs
// MLIR headers the wheel does not ship): the FFI API of the XLA inside it,
// whose handler registry its CPU and GPU runtimes consult.
namespace xla {
namespace ffi {
const XLA_FFI_Api* GetXlaFfiApi();
}  // namespace ffi
}  // namespace xla

namespace nvgroup {
namespace xla_adapter {

namespace tf = ::tensorflow;

// ---------------------------------------------------------------------------
// Attributes: written at lowering, read by the handlers.

namespace {

// An MLIR string literal: printable ASCII except '"' and '\' as is, every
// other byte as \XX (MLIR's hex escape), so any tensor name round-trips.
std::string MlirString(const std::string& text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char hex[4];
      std::snprintf(hex, sizeof(hex), "\\%02X", c);
      out += hex;
    }
  }
  return out + "\"";
}

// An f64 attribute as its bit pattern (MLIR's hexadecimal float literal):
// exact, whatever the value.
std::string MlirF64(double value) {
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  char text[40];
  std::snprintf(text, sizeof(text), "0x%016" PRIX64 " : f64", bits);
  return text;
}

std::string MlirI64(int64_t value) { return std::to_string(value) + " : i64"; }

}  // namespace

std::string XlaAttributes(const CallAttributes& a) {
  return "{name = " + MlirString(a.name) +
         ", type = " + MlirI64(static_cast<int64_t>(a.type)) +
         ", grouped = " + MlirI64(a.grouped ? 1 : 0) +
         ", op = " + MlirI64(static_cast<int64_t>(a.op)) +
         ", prescale = " + MlirF64(a.prescale_factor) +
         ", postscale = " + MlirF64(a.postscale_factor) +
         ", root = " + MlirI64(a.root_rank) + "}";
}

Status DecodeAttributes(std::string_view name, int64_t type, int64_t grouped, int64_t op,
                        double prescale, double postscale, int64_t root, CallAttributes* out) {
  if (type < 0 || type > static_cast<int64_t>(CollectiveType::kBroadcast))
    return Status::Internal("nvgroup XLA custom call: unknown collective type " + std::to_string(type));
  if (op < 0 || op > static_cast<int64_t>(ReduceOp::kProduct))
    return Status::Internal("nvgroup XLA custom call: unknown reduce op " + std::to_string(op));
  out->name = std::string(name);
  out->type = static_cast<CollectiveType>(type);
  out->grouped = grouped != 0;
  out->op = static_cast<ReduceOp>(op);
  out->prescale_factor = prescale;
  out->postscale_factor = postscale;
  out->root_rank = static_cast<int>(root);
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Run time: XLA buffers -> engine requests.

namespace {

Status ToEngineDataType(ffi::DataType dtype, DataType* out) {
  switch (dtype) {
    case ffi::DataType::U8: *out = DataType::kUint8; return Status::Ok();
    case ffi::DataType::S8: *out = DataType::kInt8; return Status::Ok();
    case ffi::DataType::PRED: *out = DataType::kBool; return Status::Ok();
    case ffi::DataType::F16: *out = DataType::kFloat16; return Status::Ok();
    case ffi::DataType::BF16: *out = DataType::kBFloat16; return Status::Ok();
    case ffi::DataType::F32: *out = DataType::kFloat32; return Status::Ok();
    case ffi::DataType::F64: *out = DataType::kFloat64; return Status::Ok();
    case ffi::DataType::S32: *out = DataType::kInt32; return Status::Ok();
    case ffi::DataType::S64: *out = DataType::kInt64; return Status::Ok();
    default:
      return Status::InvalidArgument("nvgroup XLA custom call: unsupported XLA element type " +
                                     std::to_string(static_cast<int>(dtype)));
  }
}

std::vector<int64_t> Dims(const ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  return std::vector<int64_t>(dims.begin(), dims.end());
}

}  // namespace

Status BuildRequests(const CallAttributes& a, ffi::RemainingArgs args, ffi::RemainingRets rets,
                     std::vector<CollectiveRequest>* requests) {
  if (args.size() != rets.size() || args.size() == 0)
    return Status::Internal("nvgroup XLA custom call '" + a.name + "': " + std::to_string(args.size()) +
                            " operands but " + std::to_string(rets.size()) + " results");
  requests->clear();
  for (size_t i = 0; i < args.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (in.has_error() || out.has_error())
      return Status::Internal("nvgroup XLA custom call '" + a.name + "': operand/result " +
                              std::to_string(i) + " is not a buffer");
    const ffi::AnyBuffer input = *in;
    const ffi::AnyBuffer output = **out;
    CollectiveRequest q;
    q.name = a.grouped ? a.name + "[" + std::to_string(i) + "]" : a.name;
    q.type = a.type;
    NVG_RETURN_IF_ERROR(ToEngineDataType(input.element_type(), &q.dtype));
    q.shape = Dims(input);
    q.input = input.untyped_data();
    q.op = a.op;
    q.prescale_factor = a.prescale_factor;
    q.postscale_factor = a.postscale_factor;
    q.root_rank = a.root_rank;
    if (a.type == CollectiveType::kAllgather) {
      // The result buffer was sized at compile time (xla_ops.h, "Allgather").
      const std::vector<int64_t> compiled = Dims(output);
      void* data = output.untyped_data();
      const std::string name = q.name;
      q.allocate_output = [compiled, data, name](const std::vector<int64_t>& shape, void** out_ptr) {
        if (shape != compiled)
          return Status::FailedPrecondition(
              "allgather of '" + name + "' under XLA: the gathered shape is " + ShapeToString(shape) +
              " but the XLA program was compiled for " + ShapeToString(compiled) +
              " (the ranks' first dimensions changed after compilation; every rank must "
              "recompile with the same shapes)");
        *out_ptr = data;
        return Status::Ok();
      };
    } else {
      q.output = output.untyped_data();
    }
    requests->push_back(std::move(q));
  }
  return Status::Ok();
}

ffi::Error ToFfiError(const Status& status) {
  switch (status.code()) {
    case StatusCode::kOk: return ffi::Error::Success();
    case StatusCode::kInvalidArgument: return ffi::Error(ffi::ErrorCode::kInvalidArgument, status.message());
    case StatusCode::kFailedPrecondition:
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, status.message());
    case StatusCode::kAborted: return ffi::Error(ffi::ErrorCode::kAborted, status.message());
    case StatusCode::kUnavailable: return ffi::Error(ffi::ErrorCode::kUnavailable, status.message());
    case StatusCode::kDeadlineExceeded:
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, status.message());
    case StatusCode::kUnimplemented: return ffi::Error(ffi::ErrorCode::kUnimplemented, status.message());
    case StatusCode::kInternal: return ffi::Error(ffi::ErrorCode::kInternal, status.message());
  }
  return ffi::Error(ffi::ErrorCode::kInternal, "unknown nvgroup status: " + status.message());
}

namespace {

// Host handler: the buffers are complete when XLA calls it; no readiness event.
ffi::Error HostCollective(ffi::RemainingArgs args, ffi::RemainingRets rets, std::string_view name,
                          int64_t type, int64_t grouped, int64_t op, double prescale, double postscale,
                          int64_t root) {
  CallAttributes attributes;
  Status status = DecodeAttributes(name, type, grouped, op, prescale, postscale, root, &attributes);
  std::vector<CollectiveRequest> requests;
  if (status.ok()) status = BuildRequests(attributes, args, rets, &requests);
  if (status.ok()) status = EnqueueAndWait(std::move(requests));
  return ToFfiError(status);
}

// The asynchronous variant (target kXlaAsyncTarget, NVGROUP_XLA_ASYNC=1): the
// handler enqueues and returns a future that the engine's done callbacks
// complete, so XLA's CPU runtime may run independent work meanwhile. XLA resumes
// the program in the thread that completes the future, which must not be an
// engine thread (it would stall negotiation): a completion thread of ours does it.
class CompletionThread {
 public:
  static void Run(std::function<void()> task) {
    static CompletionThread* thread = new CompletionThread();  // never destroyed: runs until exit
    {
      std::lock_guard<std::mutex> lock(thread->mu_);
      thread->tasks_.push_back(std::move(task));
    }
    thread->cv_.notify_one();
  }

 private:
  CompletionThread() {
    std::thread([this] {
      for (;;) {
        std::function<void()> task;
        {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [this] { return !tasks_.empty(); });
          task = std::move(tasks_.front());
          tasks_.pop_front();
        }
        task();
      }
    }).detach();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
};

ffi::Future HostCollectiveAsync(ffi::RemainingArgs args, ffi::RemainingRets rets, std::string_view name,
                                int64_t type, int64_t grouped, int64_t op, double prescale,
                                double postscale, int64_t root) {
  ffi::Promise promise;
  ffi::Future future(promise);
  CallAttributes attributes;
  Status status = DecodeAttributes(name, type, grouped, op, prescale, postscale, root, &attributes);
  std::vector<CollectiveRequest> requests;
  if (status.ok()) status = BuildRequests(attributes, args, rets, &requests);
  if (!status.ok()) {
    promise.SetError(ToFfiError(status));
    return future;
  }
  struct State {
    explicit State(ffi::Promise p, size_t n) : promise(std::move(p)), pending(n) {}
    ffi::Promise promise;
    std::mutex mu;
    size_t pending;
    Status first_error;
  };
  auto state = std::make_shared<State>(promise, requests.size());
  for (CollectiveRequest& q : requests) {
    q.done = [state](const Status& s) {
      {
        std::lock_guard<std::mutex> lock(state->mu);
        if (!s.ok() && state->first_error.ok()) state->first_error = s;
        if (--state->pending != 0) return;
      }
      CompletionThread::Run([state] {
        if (state->first_error.ok()) state->promise.SetAvailable();
        else state->promise.SetError(ToFfiError(state->first_error));
      });
    };
  }
  const size_t count = requests.size();
  status = count == 1 ? Enqueue(std::move(requests[0])) : EnqueueGroup(std::move(requests));
  if (!status.ok()) promise.SetError(ToFfiError(status));  // rejected: no callback runs
  return future;
}

XLA_FFI_DEFINE_HANDLER(kHostCollectiveAsync, HostCollectiveAsync,
                       ffi::Ffi::Bind()
                           .RemainingArgs()
                           .RemainingRets()
                           .Attr<std::string_view>("name")
                           .Attr<int64_t>("type")
                           .Attr<int64_t>("grouped")
                           .Attr<int64_t>("op")
                           .Attr<double>("prescale")
                           .Attr<double>("postscale")
                           .Attr<int64_t>("root"));

XLA_FFI_DEFINE_HANDLER(kHostCollective, HostCollective,
                       ffi::Ffi::Bind()
                           .RemainingArgs()
                           .RemainingRets()
                           .Attr<std::string_view>("name")
                           .Attr<int64_t>("type")
                           .Attr<int64_t>("grouped")
                           .Attr<int64_t>("op")
                           .Attr<double>("prescale")
                           .Attr<double>("postscale")
                           .Attr<int64_t>("root"));

}  // namespace

// Registers `handler` for `target` on `platform` in XLA's FFI registry (the
// one inside TensorFlow's library: GetXlaFfiApi). A failure is printed; XLA
// then fails every program using the target with its "no handler" error.
bool RegisterHandler(const char* target, const char* platform, XLA_FFI_Handler* handler) {
  const XLA_FFI_Api* api = ::xla::ffi::GetXlaFfiApi();
  XLA_FFI_Error* error = ffi::Ffi::RegisterStaticHandler(api, target, platform, handler);
  if (error == nullptr) return true;
  XLA_FFI_Error_GetMessage_Args message;
  message.struct_size = XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE;
  message.extension_start = nullptr;
  message.error = error;
  message.message = nullptr;
  api->XLA_FFI_Error_GetMessage(&message);
  std::fprintf(stderr, "nvgroup_tf: registering the XLA custom call '%s' for %s failed: %s\n", target,
               platform, message.message != nullptr ? message.message : "(no message)");
  XLA_FFI_Error_Destroy_Args destroy;
  destroy.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
  destroy.extension_start = nullptr;
  destroy.error = error;
  api->XLA_FFI_Error_Destroy(&destroy);
  return false;
}

namespace {
[[maybe_unused]] const bool kHostRegistered = RegisterHandler(kXlaTarget, "Host", kHostCollective) &&
                                              RegisterHandler(kXlaAsyncTarget, "Host", kHostCollectiveAsync);
}  // namespace

// ---------------------------------------------------------------------------
// Lowering: tf2xla kernels.

namespace {

using tf::XlaOpKernel;
using tf::XlaOpKernelContext;

absl::Status StaticShapeWithLayout(XlaOpKernelContext* ctx, int index, const std::string& name,
                                   ::xla::Shape* shape) {
  TF_ASSIGN_OR_RETURN(*shape, ctx->InputXlaShape(index));
  if (!shape->is_static())
    return absl::InvalidArgumentError("nvgroup collective '" + name + "' under XLA needs static shapes; input " +
                                      std::to_string(index) + " is " + shape->ToString());
  ::xla::LayoutUtil::SetToDefaultLayout(shape);  // row-major: what the engine's buffers are
  return absl::OkStatus();
}

// NVGROUP_XLA_ASYNC (read once): "1" lowers to the asynchronous host handler,
// unset or "0" to the synchronous one; anything else fails the compilation.
absl::Status XlaTarget(const char** target) {
  static const char* const value = std::getenv("NVGROUP_XLA_ASYNC");
  const std::string text = value == nullptr ? "0" : value;
  if (text != "0" && text != "1")
    return absl::InvalidArgumentError("NVGROUP_XLA_ASYNC must be 0 or 1, got '" + text + "'");
  *target = text == "1" ? kXlaAsyncTarget : kXlaTarget;
  return absl::OkStatus();
}

// One custom call: operands -> results (a tuple when `tuple`), row-major layouts.
std::vector<::xla::XlaOp> EmitCall(XlaOpKernelContext* ctx, const CallAttributes& attributes,
                                   const std::vector<::xla::Shape>& in_shapes,
                                   const std::vector<::xla::Shape>& out_shapes, bool tuple) {
  const char* target = kXlaTarget;
  absl::Status chosen = XlaTarget(&target);
  if (!chosen.ok()) {
    ctx->SetStatus(chosen);
    return {};
  }
  std::vector<::xla::XlaOp> operands;
  for (int i = 0; i < ctx->num_inputs(); ++i) operands.push_back(ctx->Input(i));
  const ::xla::Shape result = tuple ? ::xla::ShapeUtil::MakeTupleShape(out_shapes) : out_shapes[0];
  ::xla::XlaOp call = ::xla::CustomCallWithLayout(
      ctx->builder(), target, operands, result, in_shapes, XlaAttributes(attributes),
      /*has_side_effect=*/true, /*output_operand_aliasing=*/{}, /*literal=*/nullptr,
      ::xla::CustomCallSchedule::SCHEDULE_NONE, ::xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
  std::vector<::xla::XlaOp> outputs;
  if (!tuple) return {call};
  for (size_t i = 0; i < out_shapes.size(); ++i) outputs.push_back(::xla::GetTupleElement(call, i));
  return outputs;
}

class AllreduceXlaOp : public XlaOpKernel {
 public:
  explicit AllreduceXlaOp(tf::OpKernelConstruction* context) : XlaOpKernel(context) {
    tf_adapter::AllreduceAttrs attrs;
    OP_REQUIRES_OK(context, attrs.Read(context));
    attributes_.name = tf_adapter::CollectiveName(*this, attrs.tensor_name);
    attributes_.type = CollectiveType::kAllreduce;
    attributes_.grouped = type_string() == "NvgroupGroupedAllreduce";
    attributes_.op = attrs.op;
    attributes_.prescale_factor = attrs.prescale_factor;
    attributes_.postscale_factor = attrs.postscale_factor;
  }

  void Compile(XlaOpKernelContext* ctx) override {
    std::vector<::xla::Shape> shapes(ctx->num_inputs());
    for (int i = 0; i < ctx->num_inputs(); ++i)
      OP_REQUIRES_OK(ctx, StaticShapeWithLayout(ctx, i, attributes_.name, &shapes[i]));
    std::vector<::xla::XlaOp> outputs = EmitCall(ctx, attributes_, shapes, shapes, attributes_.grouped);
    for (size_t i = 0; i < outputs.size(); ++i) ctx->SetOutput(static_cast<int>(i), outputs[i]);
  }

 private:
  CallAttributes attributes_;
};

class BroadcastXlaOp : public XlaOpKernel {
 public:
  explicit BroadcastXlaOp(tf::OpKernelConstruction* context) : XlaOpKernel(context) {
    std::string tensor_name;
    OP_REQUIRES_OK(context, context->GetAttr("tensor_name", &tensor_name));
    OP_REQUIRES_OK(context, context->GetAttr("root_rank", &attributes_.root_rank));
    attributes_.name = tf_adapter::CollectiveName(*this, tensor_name);
    attributes_.type = CollectiveType::kBroadcast;
  }

  void Compile(XlaOpKernelContext* ctx) override {
    std::vector<::xla::Shape> shapes(1);
    OP_REQUIRES_OK(ctx, StaticShapeWithLayout(ctx, 0, attributes_.name, &shapes[0]));
    std::vector<::xla::XlaOp> outputs = EmitCall(ctx, attributes_, shapes, shapes, false);
    if (!outputs.empty()) ctx->SetOutput(0, outputs[0]);
  }

 private:
  CallAttributes attributes_;
};

class AllgatherXlaOp : public XlaOpKernel {
 public:
  explicit AllgatherXlaOp(tf::OpKernelConstruction* context) : XlaOpKernel(context) {
    std::string tensor_name;
    OP_REQUIRES_OK(context, context->GetAttr("tensor_name", &tensor_name));
    attributes_.name = tf_adapter::CollectiveName(*this, tensor_name);
    attributes_.type = CollectiveType::kAllgather;
  }

  void Compile(XlaOpKernelContext* ctx) override {
    std::vector<::xla::Shape> in(1);
    OP_REQUIRES_OK(ctx, StaticShapeWithLayout(ctx, 0, attributes_.name, &in[0]));
    OP_REQUIRES(ctx, in[0].dimensions().size() >= 1,
                absl::InvalidArgumentError("allgather of '" + attributes_.name +
                                           "' needs a tensor of rank >= 1 (it concatenates along the "
                                           "first dimension); got a scalar"));
    int64_t rows = 0;
    OP_REQUIRES_OK(ctx, tf_adapter::ToTfStatus(GatheredRows(in[0].dimensions(0), &rows)));
    std::vector<::xla::Shape> out = in;
    out[0].set_dimensions(0, rows);
    std::vector<::xla::XlaOp> outputs = EmitCall(ctx, attributes_, in, out, false);
    if (!outputs.empty()) ctx->SetOutput(0, outputs[0]);
  }

 private:
  // The compile-time collective of xla_ops.h ("Allgather"): the sum over ranks
  // of the first dimension.
  Status GatheredRows(int64_t mine, int64_t* total) {
    StatusOr<int> size = Size();
    if (!size.ok()) return size.status();
    std::vector<int64_t> all(size.value(), 0);
    std::vector<CollectiveRequest> requests(1);
    CollectiveRequest& q = requests[0];
    q.name = attributes_.name + "/xla_rows";
    q.type = CollectiveType::kAllgather;
    q.dtype = DataType::kInt64;
    q.shape = {1};
    q.input = &mine;
    q.allocate_output = [&all](const std::vector<int64_t>& shape, void** out) {
      if (shape.size() != 1 || shape[0] != static_cast<int64_t>(all.size()))
        return Status::Internal("allgather of the first dimensions returned shape " + ShapeToString(shape));
      *out = all.data();
      return Status::Ok();
    };
    Status status = EnqueueAndWait(std::move(requests));
    if (!status.ok()) return status.WithContext("compiling allgather '" + attributes_.name + "' for XLA");
    *total = 0;
    for (int64_t r : all) *total += r;
    return Status::Ok();
  }

  CallAttributes attributes_;
};

REGISTER_XLA_OP(Name("NvgroupAllreduce"), AllreduceXlaOp);
REGISTER_XLA_OP(Name("NvgroupGroupedAllreduce"), AllreduceXlaOp);
REGISTER_XLA_OP(Name("NvgroupAllgather"), AllgatherXlaOp);
REGISTER_XLA_OP(Name("NvgroupBroadcast"), BroadcastXlaOp);

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
