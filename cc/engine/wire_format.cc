#include "engine/wire_format.h"

#include <cstring>

namespace nvgroup {
namespace {

constexpr uint32_t kMagic = 0x4e564752;  // "NVGR"
constexpr uint8_t kVersion = 3;  // 2: requests carry alltoall splits; 3: and refused duplicates
constexpr uint8_t kKindRequestList = 1;
constexpr uint8_t kKindResponseList = 2;

// Highest valid value of each enum (types.h / status.h; never renumbered).
constexpr uint8_t kMaxCollectiveType = kNumCollectiveTypes - 1;
constexpr uint8_t kMaxDataType = kNumDataTypes - 1;
constexpr uint8_t kMaxDeviceKind = static_cast<uint8_t>(DeviceKind::kCuda);
constexpr uint8_t kMaxReduceOp = static_cast<uint8_t>(ReduceOp::kProduct);
constexpr uint8_t kMaxStatusCode = static_cast<uint8_t>(StatusCode::kUnimplemented);

class Writer {
 public:
  void U8(uint8_t v) { buf_.push_back(v); }
  void U32(uint32_t v) { Raw(v); }
  void U64(uint64_t v) { Raw(v); }
  void I32(int32_t v) { U32(static_cast<uint32_t>(v)); }
  void F64(double v) {
    uint64_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    U64(bits);
  }
  void Str(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    buf_.insert(buf_.end(), s.begin(), s.end());
  }
  void I64Vec(const std::vector<int64_t>& v) {
    U32(static_cast<uint32_t>(v.size()));
    for (int64_t x : v) U64(static_cast<uint64_t>(x));
  }
  std::vector<uint8_t> Take() { return std::move(buf_); }

 private:
  template <typename T>
  void Raw(T v) {  // little-endian regardless of the host
    for (size_t i = 0; i < sizeof(T); ++i) buf_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  std::vector<uint8_t> buf_;
};

// Every read checks the bytes left; the first failure sticks and later reads
// return zeros, so decoders check `ok()` once per element.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), left_(size) {}

  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  size_t left() const { return left_; }
  void Fail(const std::string& what) {
    if (error_.empty()) error_ = what + " at byte " + std::to_string(pos_);
  }

