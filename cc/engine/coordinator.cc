#include "engine/coordinator.h"

#include <algorithm>
#include <functional>
#include <sstream>

#include "engine/rank_lists.h"

namespace nvgroup {
namespace {

std::string FormatDouble(double v) {
  std::ostringstream s;
  s.precision(17);
  s << v;
  return s.str();
}

std::string GroupText(const RequestMessage& q) {
  if (q.group_size == 0) return "no group";
  std::ostringstream s;
  s << "a group of " << q.group_size << " (id " << std::hex << q.group_id << ")";
  return s.str();
}

// If `value` differs across ranks: "Mismatched <what> for '<name>': rank 0 has
// A, ranks [1, 3] have B, ..." (ranks grouped by value, in order of first
// appearance). Empty string when all ranks agree.
std::string Mismatch(const std::vector<RequestMessage>& by_rank, const std::string& what,
                     const std::function<std::string(const RequestMessage&)>& value) {
  std::vector<std::string> values;
  values.reserve(by_rank.size());
  for (const RequestMessage& q : by_rank) values.push_back(value(q));
  if (std::all_of(values.begin(), values.end(), [&](const std::string& v) { return v == values[0]; }))
    return std::string();
  return "Mismatched " + what + " for '" + by_rank[0].name + "': " + ValuesByRankText(values);
}

}  // namespace

ResponseMessage BuildResponse(const std::vector<RequestMessage>& by_rank) {
  const RequestMessage& first = by_rank[0];
  ResponseMessage resp;
  resp.name = first.name;
  resp.type = first.type;
  resp.dtype = first.dtype;
  resp.device_kind = first.device_kind;
  resp.op = first.op;
  resp.prescale_factor = first.prescale_factor;
  resp.postscale_factor = first.postscale_factor;
  resp.root_rank = first.root_rank;
  resp.shape = first.shape;
  resp.group_id = first.group_id;
  resp.group_size = first.group_size;

  const std::string type = CollectiveTypeName(first.type);
  std::string err = Mismatch(by_rank, "collective types",
                             [](const RequestMessage& q) { return std::string(CollectiveTypeName(q.type)); });
  if (err.empty())
    err = Mismatch(by_rank, type + " dtypes",
                   [](const RequestMessage& q) { return std::string(DataTypeName(q.dtype)); });
  if (err.empty())
    err = Mismatch(by_rank, type + " device kinds", [](const RequestMessage& q) {
      return std::string(q.device_kind == DeviceKind::kCpu ? "CPU" : "CUDA");
    });
  const bool reducing = first.type == CollectiveType::kAllreduce ||
                        first.type == CollectiveType::kReducescatter;
  if (err.empty() && reducing) {
    err = Mismatch(by_rank, type + " ops",
                   [](const RequestMessage& q) { return std::string(ReduceOpName(q.op)); });
    if (err.empty())
      err = Mismatch(by_rank, type + " prescale factors",
                     [](const RequestMessage& q) { return FormatDouble(q.prescale_factor); });
    if (err.empty())
      err = Mismatch(by_rank, type + " postscale factors",
                     [](const RequestMessage& q) { return FormatDouble(q.postscale_factor); });
  }
  if (err.empty() && first.type == CollectiveType::kBroadcast)
    err = Mismatch(by_rank, "broadcast root ranks",
                   [](const RequestMessage& q) { return std::to_string(q.root_rank); });
  if (err.empty()) {
    if (first.type == CollectiveType::kAllgather || first.type == CollectiveType::kAlltoall) {
      err = Mismatch(by_rank, type + " tensor shapes (all but the first dimension must agree)",
                     [](const RequestMessage& q) {
        std::vector<int64_t> rest = q.shape;
        if (!rest.empty()) rest[0] = -1;
        std::string s = ShapeToString(rest);
        return rest.empty() ? s : "[?" + s.substr(s.find_first_of(",]"));
      });
    } else {
      err = Mismatch(by_rank, type + " tensor shapes",
                     [](const RequestMessage& q) { return ShapeToString(q.shape); });
    }
  }
  if (err.empty()) err = Mismatch(by_rank, type + " groups", GroupText);
  if (!err.empty()) {
    resp.error_code = StatusCode::kFailedPrecondition;
    resp.error_message = err;
    return resp;
  }
  if (first.type == CollectiveType::kAllgather)
    for (const RequestMessage& q : by_rank) resp.first_dims.push_back(q.shape[0]);
  if (first.type == CollectiveType::kAlltoall) {
    // Engine::Submit resolved every rank's splits to one entry per rank.
    for (const RequestMessage& q : by_rank) {
      if (q.splits.size() != by_rank.size()) {
        resp.error_code = StatusCode::kFailedPrecondition;
        resp.error_message = "Mismatched alltoall splits for '" + first.name + "': a rank sent " +
                             std::to_string(q.splits.size()) + " splits for " +
                             std::to_string(by_rank.size()) + " ranks";
        resp.first_dims.clear();
        return resp;
      }
      resp.first_dims.insert(resp.first_dims.end(), q.splits.begin(), q.splits.end());
    }
  }
  return resp;
}

std::string RefusedDuplicateText(const std::string& name, const std::string& in_flight,
                                 const std::vector<int>& ranks) {
  const std::string where = ranks.size() == 1 ? "rank " + std::to_string(ranks[0])
                                              : "ranks " + RanksText(ranks);
  const std::string what = name == in_flight
                               ? "a collective named '" + name + "'"
                               : "'" + name + "', in a group with a collective named '" + in_flight + "',";
  return "duplicate name: " + what + " was submitted on " + where + " while another collective named '" +
         in_flight +
         "' was in flight there; it fails on every rank. Names must be unique until the "
         "previous request completes";
}

Coordinator::Coordinator(int size, StallInspector* stall)
    : size_(size), joined_(size, false), stall_(stall) {}

bool Coordinator::Complete(const Pending& p) const {
  if (p.count == size_) return true;
  if (joined_count_ == 0) return false;
  for (int r = 0; r < size_; ++r)
    if (!p.reported[r] && !joined_[r]) return false;
  return true;
}

void Coordinator::Finish(std::unordered_map<std::string, Pending>::iterator it) {
  Pending& p = it->second;
  std::vector<int> refusers;  // Note [Refused duplicates]
  const RequestMessage* refusal = nullptr;
  for (int r = 0; r < size_; ++r) {
    if (!p.reported[r] || p.by_rank[r].refused_duplicate.empty()) continue;
    refusers.push_back(r);
    if (refusal == nullptr) refusal = &p.by_rank[r];
  }
  if (refusal != nullptr) {
    ResponseMessage resp;
    resp.name = it->first;
    resp.error_code = StatusCode::kInvalidArgument;
    resp.error_message = RefusedDuplicateText(it->first, refusal->refused_duplicate, refusers);
    if (stall_ != nullptr) stall_->Remove(resp.name);
    table_.erase(it);
    ready_.push_back(std::move(resp));  // of no group: at once
    return;
  }
  // Joined ranks that did not submit the name take the first reporter's
  // parameters, so the agreement checks below judge the ranks that did.
  const RequestMessage* any = nullptr;
  std::vector<int> absent;
  for (int r = 0; r < size_; ++r) {
    if (p.reported[r] && any == nullptr) any = &p.by_rank[r];
    if (!p.reported[r]) absent.push_back(r);
  }
  bool groups_differ = false;
  for (int r = 0; r < size_; ++r)
    if (p.reported[r] &&
        (p.by_rank[r].group_id != any->group_id || p.by_rank[r].group_size != any->group_size))
      groups_differ = true;
  for (int r : absent) p.by_rank[r] = *any;
  ResponseMessage resp = BuildResponse(p.by_rank);
  if (!resp.ok() && groups_differ) {
    const Pending reporters = p;  // FailGroupsOf may erase entries of table_, not this one
    if (stall_ != nullptr) stall_->Remove(resp.name);
    table_.erase(it);
    resp.group_size = 0;  // released at once (its groups never run whole)
    resp.group_id = 0;
    const std::string message = resp.error_message;
    Release(std::move(resp));
    FailGroupsOf(reporters, message);
    return;
  }
  if (resp.ok() && !absent.empty()) {
    const bool reducing = resp.type == CollectiveType::kAllreduce ||
                          resp.type == CollectiveType::kReducescatter;
    if (!reducing || resp.device_kind != DeviceKind::kCpu) {
      resp.error_code = StatusCode::kFailedPrecondition;
      resp.error_message = std::string(reducing ? "a CUDA " : "") + CollectiveTypeName(resp.type) + " of '" +
                           resp.name + "' cannot run while ranks " + RanksText(absent) +
                           " have joined (hvd.join()): only allreduce and reducescatter of host tensors "
                           "accept joined ranks, which contribute zeros";
    }
  }
  if (resp.ok() && resp.type == CollectiveType::kJoin) {
    resp.root_rank = last_joined_;
    joined_.assign(size_, false);
    joined_count_ = 0;
    last_joined_ = -1;
  }
  if (stall_ != nullptr) stall_->Remove(resp.name);
  table_.erase(it);
  Release(std::move(resp));
}

// Note [Groups that cannot run]
// A grouped collective whose groups differ across ranks (rank 0 groups two
// tensors, rank 1 three) fails on the names both submitted ("Mismatched ...
// groups"), but a member only some ranks submitted would wait for the others
// forever, and with it its whole grouped op on those ranks. So once a name's
// reporters turn out to have different groups, every (rank, group id) among
// them is failed: its members held here, and those reported later by that
// rank, get an error response naming the mismatch at once, on every rank
// (a rank without the name ignores the error). The entry is dropped once each
// of the group's members was failed.
void Coordinator::ReleaseError(const std::string& name, const std::string& message) {
  ResponseMessage resp;
  resp.name = name;
  resp.error_code = StatusCode::kFailedPrecondition;
  resp.error_message = message;
  if (stall_ != nullptr) stall_->Remove(name);
  ready_.push_back(std::move(resp));
}

void Coordinator::FailGroupsOf(const Pending& p, const std::string& message) {
  const std::string why = "a member of a grouped collective whose groups differ across ranks: " + message;
  for (int r = 0; r < size_; ++r) {
    if (!p.reported[r] || p.by_rank[r].group_size <= 1) continue;
    FailedGroup& g = failed_groups_[{r, p.by_rank[r].group_id}];
    if (g.message.empty()) {
      g.message = why;
      g.left = p.by_rank[r].group_size - 1;  // this name was one of its members
    } else if (g.left > 0) {
      --g.left;
    }
    if (g.left == 0) failed_groups_.erase({r, p.by_rank[r].group_id});
  }
  // Names held here that some rank reported as a member of a failed group.
  std::vector<std::string> doomed;
  for (auto& [name, q] : table_)
    for (int r = 0; r < size_; ++r)
      if (q.reported[r] && q.by_rank[r].group_size > 1 &&
          failed_groups_.count({r, q.by_rank[r].group_id}) != 0) {
        doomed.push_back(name);
        break;
      }
  std::sort(doomed.begin(), doomed.end());  // deterministic release order
  for (const std::string& name : doomed) {
    auto it = table_.find(name);
    if (it == table_.end()) continue;
    const Pending q = it->second;
    table_.erase(it);
    std::string message_for;
    for (int r = 0; r < size_ && message_for.empty(); ++r) {
      if (!q.reported[r] || q.by_rank[r].group_size <= 1) continue;
      auto g = failed_groups_.find({r, q.by_rank[r].group_id});
      if (g != failed_groups_.end()) message_for = g->second.message;
    }
    ReleaseError(name, message_for);
    for (int r = 0; r < size_; ++r) {
      if (!q.reported[r] || q.by_rank[r].group_size <= 1) continue;
      auto g = failed_groups_.find({r, q.by_rank[r].group_id});
      if (g != failed_groups_.end() && g->second.left > 0 && --g->second.left == 0) failed_groups_.erase(g);
    }
  }
}

void Coordinator::AddRequest(int rank, RequestMessage request, double now) {
  if (request.group_size > 1 && !failed_groups_.empty()) {
    auto g = failed_groups_.find({rank, request.group_id});
    if (g != failed_groups_.end()) {  // Note [Groups that cannot run]
      const std::string message = g->second.message;
      if (g->second.left > 0 && --g->second.left == 0) failed_groups_.erase(g);
      auto held = table_.find(request.name);
      Pending others;
      if (held != table_.end()) {
        others = held->second;
        table_.erase(held);
      }
      ReleaseError(request.name, message);
      if (!others.by_rank.empty()) FailGroupsOf(others, message);
      return;
    }
  }
  if (stall_ != nullptr) stall_->RecordReport(request.name, rank, now);
  const bool join = request.type == CollectiveType::kJoin;
  if (join && !joined_[rank]) {
    joined_[rank] = true;
    ++joined_count_;
    last_joined_ = rank;
  }
  auto [it, inserted] = table_.try_emplace(request.name);
  Pending& p = it->second;
  if (inserted) {
    p.by_rank.resize(size_);
    p.reported.assign(size_, false);
  }
  if (!p.reported[rank]) {
    p.reported[rank] = true;
    ++p.count;
  }
  p.by_rank[rank] = std::move(request);
  if (!join) {
    if (Complete(p)) Finish(it);
    return;
  }
  // A new joined rank may complete names the others are waiting on (released
  // in name order, deterministic), then the join itself once everyone joined.
  const std::string join_name = it->first;
  std::vector<std::string> ready;
  for (auto& [name, q] : table_)
    if (name != join_name && q.count > 0 && Complete(q)) ready.push_back(name);
  std::sort(ready.begin(), ready.end());
  ready.push_back(join_name);
  for (const std::string& name : ready) {
    auto found = table_.find(name);
    if (found != table_.end() && Complete(found->second)) Finish(found);
  }
}

void Coordinator::Release(ResponseMessage response) {
  if (response.group_size <= 1) {
    ready_.push_back(std::move(response));
    return;
  }
  // Errors go out at once (their group can never run whole); successes wait
  // for the rest of the group. Both count towards the group's completion.
  const uint64_t id = response.group_id;
  const uint32_t group_size = response.group_size;
  HeldGroup& g = groups_[id];
  ++g.completed;
  if (response.ok()) g.held.push_back(std::move(response));
  else ready_.push_back(std::move(response));
  if (g.completed < group_size) return;
  for (ResponseMessage& m : g.held) ready_.push_back(std::move(m));
  groups_.erase(id);
}

void Coordinator::Forget(const std::string& name) {
  if (stall_ != nullptr) stall_->Remove(name);
  table_.erase(name);
}

std::vector<ResponseMessage> Coordinator::TakeReadyResponses() {
  std::vector<ResponseMessage> out;
  out.swap(ready_);
  return out;
}

std::vector<ResponseMessage> Coordinator::TakeStalledResponses(double now) {
  std::vector<ResponseMessage> out;
  if (stall_ == nullptr) return out;
  for (StallInspector::Stalled& s : stall_->Check(now)) {
    auto it = table_.find(s.name);
    if (it == table_.end()) continue;
    const RequestMessage* any = nullptr;
    for (int r = 0; r < size_ && any == nullptr; ++r)
      if (it->second.reported[r]) any = &it->second.by_rank[r];
    ResponseMessage resp;
    resp.name = s.name;
    resp.error_code = StatusCode::kDeadlineExceeded;
    resp.error_message = s.message;
    if (any != nullptr && any->group_size > 1) {
      auto g = groups_.find(any->group_id);
      if (g != groups_.end()) {
        for (ResponseMessage& m : g->second.held) {
          ResponseMessage member_err;
          member_err.name = m.name;
          member_err.error_code = StatusCode::kDeadlineExceeded;
          member_err.error_message = "member of a group with stalled tensor: " + s.message;
          out.push_back(std::move(member_err));
        }
        groups_.erase(g);
      }
    }
    table_.erase(it);
    out.push_back(std::move(resp));
  }
  return out;
}

}  // namespace nvgroup
