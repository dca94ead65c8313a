// Fuzz driver for the negotiation wire format (cc/engine/wire_format.h).
//
// How it works. Each iteration builds a random valid RequestList or
// ResponseList, encodes it and checks the round trip (decode(encode(x)) == x).
// Then it damages a copy -- truncation, bit flips, byte overwrites, inserted or
// deleted runs, a huge length planted at a random offset, or pure noise -- and
// hands it to both decoders. A decoder must either fail with kInternal
// "malformed negotiation message: ..." or succeed with messages that survive
// their own round trip. Built with -fsanitize=address,undefined and
// -fno-sanitize-recover, so an out-of-bounds read, an overflow or an absurd
// allocation ends the run with a report instead of passing silently.
//
//   fuzz_wire_format ITERATIONS SEED
// Prints one summary line; exits non-zero on the first violation.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/wire_format.h"

namespace nvgroup {
namespace {

using Bytes = std::vector<uint8_t>;

class Fuzzer {
 public:
  explicit Fuzzer(uint64_t seed) : rng_(seed) {}

  int Run(long iterations) {
    for (long i = 0; i < iterations; ++i) {
      const bool requests = Coin();
      Bytes valid = requests ? ValidRequests() : ValidResponses();
      if (!ok_) return Fail(i, "round trip of a valid message");
      Bytes damaged = Damage(valid);
      if (!CheckDecoders(damaged)) return Fail(i, "decoding damaged bytes");
    }
    std::printf("fuzz_wire_format: %ld iterations, %ld rejected as malformed, %ld decoded: OK\n", iterations,
                rejected_, accepted_);
    return 0;
  }

 private:
  bool Coin() { return rng_() & 1; }
  uint64_t Below(uint64_t n) { return n == 0 ? 0 : rng_() % n; }

  std::string Name() {
    std::string s(Below(24), '\0');
    for (char& c : s) c = static_cast<char>(Below(256));
    return s;
  }
  double Scale() {
    const double v[] = {1.0, 0.5, -2.0, 1e-300, 1e300, 0.0, -0.0, 3.25};
    return v[Below(8)];
  }
  std::vector<int64_t> Dims() {
    std::vector<int64_t> d(Below(5));
    for (int64_t& x : d) x = Coin() ? static_cast<int64_t>(Below(1000)) : static_cast<int64_t>(rng_());
    return d;
  }

  RequestMessage Request() {
    RequestMessage q;
    q.name = Name();
    q.type = static_cast<CollectiveType>(Below(kNumCollectiveTypes));
    q.dtype = static_cast<DataType>(Below(kNumDataTypes));
    q.device_kind = static_cast<DeviceKind>(Below(2));
    q.op = static_cast<ReduceOp>(Below(5));
    q.prescale_factor = Scale();
    q.postscale_factor = Scale();
    q.root_rank = static_cast<int32_t>(rng_());
    q.shape = Dims();
    q.group_id = Coin() ? 0 : rng_();
    q.group_size = static_cast<uint32_t>(Below(100));
    q.splits = Dims();
    q.refused_duplicate = Coin() ? std::string() : Name();
    return q;
  }

  ResponseMessage Response() {
    ResponseMessage r;
    RequestMessage q = Request();
    r.name = q.name;
    r.error_code = static_cast<StatusCode>(Below(8));
    r.error_message = Name();
    r.type = q.type;
    r.dtype = q.dtype;
    r.device_kind = q.device_kind;
    r.op = q.op;
    r.prescale_factor = q.prescale_factor;
    r.postscale_factor = q.postscale_factor;
    r.root_rank = q.root_rank;
    r.shape = q.shape;
    r.first_dims = Dims();
    r.group_id = q.group_id;
    r.group_size = q.group_size;
    return r;
  }

  Bytes ValidRequests() {
    std::vector<RequestMessage> in(Below(5));
    for (RequestMessage& q : in) q = Request();
    Bytes b = EncodeRequestList(in);
    std::vector<RequestMessage> out;
    ok_ = DecodeRequestList(b.data(), b.size(), &out).ok() && out == in;
    return b;
  }

  Bytes ValidResponses() {
    ResponseList in;
    in.fatal_code = Coin() ? StatusCode::kOk : static_cast<StatusCode>(Below(8));
    in.fatal_message = Name();
    in.responses.resize(Below(5));
    for (ResponseMessage& r : in.responses) r = Response();
    Bytes b = EncodeResponseList(in);
    ResponseList out;
    ok_ = DecodeResponseList(b.data(), b.size(), &out).ok() && out.fatal_code == in.fatal_code &&
          out.fatal_message == in.fatal_message && out.responses == in.responses;
    return b;
  }

