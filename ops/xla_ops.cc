// tf2xla kernels of the Nvgroup* ops (every XLA device: XLA_CPU_JIT,
// XLA_GPU_JIT) and the custom-call handler for XLA's host platform. The design
// is described in xla_ops.h; the CUDA handler is in xla_ops_gpu.cc.
#include "ops/xla_ops.h"

#include <algorithm>
#include <cinttypes>
#include <climits>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
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

// An i64 array attribute (MLIR's dense array: "array<i64>" when empty).
std::string MlirI64Array(const std::vector<int64_t>& values) {
  std::string out = "array<i64";
  for (size_t i = 0; i < values.size(); ++i) out += (i == 0 ? ": " : ", ") + std::to_string(values[i]);
  return out + ">";
}

}  // namespace

std::string XlaAttributes(const CallAttributes& a) {
  return "{name = " + MlirString(a.name) +
         ", type = " + MlirI64(static_cast<int64_t>(a.type)) +
         ", grouped = " + MlirI64(a.grouped ? 1 : 0) +
         ", op = " + MlirI64(static_cast<int64_t>(a.op)) +
         ", prescale = " + MlirF64(a.prescale_factor) +
         ", postscale = " + MlirF64(a.postscale_factor) +
         ", root = " + MlirI64(a.root_rank) +
         ", process_set = " + MlirI64(a.process_set_id) +
         ", splits = " + MlirI64Array(a.splits) +
         ", received = " + MlirI64Array(a.received_splits) + "}";
}

namespace {

// WireAttributes -> CallAttributes, checking what a hand-written HLO could get wrong.
Status DecodeAttributes(const WireAttributes& w, CallAttributes* out) {
  // Join is not lowered (xla_ops.h).
  if (w.type < 0 || w.type > static_cast<int64_t>(CollectiveType::kAlltoall))
    return Status::Internal("nvgroup XLA custom call: unknown collective type " + std::to_string(w.type));
  if (w.op < 0 || w.op > static_cast<int64_t>(ReduceOp::kProduct))
    return Status::Internal("nvgroup XLA custom call: unknown reduce op " + std::to_string(w.op));
  if (w.process_set < 0 || w.process_set > INT32_MAX || w.root < INT32_MIN || w.root > INT32_MAX)
    return Status::Internal("nvgroup XLA custom call: process set " + std::to_string(w.process_set) +
                            " or root " + std::to_string(w.root) + " out of range");
  out->name = std::string(w.name);
  out->type = static_cast<CollectiveType>(w.type);
  out->grouped = w.grouped != 0;
  out->op = static_cast<ReduceOp>(w.op);
  out->prescale_factor = w.prescale;
  out->postscale_factor = w.postscale;
  out->root_rank = static_cast<int>(w.root);
  out->process_set_id = static_cast<int32_t>(w.process_set);
  out->splits.assign(w.splits.begin(), w.splits.end());
  out->received_splits.assign(w.received.begin(), w.received.end());
  return Status::Ok();
}

}  // namespace

// ---------------------------------------------------------------------------
// Run time: XLA buffers -> engine requests.

