// What the host (xla_host_handlers.cc) and CUDA (xla_ops_gpu.cc) handlers
// share: the starts waiting for their done (PairCalls, Note [Start and
// done] in xla_ops.h), the one Status -> ffi::Error conversion, and the
// registration in XLA's FFI registry.
#include "ops/xla_ops.h"

#include <cstdio>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <string>
#include <utility>
#include <vector>

#include "common/checks.h"

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
    return Status::FailedPrecondition(
        "nvgroup XLA collective '" + name +
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

}  // namespace xla_adapter
}  // namespace nvgroup
