// Negotiation (negotiation.h): admission of entries and refusals, the cache
// bits, taking the agreed cache hits, the negotiation round through rank 0,
// and join's stand-ins.
#include "engine/negotiation.h"

#include <algorithm>

#include "common/checks.h"
#include "engine/wire_format.h"

namespace nvgroup {

namespace {

bool StandInPossible(const ResponseMessage& r) {
  return r.ok() && r.device_kind == DeviceKind::kCpu &&
         (r.type == CollectiveType::kAllreduce || r.type == CollectiveType::kReducescatter);
}

}  // namespace

Negotiation::Negotiation(const Knobs& knobs, MPI_Comm comm, int rank, int size,
                         const std::atomic<bool>& abort, EngineCounters* counters, Timeline* timeline)
    : comm_(comm),
      rank_(rank),
      size_(size),
      peer_timeout_s_(knobs.peer_timeout_s),
      abort_(abort),
      counters_(counters),
      timeline_(timeline),
      cache_(knobs.cache_capacity),
      cache_words_((knobs.cache_capacity + 63) / 64),
      claimed_slots_(std::max(knobs.cache_capacity, 0), 0),
      stall_(size, knobs.stall_warning_s, knobs.stall_shutdown_s),
      coordinator_(size, &stall_) {
  // See Note [Reporting stuck cache hits].
  report_cached_after_s_ = 1.0;
  if (knobs.stall_warning_s > 0)
    report_cached_after_s_ = std::min(report_cached_after_s_, knobs.stall_warning_s / 2);
  if (knobs.stall_shutdown_s > 0)
    report_cached_after_s_ = std::min(report_cached_after_s_, knobs.stall_shutdown_s / 2);
}

void TimelineAdmitted(Timeline* timeline, const TensorEntry& entry, double now) {
  timeline->Begin(entry.request.name, "QUEUE", entry.enqueue_time);
  timeline->End(entry.request.name, "QUEUE", now);
  timeline->Begin(entry.request.name, "NEGOTIATE", now);
}

void Negotiation::Admit(TensorEntry&& entry, double now) {
  if (timeline_->enabled()) TimelineAdmitted(timeline_, entry, now);
  if (entry.request.type == CollectiveType::kJoin) joined_ = true;
  // Note [Refused duplicates]: after a refusal of its name (a cached group's
  // entries came before any refusal: CachedGroups::Admit).
  const bool held = !refusals_.empty() && refusals_.count(entry.request.name) != 0;
  AddPending(std::move(entry), now);
  if (held) order_.back()->held = true;
}

void Negotiation::AddRefusal(const Submission& refusal) {
  for (const std::string& name : refusal.refused_names)
    refusals_[name].unreported.push_back(refusal.refused_duplicate);
}

bool Negotiation::RefusedAnyName(const Submission& s) const {
  bool after_refusal = false;
  for (size_t i = 0; i < s.entries.size() && !refusals_.empty() && !after_refusal; ++i)
    after_refusal = refusals_.count(s.entries[i].request.name) != 0;
  return after_refusal;
}

bool Negotiation::RefusalDue(const std::string& name) const {
  auto r = refusals_.find(name);
  if (r == refusals_.end() || r->second.reported || r->second.unreported.empty()) return false;
  // Not before this rank's request of that name that came before it (held
  // ones came after it).
  auto p = pending_.find(name);
  return p == pending_.end() || p->second->held;
}

bool Negotiation::AnyRefusalDue() const {
  for (const auto& [name, r] : refusals_)
    if (RefusalDue(name)) return true;
  return false;
}

bool Negotiation::TakeRefusalAnswer(const ResponseMessage& r) {
  auto it = refusals_.find(r.name);
  if (it == refusals_.end() || !it->second.reported) return false;
  it->second.reported = false;
  if (it->second.unreported.empty()) {
    refusals_.erase(it);
    auto p = pending_.find(r.name);
    if (p != pending_.end()) p->second->held = false;  // reported or cached from the next cycle on
  }
  return true;
}

void Negotiation::AddPending(TensorEntry&& entry, double since) {
  EngineCounters::Add(counters_->admitted_entries);
  auto p = std::make_unique<Pending>(std::move(entry), since);
  order_.push_back(p.get());
  const std::string& name = p->entry.request.name;
  pending_.emplace(name, std::move(p));  // names in flight are unique (TensorQueue::Push)
}

void Negotiation::DropTaken() {
  order_.erase(std::remove_if(order_.begin(), order_.end(), [](const Pending* p) { return p->taken; }),
               order_.end());
}

bool Negotiation::FillCacheBits(double now, std::vector<uint64_t>* bits) {
  std::vector<int> slots(order_.size(), -1);
  const std::vector<Pending*>& entries = order_;
  std::unordered_map<uint64_t, uint32_t> group_hits;
  for (size_t i = 0; i < order_.size(); ++i) {
    if (entries[i]->held) continue;  // Note [Refused duplicates]: no bit, no report
    const RequestMessage& m = entries[i]->entry.message;
    int slot = cache_.Find(entries[i]->entry.request.name);
    if (slot >= 0 && EntryMatchesResponse(entries[i]->entry, cache_.Get(slot), rank_)) {
      slots[i] = slot;
      if (m.group_id != 0) ++group_hits[m.group_id];
    }
  }
  bool must_report = false;
  for (size_t i = 0; i < order_.size(); ++i) {
    Pending* p = entries[i];
    const RequestMessage& m = p->entry.message;
    // A group hits the cache whole or not at all (all its members arrive in
    // the same cycle: TensorQueue::Push is atomic).
    if (slots[i] >= 0 && m.group_id != 0 &&
        (group_hits[m.group_id] != m.group_size ||
         cache_.GroupCount(m.group_id) != static_cast<int>(m.group_size)))
      slots[i] = -1;
    if (slots[i] >= 0) (*bits)[1 + slots[i] / 64] |= uint64_t{1} << (slots[i] % 64);
    if (!p->reported && !p->held && (slots[i] < 0 || now - p->since >= report_cached_after_s_))
      must_report = true;
  }
  if (!refusals_.empty() && AnyRefusalDue()) must_report = true;
  if (joined_) SetJoinedCacheBits(bits);
  return must_report;
}

bool Negotiation::TakeStalledResponses(double now) {
  for (ResponseMessage& r : coordinator_.TakeStalledResponses(now)) stalled_.push_back(std::move(r));
  return !stalled_.empty();
}

std::vector<Work> Negotiation::TakeCacheHits(const std::vector<uint64_t>& bits) {
  std::vector<int> hits;
  std::unordered_map<uint64_t, uint32_t> group_hits;
  for (int word = 0; word < cache_words_; ++word) {
    for (uint64_t b = bits[1 + word]; b != 0; b &= b - 1) {
      const int slot = word * 64 + __builtin_ctzll(b);
      hits.push_back(slot);
      if (!claimed_slots_[slot] && cache_.Get(slot).group_id != 0) ++group_hits[cache_.Get(slot).group_id];
    }
  }
  const bool forget = rank_ == 0 && coordinator_.HoldsReports();
  std::vector<Work> work;
  for (int slot : hits) {
    const ResponseMessage& r = cache_.Get(slot);
    if (claimed_slots_[slot]) {  // a member of a ready cached group (CachedGroups::RunPlans runs it)
      claimed_slots_[slot] = 0;
      cache_.Touch(slot);  // in slot order with the other hits: the LRU stays the same on every rank
      if (forget) coordinator_.Forget(r.name);
      continue;
    }
    if (r.group_id != 0 && group_hits[r.group_id] != r.group_size) continue;
    Work w;
    w.response = &r;
    w.slot = slot;
    auto it = pending_.find(r.name);
    if (it != pending_.end()) {
      w.pending = std::move(it->second);  // the bit is set only for pending names...
      w.pending->taken = true;
      pending_.erase(it);
    } else {
      w.pending = MakeJoinStandIn(r);  // ...or, on a joined rank, for stand-ins
    }
    cache_.Touch(slot);
    if (forget) coordinator_.Forget(r.name);
    work.push_back(std::move(w));
  }
  DropTaken();
  return work;
}

Status Negotiation::Round(double now, uint64_t cycle, std::vector<Work>* work) {
  Status s = Negotiate(now, cycle, work);
  DropTaken();
  return s;
}

Status Negotiation::Negotiate(double now, uint64_t cycle, std::vector<Work>* work) {
  std::vector<RequestMessage> mine;
  for (Pending* p : order_) {  // the cycle's cache hits left order_ (DropTaken)
    if (p->reported || p->held) continue;
    p->reported = true;
    mine.push_back(p->entry.Report());
  }
  // Note [Refused duplicates]: the refusals due, after this cycle's demotions
  // and cache hits (a request ahead of a refusal is in pending_ by now).
  for (auto& [name, refusal] : refusals_) {
    if (!RefusalDue(name)) continue;
    RequestMessage& m = mine.emplace_back();
    m.name = name;
    m.refused_duplicate = std::move(refusal.unreported.front());
    refusal.unreported.pop_front();
    refusal.reported = true;
  }
  CycleBuffers& b = *mpi_buffers_;
  b.request_bytes = EncodeRequestList(mine);

  // Gather every rank's request list at rank 0: lengths, then bytes. Orders
  // rank 0's decision after every rank's report of this cycle.
  b.my_length = static_cast<int>(b.request_bytes.size());
  b.lengths.assign(rank_ == 0 ? size_ : 1, 0);
  b.displs.assign(rank_ == 0 ? size_ : 1, 0);
  MPI_Request req;
  NVG_MPI_CHECK(MPI_Igather(&b.my_length, 1, MPI_INT, b.lengths.data(), 1, MPI_INT, 0, comm_, &req));
  NVG_RETURN_IF_ERROR(Wait(&req, "the request-length gather of the negotiation round", cycle));
  size_t total = 0;
  if (rank_ == 0) {
    for (int r = 0; r < size_; ++r) {
      b.displs[r] = static_cast<int>(total);
      total += b.lengths[r];
    }
  }
  b.gathered.resize(std::max<size_t>(total, 1));
  NVG_MPI_CHECK(MPI_Igatherv(b.request_bytes.data(), b.my_length, MPI_BYTE, b.gathered.data(),
                             b.lengths.data(), b.displs.data(), MPI_BYTE, 0, comm_, &req));
  NVG_RETURN_IF_ERROR(Wait(&req, "the request gather of the negotiation round", cycle));

  // Rank 0 decides; everyone receives the same response list. The broadcast
  // orders every rank's execution (and cache update) after rank 0's decision,
  // so all ranks execute and cache the same responses in the same order.
  ResponseList list;
  if (rank_ == 0) {
    for (int r = 0; r < size_ && list.fatal_code == StatusCode::kOk; ++r) {
      std::vector<RequestMessage> requests;
      Status s = DecodeRequestList(b.gathered.data() + b.displs[r], b.lengths[r], &requests);
      if (!s.ok()) {
        list.fatal_code = s.code();
        list.fatal_message = "rank 0 could not read rank " + std::to_string(r) +
                             "'s requests: " + s.message();
        break;
      }
      for (RequestMessage& q : requests) coordinator_.AddRequest(r, std::move(q), now);
    }
    list.responses = std::move(stalled_);
    stalled_.clear();
    for (ResponseMessage& r : coordinator_.TakeReadyResponses()) list.responses.push_back(std::move(r));
    b.response_bytes = EncodeResponseList(list);
  }
  b.response_length = b.response_bytes.size();
  NVG_MPI_CHECK(MPI_Ibcast(&b.response_length, 1, MPI_UINT64_T, 0, comm_, &req));
  NVG_RETURN_IF_ERROR(Wait(&req, "the response-length broadcast of the negotiation round", cycle));
  if (rank_ != 0) b.response_bytes.resize(b.response_length);
  NVG_MPI_CHECK(MPI_Ibcast(b.response_bytes.data(), static_cast<int>(b.response_length), MPI_BYTE, 0, comm_,
                           &req));
  NVG_RETURN_IF_ERROR(Wait(&req, "the response broadcast of the negotiation round", cycle));
  if (rank_ != 0)
    NVG_RETURN_IF_ERROR(DecodeResponseList(b.response_bytes.data(), b.response_bytes.size(), &list));
  if (list.fatal_code != StatusCode::kOk) return Status(list.fatal_code, list.fatal_message);

  for (ResponseMessage& r : list.responses) {
    if (!refusals_.empty() && TakeRefusalAnswer(r)) {  // Note [Refused duplicates]
      if (r.ok())
        return Status::Internal("rank 0 released '" + r.name +
                                "', whose collective this rank refused as a "
                                "duplicate, as a success");
      continue;
    }
    if (r.ok() && r.type != CollectiveType::kJoin) cache_.Put(r);  // a join's answer changes
    Work w;
    auto it = pending_.find(r.name);
    if (it != pending_.end()) {
      w.pending = std::move(it->second);
      w.pending->taken = true;
      pending_.erase(it);
    } else if (r.ok() && joined_) {
      w.pending = MakeJoinStandIn(r);  // rank 0 counted this joined rank in
      if (w.pending == nullptr)
        return Status::Internal("rank 0 released '" + r.name + "' to joined rank " + std::to_string(rank_) +
                                ", which cannot stand in for a " + CollectiveTypeName(r.type));
    } else if (r.ok()) {
      return Status::Internal("rank 0 released '" + r.name + "', which this rank never submitted");
    }
    w.owned = std::make_unique<ResponseMessage>(std::move(r));
    w.response = w.owned.get();
    work->push_back(std::move(w));
  }
  return Status::Ok();
}

std::unique_ptr<Pending> Negotiation::MakeJoinStandIn(const ResponseMessage& r) {
  if (!joined_ || !StandInPossible(r)) return nullptr;
  const size_t bytes = static_cast<size_t>(NumElements(r.shape)) * DataTypeSize(r.dtype);
  // Zeros in; the output (allreduce: in place; reducescatter: its own buffer)
  // is discarded. The buffers live as long as the request's callbacks.
  auto zeros = std::make_shared<std::vector<char>>(std::max<size_t>(bytes, 1), 0);
  auto p = std::make_unique<Pending>();
  p->reported = true;
  p->since = MonotonicSeconds();
  CollectiveRequest& q = p->entry.request;
  q.name = r.name;
  q.type = r.type;
  q.dtype = r.dtype;
  q.device = Device::Cpu();
  q.shape = r.shape;
  q.input = zeros->data();
  q.output = zeros->data();
  q.op = r.op;
  q.prescale_factor = r.prescale_factor;
  q.postscale_factor = r.postscale_factor;
  if (r.type == CollectiveType::kReducescatter) {
    auto out = std::make_shared<std::vector<char>>();
    const size_t esize = DataTypeSize(r.dtype);
    q.allocate_output = [out, esize](const std::vector<int64_t>& shape, void** ptr) -> Status {
      out->assign(std::max<size_t>(static_cast<size_t>(NumElements(shape)) * esize, 1), 0);
      *ptr = out->data();
      return Status::Ok();
    };
  }
  q.done = [zeros](const Status&) {};
  p->entry.message.type = r.type;
  return p;
}

void Negotiation::SetJoinedCacheBits(std::vector<uint64_t>* bits) {
  for (int slot = 0; slot < cache_.capacity(); ++slot) {
    const ResponseMessage& c = cache_.Get(slot);
    // Not for a name this rank refused and rank 0 has not answered (Note
    // [Refused duplicates] in coordinator.h): the refusal stands in for it.
    if (c.name.empty() || !StandInPossible(c) || pending_.count(c.name) || refusals_.count(c.name)) continue;
    (*bits)[1 + slot / 64] |= uint64_t{1} << (slot % 64);
  }
}

}  // namespace nvgroup
