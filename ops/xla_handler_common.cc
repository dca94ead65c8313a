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
#include "ops/grouped_submissions.h"

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

namespace {

// The members as RegisterGroup saw them: the same collective, pointers aside.
bool SameMembers(const std::vector<CollectiveRequest>& a, const std::vector<CollectiveRequest>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const CollectiveRequest& x = a[i];
    const CollectiveRequest& y = b[i];
    if (x.name != y.name || x.dtype != y.dtype || x.shape != y.shape || x.op != y.op ||
        x.prescale_factor != y.prescale_factor || x.postscale_factor != y.postscale_factor ||
        x.process_set_id != y.process_set_id || !(x.device == y.device))
      return false;
  }
  return true;
}

struct Site {
  std::vector<CollectiveRequest> members;  // the registered (or refused) members, no pointers
  uint64_t group = 0;                      // 0: registering them failed; submit by name
};

}  // namespace

StatusOr<uint64_t> CallRegistrations::For(const std::string& site,
                                          const std::vector<CollectiveRequest>& requests) {
  StatusOr<bool> enabled = tf_adapter::RegisteredGroupsEnabled();
  if (!enabled.ok()) return enabled.status();
  if (requests.size() < 2 || !enabled.value()) return 0;
  for (const CollectiveRequest& q : requests)
    if (q.type != CollectiveType::kAllreduce) return 0;
  static std::mutex* mu = new std::mutex();  // never destroyed: programs may run until exit
  static auto* sites = new std::unordered_map<std::string, Site>();
  std::lock_guard<std::mutex> lock(*mu);
  Site& s = (*sites)[site];
  using tf_adapter::CountGroupedSubmission;
  using tf_adapter::GroupedSubmission;
  if (SameMembers(s.members, requests)) {
    if (s.group == 0 || RegisteredGroupUsable(s.group)) {
      CountGroupedSubmission(s.group != 0 ? GroupedSubmission::kLaunch : GroupedSubmission::kByName);
      return s.group;
    }
  } else if (s.group != 0 && !UnregisterGroup(s.group).ok() && RegisteredGroupUsable(s.group)) {
    CountGroupedSubmission(GroupedSubmission::kByName);
    return 0;  // its launch is in flight: by name this time, replace it at a later call
  }
  s.members.clear();
  for (const CollectiveRequest& q : requests) {
    CollectiveRequest m;
    m.name = q.name;
    m.type = q.type;
    m.dtype = q.dtype;
    m.shape = q.shape;
    m.op = q.op;
    m.prescale_factor = q.prescale_factor;
    m.postscale_factor = q.postscale_factor;
    m.process_set_id = q.process_set_id;
    m.device = q.device;
    s.members.push_back(std::move(m));
  }
  StatusOr<uint64_t> registered = RegisterGroup(s.members);
  s.group = registered.ok() ? registered.value() : 0;  // refused: EnqueueGroup reports why
  if (s.group != 0) CountGroupedSubmission(GroupedSubmission::kRegistration);
  CountGroupedSubmission(s.group != 0 ? GroupedSubmission::kLaunch : GroupedSubmission::kByName);
  return s.group;
}

Status LaunchCall(uint64_t group, const std::vector<CollectiveRequest>& requests, void* ready_event,
                  DoneCallback done, std::function<void(void*)> completion_event_ready) {
  std::vector<const void*> inputs(requests.size());
  std::vector<void*> outputs(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    inputs[i] = requests[i].input;
    outputs[i] = requests[i].output;
  }
  GroupLaunch launch;
  launch.inputs = inputs.data();
  launch.outputs = outputs.data();
  launch.count = requests.size();
  launch.ready_event = ready_event;
  launch.done = std::move(done);
  launch.completion_event_ready = std::move(completion_event_ready);
  return EnqueueRegisteredGroup(group, std::move(launch));
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
