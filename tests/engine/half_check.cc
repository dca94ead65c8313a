// Test driver for cc/cpu/half.h (built and run by tests/engine/test_half.py).
// Reads raw little-endian words from stdin and writes the converted words to
// stdout, so Python can compare every result with numpy's conversions.
//   half_check f2h    float32 in  -> float16 bits out   (FloatToHalf)
//   half_check h2f    float16 in  -> float32 bits out   (HalfToFloat)
//   half_check f2b    float32 in  -> bfloat16 bits out  (FloatToBFloat16)
//   half_check b2f    bfloat16 in -> float32 bits out   (BFloat16ToFloat)
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/half.h"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string mode = argv[1];
  const bool from_float = mode == "f2h" || mode == "f2b";
  std::vector<char> in;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), stdin)) > 0) in.insert(in.end(), buf, buf + n);
  if (from_float) {
    std::vector<uint16_t> out(in.size() / 4);
    for (size_t i = 0; i < out.size(); ++i) {
      float f;
      std::memcpy(&f, in.data() + 4 * i, 4);
      out[i] = mode == "f2h" ? nvgroup::FloatToHalf(f) : nvgroup::FloatToBFloat16(f);
    }
    std::fwrite(out.data(), 2, out.size(), stdout);
  } else if (mode == "h2f" || mode == "b2f") {
    std::vector<float> out(in.size() / 2);
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, in.data() + 2 * i, 2);
      out[i] = mode == "h2f" ? nvgroup::HalfToFloat(h) : nvgroup::BFloat16ToFloat(h);
    }
    std::fwrite(out.data(), 4, out.size(), stdout);
  } else {
    return 2;
  }
  return 0;
}