  uint8_t U8(const char* what) { return static_cast<uint8_t>(Raw(1, what)); }
  uint32_t U32(const char* what) { return static_cast<uint32_t>(Raw(4, what)); }
  uint64_t U64(const char* what) { return Raw(8, what); }
  int32_t I32(const char* what) { return static_cast<int32_t>(U32(what)); }
  double F64(const char* what) {
    uint64_t bits = U64(what);
    double v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
  }
  uint8_t Enum(uint8_t max_value, const char* what) {
    uint8_t v = U8(what);
    if (ok() && v > max_value) Fail(std::string(what) + " value " + std::to_string(v) + " out of range");
    return ok() ? v : 0;
  }
  // Element count of a vector whose elements take at least `min_bytes` each.
  uint32_t Count(size_t min_bytes, const char* what) {
    uint32_t n = U32(what);
    if (ok() && static_cast<uint64_t>(n) * min_bytes > left_) {
      Fail(std::string(what) + " count " + std::to_string(n) + " exceeds the " + std::to_string(left_) +
           " bytes left");
      return 0;
    }
    return ok() ? n : 0;
  }
  std::string Str(const char* what) {
    uint32_t n = Count(1, what);
    if (!ok()) return std::string();
    std::string s(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    left_ -= n;
    return s;
  }
  std::vector<int64_t> I64Vec(const char* what) {
    uint32_t n = Count(8, what);
    std::vector<int64_t> v;
    v.reserve(n);
    for (uint32_t i = 0; i < n && ok(); ++i) v.push_back(static_cast<int64_t>(U64(what)));
    return v;
  }

 private:
  uint64_t Raw(size_t bytes, const char* what) {
    if (!ok()) return 0;
    if (left_ < bytes) {
      Fail(std::string("truncated ") + what);
      return 0;
    }
    uint64_t v = 0;
    for (size_t i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(data_[pos_ + i]) << (8 * i);
    pos_ += bytes;
    left_ -= bytes;
    return v;
  }

  const uint8_t* data_;
  size_t left_;
  size_t pos_ = 0;
  std::string error_;
};

// Smallest encoding of one request / response: empty strings and vectors.
constexpr size_t kMinRequestBytes = 4 + 4 + 16 + 4 + 4 + 8 + 4 + 4 + 4;
constexpr size_t kMinResponseBytes = 4 + 1 + 4 + 4 + 16 + 4 + 4 + 4 + 8 + 4;

void WriteHeader(Writer* w, uint8_t kind) {
  w->U32(kMagic);
  w->U8(kVersion);
  w->U8(kind);
}

void ReadHeader(Reader* r, uint8_t kind) {
  uint32_t magic = r->U32("magic");
  if (r->ok() && magic != kMagic) r->Fail("bad magic");
  uint8_t version = r->U8("version");
  if (r->ok() && version != kVersion) r->Fail("unsupported version " + std::to_string(version));
  uint8_t k = r->U8("kind");
  if (r->ok() && k != kind) r->Fail("wrong message kind " + std::to_string(k));
}

Status Finish(const Reader& r, const char* what) {
  if (!r.ok())
    return Status::Internal(std::string("malformed negotiation message: ") + what + ": " + r.error());
  if (r.left() != 0)
    return Status::Internal(std::string("malformed negotiation message: ") + what + ": " +
                            std::to_string(r.left()) + " trailing bytes");
  return Status::Ok();
}

}  // namespace

bool RequestMessage::operator==(const RequestMessage& o) const {
  return name == o.name && type == o.type && dtype == o.dtype && device_kind == o.device_kind && op == o.op &&
         prescale_factor == o.prescale_factor && postscale_factor == o.postscale_factor &&
         root_rank == o.root_rank && shape == o.shape && group_id == o.group_id &&
         group_size == o.group_size && splits == o.splits && refused_duplicate == o.refused_duplicate;
}

bool ResponseMessage::operator==(const ResponseMessage& o) const {
  return name == o.name && error_code == o.error_code && error_message == o.error_message && type == o.type &&
         dtype == o.dtype && device_kind == o.device_kind && op == o.op &&
         prescale_factor == o.prescale_factor && postscale_factor == o.postscale_factor &&
         root_rank == o.root_rank && shape == o.shape && first_dims == o.first_dims &&
         group_id == o.group_id && group_size == o.group_size;
}

std::vector<uint8_t> EncodeRequestList(const std::vector<RequestMessage>& requests) {
  Writer w;
  WriteHeader(&w, kKindRequestList);
  w.U32(static_cast<uint32_t>(requests.size()));
  for (const RequestMessage& q : requests) {
    w.Str(q.name);
    w.U8(static_cast<uint8_t>(q.type));
    w.U8(static_cast<uint8_t>(q.dtype));
    w.U8(static_cast<uint8_t>(q.device_kind));
    w.U8(static_cast<uint8_t>(q.op));
    w.F64(q.prescale_factor);
    w.F64(q.postscale_factor);
    w.I32(q.root_rank);
    w.I64Vec(q.shape);
    w.U64(q.group_id);
    w.U32(q.group_size);
    w.I64Vec(q.splits);
    w.Str(q.refused_duplicate);
  }
  return w.Take();
}

Status DecodeRequestList(const uint8_t* data, size_t size, std::vector<RequestMessage>* out) {
  out->clear();
  Reader r(data, size);
  ReadHeader(&r, kKindRequestList);
  uint32_t n = r.Count(kMinRequestBytes, "request count");
  for (uint32_t i = 0; i < n && r.ok(); ++i) {
    RequestMessage q;
    q.name = r.Str("request name");
    q.type = static_cast<CollectiveType>(r.Enum(kMaxCollectiveType, "collective type"));
    q.dtype = static_cast<DataType>(r.Enum(kMaxDataType, "dtype"));
    q.device_kind = static_cast<DeviceKind>(r.Enum(kMaxDeviceKind, "device kind"));
    q.op = static_cast<ReduceOp>(r.Enum(kMaxReduceOp, "reduce op"));
    q.prescale_factor = r.F64("prescale factor");
    q.postscale_factor = r.F64("postscale factor");
    q.root_rank = r.I32("root rank");
    q.shape = r.I64Vec("shape");
    q.group_id = r.U64("group id");
    q.group_size = r.U32("group size");
    q.splits = r.I64Vec("splits");
    q.refused_duplicate = r.Str("refused duplicate");
    if (r.ok()) out->push_back(std::move(q));
  }
  Status s = Finish(r, "request list");
  if (!s.ok()) out->clear();
  return s;
}

std::vector<uint8_t> EncodeResponseList(const ResponseList& list) {
  Writer w;
  WriteHeader(&w, kKindResponseList);
  w.U8(static_cast<uint8_t>(list.fatal_code));
  w.Str(list.fatal_message);
  w.U32(static_cast<uint32_t>(list.responses.size()));
  for (const ResponseMessage& p : list.responses) {
    w.Str(p.name);
    w.U8(static_cast<uint8_t>(p.error_code));
    w.Str(p.error_message);
    w.U8(static_cast<uint8_t>(p.type));
    w.U8(static_cast<uint8_t>(p.dtype));
    w.U8(static_cast<uint8_t>(p.device_kind));
    w.U8(static_cast<uint8_t>(p.op));
    w.F64(p.prescale_factor);
    w.F64(p.postscale_factor);
    w.I32(p.root_rank);
    w.I64Vec(p.shape);
    w.I64Vec(p.first_dims);
    w.U64(p.group_id);
    w.U32(p.group_size);
  }
  return w.Take();
}

Status DecodeResponseList(const uint8_t* data, size_t size, ResponseList* out) {
  *out = ResponseList();
  Reader r(data, size);
  ReadHeader(&r, kKindResponseList);
  out->fatal_code = static_cast<StatusCode>(r.Enum(kMaxStatusCode, "fatal code"));
  out->fatal_message = r.Str("fatal message");
  uint32_t n = r.Count(kMinResponseBytes, "response count");
  for (uint32_t i = 0; i < n && r.ok(); ++i) {
    ResponseMessage p;
    p.name = r.Str("response name");
    p.error_code = static_cast<StatusCode>(r.Enum(kMaxStatusCode, "error code"));
    p.error_message = r.Str("error message");
    p.type = static_cast<CollectiveType>(r.Enum(kMaxCollectiveType, "collective type"));
    p.dtype = static_cast<DataType>(r.Enum(kMaxDataType, "dtype"));
    p.device_kind = static_cast<DeviceKind>(r.Enum(kMaxDeviceKind, "device kind"));
    p.op = static_cast<ReduceOp>(r.Enum(kMaxReduceOp, "reduce op"));
    p.prescale_factor = r.F64("prescale factor");
    p.postscale_factor = r.F64("postscale factor");
    p.root_rank = r.I32("root rank");
    p.shape = r.I64Vec("shape");
    p.first_dims = r.I64Vec("first dims");
    p.group_id = r.U64("group id");
    p.group_size = r.U32("group size");
    if (r.ok()) out->responses.push_back(std::move(p));
  }
  Status s = Finish(r, "response list");
  if (!s.ok()) *out = ResponseList();
  return s;
}

}  // namespace nvgroup
