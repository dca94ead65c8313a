// The registered groups (registered_groups.h): registration, launches and
// their checks (Note [Registered groups]).
#include "engine/registered_groups.h"

#include <string>
#include <utility>

#include "common/checks.h"
#include "engine/registered_launch.h"

namespace nvgroup {
namespace {

std::string GroupText(uint64_t handle) { return "registered group " + std::to_string(handle); }

}  // namespace

StatusOr<uint64_t> RegisteredGroups::Add(const std::shared_ptr<Engine>& engine, Submission model) {
  uint64_t handle = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    handle = next_handle_++;
  }
  auto group = std::make_shared<Group>();
  group->engine = engine;
  group->group_id = model.group_id;
  for (TensorEntry& e : model.entries) {
    e.registered_group = handle;
    group->has_data.push_back(NumElements(e.request.shape) > 0);
  }
  NVG_RETURN_IF_ERROR(engine->Reserve(handle, model.entries));
  group->pool = std::make_shared<EntryPool>(std::move(model.entries));
  std::lock_guard<std::mutex> lock(mu_);
  groups_.emplace(handle, std::move(group));
  return handle;
}

StatusOr<std::shared_ptr<const RegisteredGroups::Group>> RegisteredGroups::Find(uint64_t handle) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = groups_.find(handle);
  if (it != groups_.end()) return it->second;
  if (handle != 0 && handle < forgotten_below_)
    return Status::FailedPrecondition(GroupText(handle) +
                                      " was registered before the last shutdown(); register it again "
                                      "after init()");
  return Status::InvalidArgument("unknown " + GroupText(handle) +
                                 " (never registered by RegisterGroup, or unregistered)");
}

bool RegisteredGroups::Usable(uint64_t handle) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = groups_.find(handle);
  return it != groups_.end() && !it->second->engine.expired();
}

Status RegisteredGroups::Launch(uint64_t handle, GroupLaunch launch) {
  StatusOr<std::shared_ptr<const Group>> found = Find(handle);
  if (!found.ok()) return found.status();
  const Group& g = *found.value();
  std::shared_ptr<Engine> engine = g.engine.lock();
  if (engine == nullptr)
    return Status::FailedPrecondition(GroupText(handle) +
                                      ": its process set's engine has stopped (remove_process_set); "
                                      "register the group again");
  const std::vector<TensorEntry>& model = g.pool->model();
  const size_t n = model.size();
  if (launch.count != n || launch.inputs == nullptr || launch.outputs == nullptr)
    return Status::InvalidArgument("EnqueueRegisteredGroup: " + GroupText(handle) + " has " +
                                   std::to_string(n) + " members; the launch gives " +
                                   std::to_string(launch.inputs == nullptr || launch.outputs == nullptr
                                                      ? 0
                                                      : launch.count) +
                                   " input and output pointers");
  if (!launch.done)
    return Status::InvalidArgument("EnqueueRegisteredGroup: " + GroupText(handle) + ": no done callback");
  for (size_t i = 0; i < n; ++i)
    if (g.has_data[i] && (launch.inputs[i] == nullptr || launch.outputs[i] == nullptr))
      return Status::InvalidArgument("EnqueueRegisteredGroup: " + GroupText(handle) + ": member " +
                                     std::to_string(i) + " ('" + model[i].request.name + "') has a null " +
                                     (launch.inputs[i] == nullptr ? "input" : "output") + " pointer");
  // Owned by its members from the push on (registered_launch.h).
  auto* owner = new RegisteredLaunch(static_cast<uint32_t>(n), std::move(launch.done),
                                     std::move(launch.completion_event_ready));
  Submission s;
  s.entries = g.pool->Take();
  s.group_id = g.group_id;
  s.registered_group = handle;
  s.pool = g.pool;
  for (size_t i = 0; i < n; ++i) {  // enqueue_time: TensorQueue::Push
    TensorEntry& e = s.entries[i];
    e.request.input = launch.inputs[i];
    e.request.output = launch.outputs[i];
    e.request.ready_event = launch.ready_event;
    e.request.done = RegisteredLaunch::MemberDone{owner};
    e.launch = owner;
  }
  Status pushed = engine->Submit(std::move(s));
  if (!pushed.ok()) delete owner;  // no member was queued
  return pushed;
}

Status RegisteredGroups::Remove(uint64_t handle) {
  StatusOr<std::shared_ptr<const Group>> found = Find(handle);
  if (!found.ok()) return found.status();
  std::shared_ptr<Engine> engine = found.value()->engine.lock();
  if (engine != nullptr) NVG_RETURN_IF_ERROR(engine->Unreserve(handle));
  std::lock_guard<std::mutex> lock(mu_);
  groups_.erase(handle);
  return Status::Ok();
}

void RegisteredGroups::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  groups_.clear();
  forgotten_below_ = next_handle_;
}

}  // namespace nvgroup