  Bytes Damage(Bytes b) {
    switch (Below(7)) {
      case 0:  // truncation
        b.resize(Below(b.size()));
        break;
      case 1:  // bit flips
        for (uint64_t k = 1 + Below(8); k > 0 && !b.empty(); --k) b[Below(b.size())] ^= 1u << Below(8);
        break;
      case 2:  // byte overwrites
        for (uint64_t k = 1 + Below(4); k > 0 && !b.empty(); --k) b[Below(b.size())] = static_cast<uint8_t>(rng_());
        break;
      case 3: {  // inserted run
        Bytes run(1 + Below(16));
        for (uint8_t& x : run) x = static_cast<uint8_t>(rng_());
        b.insert(b.begin() + Below(b.size() + 1), run.begin(), run.end());
        break;
      }
      case 4: {  // deleted run
        if (b.empty()) break;
        size_t at = Below(b.size());
        b.erase(b.begin() + at, b.begin() + at + std::min<size_t>(b.size() - at, 1 + Below(16)));
        break;
      }
      case 5: {  // a huge (or just wrong) 32-bit length at a random offset
        if (b.size() < 4) break;
        const uint32_t v[] = {0xffffffffu, 0x7fffffffu, 0x10000000u, static_cast<uint32_t>(Below(64))};
        std::memcpy(&b[Below(b.size() - 3)], &v[Below(4)], 4);
        break;
      }
      default:  // noise
        b.assign(Below(200), 0);
        for (uint8_t& x : b) x = static_cast<uint8_t>(rng_());
    }
    return b;
  }

  // Both decoders, on the exact bytes (a copy of exactly b.size() bytes, so
  // ASan catches any read past the end).
  bool CheckDecoders(const Bytes& b) {
    std::unique_ptr<uint8_t[]> exact(new uint8_t[b.size() == 0 ? 1 : b.size()]);
    if (!b.empty()) std::memcpy(exact.get(), b.data(), b.size());
    std::vector<RequestMessage> qs;
    if (!Verdict(DecodeRequestList(exact.get(), b.size(), &qs))) return false;
    if (last_ok_) {
      Bytes again = EncodeRequestList(qs);
      std::vector<RequestMessage> qs2;
      if (!DecodeRequestList(again.data(), again.size(), &qs2).ok() || !SameRequests(qs, qs2)) return false;
    }
    ResponseList rl;
    if (!Verdict(DecodeResponseList(exact.get(), b.size(), &rl))) return false;
    if (last_ok_) {
      Bytes again = EncodeResponseList(rl);
      ResponseList rl2;
      if (!DecodeResponseList(again.data(), again.size(), &rl2).ok() || rl2.responses.size() != rl.responses.size())
        return false;
    }
    return true;
  }

  // NaN scale factors may appear in damaged input; compare them bitwise.
  static bool SameRequests(const std::vector<RequestMessage>& a, const std::vector<RequestMessage>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      RequestMessage x = a[i], y = b[i];
      if (std::memcmp(&x.prescale_factor, &y.prescale_factor, 8) != 0 ||
          std::memcmp(&x.postscale_factor, &y.postscale_factor, 8) != 0)
        return false;
      x.prescale_factor = y.prescale_factor = x.postscale_factor = y.postscale_factor = 0;
      if (!(x == y)) return false;
    }
    return true;
  }

  bool Verdict(const Status& s) {
    last_ok_ = s.ok();
    if (s.ok()) {
      ++accepted_;
      return true;
    }
    ++rejected_;
    if (s.code() == StatusCode::kInternal && s.message().rfind("malformed negotiation message: ", 0) == 0)
      return true;
    std::fprintf(stderr, "unclear error for malformed input: %s\n", s.ToString().c_str());
    return false;
  }

  int Fail(long iteration, const char* what) {
    std::fprintf(stderr, "fuzz_wire_format: FAILED at iteration %ld: %s\n", iteration, what);
    return 1;
  }

  std::mt19937_64 rng_;
  bool ok_ = true;
  bool last_ok_ = false;
  long rejected_ = 0;
  long accepted_ = 0;
};

}  // namespace
}  // namespace nvgroup

int main(int argc, char** argv) {
  const long iterations = argc > 1 ? std::atol(argv[1]) : 300000;
  const uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;
  return nvgroup::Fuzzer(seed).Run(iterations);
}