namespace {

Status ToEngineDataType(ffi::DataType dtype, DataType* out) {
  switch (dtype) {
    case ffi::DataType::U8: *out = DataType::kUint8; return Status::Ok();
    case ffi::DataType::S8: *out = DataType::kInt8; return Status::Ok();
    case ffi::DataType::U16: *out = DataType::kUint16; return Status::Ok();
    case ffi::DataType::S16: *out = DataType::kInt16; return Status::Ok();
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

// The engine's result shape must be the one XLA compiled (xla_ops.h, "Static
// shapes"); then the result goes straight into XLA's buffer.
AllocateOutputFn IntoCompiledBuffer(const CallAttributes& a, const std::string& name, const ffi::AnyBuffer& output) {
  const std::vector<int64_t> compiled = Dims(output);
  void* data = output.untyped_data();
  const std::string what = std::string(CollectiveTypeName(a.type)) + " of '" + name + "' under XLA";
  return [compiled, data, what](const std::vector<int64_t>& shape, void** out_ptr) {
    if (shape != compiled)
      return Status::FailedPrecondition(
          what + ": the result shape is " + ShapeToString(shape) + " but the XLA program was compiled for " +
          ShapeToString(compiled) + " (the ranks' shapes or splits changed after compilation; every rank "
          "must recompile with the same shapes)");
    *out_ptr = data;
    return Status::Ok();
  };
}

}  // namespace

Status DecodeCall(const WireAttributes& wire, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  std::vector<CollectiveRequest>* requests, size_t token_results) {
  CallAttributes a;
  NVG_RETURN_IF_ERROR(DecodeAttributes(wire, &a));
  // The last operand only orders the call (CollectiveOrder); the data operands
  // pair with the data results (a start's token follows them).
  const size_t data = rets.size() >= token_results ? rets.size() - token_results : 0;
  if (args.size() != data + 1 || data == 0)
    return Status::Internal("nvgroup XLA custom call '" + a.name + "': " + std::to_string(args.size()) +
                            " operands for " + std::to_string(data) +
                            " data results (want one operand per result and the ordering operand)");
  requests->clear();
  for (size_t i = 0; i < data; ++i) {
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
    q.process_set_id = a.process_set_id;
    switch (a.type) {
      case CollectiveType::kAllgather:
      case CollectiveType::kReducescatter:
        q.allocate_output = IntoCompiledBuffer(a, q.name, output);
        break;
      case CollectiveType::kAlltoall: {
        q.splits = a.splits;
        // The engine writes the received splits, then allocates: both must be
        // what the program was compiled for (the received splits are a constant
        // of the program, xla_ops.cc "Alltoall").
        auto received = std::make_shared<std::vector<int64_t>>();
        q.received_splits = received.get();
        AllocateOutputFn into = IntoCompiledBuffer(a, q.name, output);
        const std::vector<int64_t> compiled = a.received_splits;
        const std::string name = q.name;
        q.allocate_output = [received, into, compiled, name](const std::vector<int64_t>& shape, void** out_ptr) {
          if (*received != compiled)
            return Status::FailedPrecondition(
                "alltoall of '" + name + "' under XLA: this rank receives " + ShapeToString(*received) +
                " rows from the ranks but the XLA program was compiled for " + ShapeToString(compiled) +
                " (a rank's splits changed after compilation; every rank must recompile)");
          return into(shape, out_ptr);
        };
        break;
      }
      default:
        q.output = output.untyped_data();
    }
    requests->push_back(std::move(q));
  }
  return Status::Ok();
}

Status DecodeDone(const WireAttributes& wire, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  std::string* name, std::vector<DoneBuffer>* buffers) {
  CallAttributes a;
  NVG_RETURN_IF_ERROR(DecodeAttributes(wire, &a));
  *name = a.name;
  const size_t n = rets.size();
  // Operands past 2n are the done-after tensors (xla_ops.h, "Done after"): order only.
  if (n == 0 || args.size() < 2 * n)
    return Status::Internal("nvgroup XLA done call '" + a.name + "': " + std::to_string(args.size()) +
                            " operands for " + std::to_string(n) +
                            " results (want the start's results, the inputs, then any done-after tensors)");
  buffers->clear();
  for (size_t i = 0; i < n; ++i) {
    auto from = args.get<ffi::AnyBuffer>(i);
    auto to = rets.get<ffi::AnyBuffer>(i);
    if (from.has_error() || to.has_error())
      return Status::Internal("nvgroup XLA done call '" + a.name + "': operand/result " + std::to_string(i) +
                              " is not a buffer");
    const ffi::AnyBuffer f = *from;
    const ffi::AnyBuffer t = **to;
    if (f.size_bytes() != t.size_bytes())
      return Status::Internal("nvgroup XLA done call '" + a.name + "': result " + std::to_string(i) + " has " +
                              std::to_string(t.size_bytes()) + " bytes, its operand " +
                              std::to_string(f.size_bytes()));
    buffers->push_back({f.untyped_data(), t.untyped_data(), t.size_bytes()});
  }
  return Status::Ok();
}

namespace {

std::mutex& PairCallsMutex() {
  static std::mutex* m = new std::mutex();  // never destroyed: programs may run until exit
  return *m;
}
std::unordered_map<std::string, std::shared_ptr<PairCall>>& PairCallMap() {
  static auto* map = new std::unordered_map<std::string, std::shared_ptr<PairCall>>();
  return *map;
}

}  // namespace

Status PairCalls::Put(const std::string& name, std::shared_ptr<PairCall> call) {
  std::lock_guard<std::mutex> lock(PairCallsMutex());
  auto& slot = PairCallMap()[name];
  if (slot != nullptr && !slot->Finished())
    return Status::FailedPrecondition("nvgroup XLA collective '" + name +
                                      "' started while its previous start is still in flight (two collectives "
                                      "of one name at once; give them different names)");
  slot = std::move(call);
  return Status::Ok();
}

std::shared_ptr<PairCall> PairCalls::Take(const std::string& name) {
  std::lock_guard<std::mutex> lock(PairCallsMutex());
  auto it = PairCallMap().find(name);
  if (it == PairCallMap().end()) return nullptr;
  std::shared_ptr<PairCall> call = std::move(it->second);
  PairCallMap().erase(it);
  return call;
}

StatusOr<bool> LowerToStartDone(bool gpu) {
  static const StatusOr<int> setting = []() -> StatusOr<int> {
    Knobs knobs;
    Status parsed = ParseSettingFromEnvironment("NVGROUP_XLA_START_DONE", &knobs);
    if (!parsed.ok()) return parsed;
    return knobs.xla_start_done;
  }();
  if (!setting.ok()) return setting.status();
  return setting.value() < 0 ? gpu : setting.value() == 1;
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
ffi::Error HostCollective(ffi::RemainingArgs args, ffi::RemainingRets rets, WireAttributes wire) {
  std::vector<CollectiveRequest> requests;
  Status status = DecodeCall(wire, args, rets, &requests);
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

ffi::Future HostCollectiveAsync(ffi::RemainingArgs args, ffi::RemainingRets rets, WireAttributes wire) {
  ffi::Promise promise;
  ffi::Future future(promise);
  std::vector<CollectiveRequest> requests;
  Status status = DecodeCall(wire, args, rets, &requests);
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

XLA_FFI_DEFINE_HANDLER(kHostCollectiveAsync, HostCollectiveAsync, BindCall(ffi::Ffi::Bind()));

// The pair on the host (Note [Start and done], xla_ops.h): the start submits,
// the done waits on the host until every request completed.
struct HostPairCall : PairCall {
  explicit HostPairCall(int n) : pending(n) {}
  bool Finished() override {
    std::lock_guard<std::mutex> lock(mu);
    return pending == 0;
  }
  void OnDone(const Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    if (!s.ok() && first_error.ok()) first_error = s;
    --pending;
    changed.notify_all();
  }
  std::mutex mu;  // guards the members below
  std::condition_variable changed;
  int pending;    // requests whose `done` has not run
  Status first_error;
};

ffi::Error HostCollectiveStart(ffi::RemainingArgs args, ffi::RemainingRets rets, WireAttributes wire) {
  std::vector<CollectiveRequest> requests;
  Status status = DecodeCall(wire, args, rets, &requests, /*token_results=*/1);
  if (!status.ok()) return ToFfiError(status);
  const std::string name(wire.name);
  auto call = std::make_shared<HostPairCall>(static_cast<int>(requests.size()));
  for (CollectiveRequest& q : requests) q.done = [call](const Status& s) { call->OnDone(s); };
  status = PairCalls::Put(name, call);
  if (!status.ok()) return ToFfiError(status);
  const size_t count = requests.size();
  status = count == 1 ? Enqueue(std::move(requests[0])) : EnqueueGroup(std::move(requests));
  if (!status.ok()) PairCalls::Take(name);  // rejected: no callback runs, no done will look for it
  return ToFfiError(status);
}

ffi::Error HostCollectiveDone(ffi::RemainingArgs args, ffi::RemainingRets rets, WireAttributes wire) {
  std::string name;
  std::vector<DoneBuffer> buffers;
  Status status = DecodeDone(wire, args, rets, &name, &buffers);
  if (!status.ok()) return ToFfiError(status);
  std::shared_ptr<PairCall> taken = PairCalls::Take(name);
  auto* call = dynamic_cast<HostPairCall*>(taken.get());
  if (call == nullptr)
    return ToFfiError(Status::Internal("nvgroup XLA done call '" + name + "' found no start of that name"));
  {
    // Bounded: every accepted request's `done` runs in bounded time (engine.h).
    std::unique_lock<std::mutex> lock(call->mu);
    call->changed.wait(lock, [call] { return call->pending == 0; });
    if (!call->first_error.ok()) return ToFfiError(call->first_error);
  }
  for (const DoneBuffer& b : buffers)
    if (b.from != b.to) std::memcpy(b.to, b.from, b.bytes);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kHostCollectiveStart, HostCollectiveStart, BindCall(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kHostCollectiveDone, HostCollectiveDone, BindCall(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER(kHostCollective, HostCollective, BindCall(ffi::Ffi::Bind()));

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
                                              RegisterHandler(kXlaAsyncTarget, "Host", kHostCollectiveAsync) &&
                                              RegisterHandler(kXlaStartTarget, "Host", kHostCollectiveStart) &&
                                              RegisterHandler(kXlaDoneTarget, "Host", kHostCollectiveDone);
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

// The order of the collective calls of one XLA computation (xla_ops.h,
// "Order"): per XlaBuilder, the last collective call's output. Builders live
// only while TF compiles one function and may be built on several threads at
// once; an entry whose builder was destroyed is never used again, because an
// op is taken only while it still belongs to the builder at that address and
// the builder knows its shape (a new builder reusing the address fails that
// check or, at worst, hands an earlier op of its own, which orders nothing
// wrongly: the chain between its own collectives is what counts).
class CollectiveOrder {
 public:
  // The operand that puts the next collective call of `builder` after its
  // previous one: that call's output, or for the first one an empty u8[0].
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
  ::xla::Shape token = ::xla::ShapeUtil::MakeShape(::xla::U8, {0});
  ::xla::LayoutUtil::SetToDefaultLayout(&token);
  start_results.push_back(token);
  const std::string config = XlaAttributes(attributes);
  ::xla::XlaOp start = ::xla::CustomCallWithLayout(
      builder, kXlaStartTarget, start_operands, ::xla::ShapeUtil::MakeTupleShape(start_results),
      start_operand_shapes, config, /*has_side_effect=*/true, /*output_operand_aliasing=*/{},
      /*literal=*/nullptr, ::xla::CustomCallSchedule::SCHEDULE_EARLIEST,
      ::xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
  std::vector<::xla::XlaOp> done_operands;
  for (size_t i = 0; i < n; ++i) done_operands.push_back(::xla::GetTupleElement(start, static_cast<int64_t>(i)));
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
  ::xla::XlaOp done = ::xla::CustomCallWithLayout(
      builder, kXlaDoneTarget, done_operands, done_result, done_operand_shapes, config,
      /*has_side_effect=*/true, aliasing, /*literal=*/nullptr, ::xla::CustomCallSchedule::SCHEDULE_LATEST,
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
// (CollectiveOrder; the handlers skip it) -> results (a tuple when `tuple`),
// row-major layouts. Done-after inputs are not operands of the single call:
// they would hold its start back.
std::vector<::xla::XlaOp> EmitCall(XlaOpKernelContext* ctx, const CallAttributes& attributes,
                                   std::vector<::xla::Shape> in_shapes,
                                   const std::vector<::xla::Shape>& out_shapes, bool tuple, bool gpu) {
  StatusOr<bool> pair = LowerToStartDone(gpu);
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
  const ::xla::Shape result = tuple ? ::xla::ShapeUtil::MakeTupleShape(out_shapes) : out_shapes[0];
  ::xla::XlaOp call = ::xla::CustomCallWithLayout(
      builder, target, operands, result, in_shapes, XlaAttributes(attributes),
      /*has_side_effect=*/true, /*output_operand_aliasing=*/{}, /*literal=*/nullptr,
      ::xla::CustomCallSchedule::SCHEDULE_NONE, ::xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
  std::vector<::xla::XlaOp> outputs;
  if (!tuple) {
    outputs.push_back(call);
  } else {
    for (size_t i = 0; i < out_shapes.size(); ++i) outputs.push_back(::xla::GetTupleElement(call, i));
  }
  CollectiveOrder::Record(builder, outputs[0]);
  return outputs;
}

// This rank's place in the collective's process set (compile time).
Status PlaceInSet(const CallAttributes& a, int* rank, int* size) {
  StatusOr<int> r = ProcessSetRank(a.process_set_id);
  if (!r.ok()) return r.status().WithContext("compiling " + std::string(CollectiveTypeName(a.type)) + " '" +
                                             a.name + "' for XLA");
  StatusOr<int> n = ProcessSetSize(a.process_set_id);
  if (!n.ok()) return n.status();
  if (r.value() < 0) {
    StatusOr<int> me = Rank();
    return Status::InvalidArgument("rank " + std::to_string(me.ok() ? me.value() : -1) +
                                   " is not a member of process set " + std::to_string(a.process_set_id) + "; '" +
                                   a.name + "' can only run on its members");
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
    return status.WithContext("compiling " + std::string(CollectiveTypeName(a.type)) + " '" + a.name + "' for XLA");
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
      if (v < 0 && mine.ok()) mine = Status::InvalidArgument(who + ": alltoall splits must be >= 0, got " +
                                                             ShapeToString(splits));
      total += v;
    }
    if (mine.ok() && total != dim0)
      mine = Status::InvalidArgument(who + ": alltoall splits " + ShapeToString(splits) + " sum to " +
                                     std::to_string(total) + ", not the first dimension " + std::to_string(dim0));
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
    if (type == CollectiveType::kBroadcast) OP_REQUIRES_OK(context, context->GetAttr("root_rank", &attributes_.root_rank));
    attributes_.process_set_id = process_set_id;
    attributes_.name = tf_adapter::CollectiveName(*this, tensor_name);
    gpu_ = context->device_type().type_string() == "XLA_GPU_JIT";
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
    std::vector<::xla::XlaOp> outputs = EmitCall(ctx, attributes, in, out, attributes.grouped, gpu_);
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
        return Status::InvalidArgument(std::string(CollectiveTypeName(a->type)) + " of '" + a->name +
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
  bool gpu_ = false;  // compiled for XLA_GPU_JIT (LowerToStartDone)
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
REGISTER_XLA_OP(Name("NvgroupAlltoall").CompileTimeConstantInput("splits"), XlaOpOf<CollectiveType::kAlltoall>);

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
