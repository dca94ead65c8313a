// IEEE 754 binary16 ("half") and bfloat16 <-> float32 conversions on the host.
//
// The one copy of these conversions in the engine: host reductions
// (cc/cpu/host_reduce.cc), host scaled copies and the engine's CPU paths all
// use them. Do not duplicate them elsewhere.
//
// How it works. Both formats are bit manipulations of the float32 encoding
// (sign | 8-bit exponent, bias 127 | 23-bit mantissa):
//  * binary16 is sign | 5-bit exponent (bias 15) | 10-bit mantissa. Widening is
//    exact (subnormal halves become normal floats). Narrowing rounds to nearest,
//    ties to even (IEEE default), overflows to +-inf (anything >= 65520 after
//    rounding), produces half subnormals below 2^-14 and keeps NaN a NaN (quiet
//    bit set, top 9 payload bits kept, sign kept).
//  * bfloat16 is the top 16 bits of a float32. Widening appends 16 zero bits.
//    Narrowing rounds to nearest even by adding 0x7fff + (lsb of the result)
//    before truncating; NaN is handled first so rounding cannot turn a NaN
//    whose payload sits in the low bits into inf.
#pragma once

#include <cstdint>
#include <cstring>

namespace nvgroup {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));  // inf/NaN
  if (exponent != 0) return BitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return BitsToFloat(sign);  // +-0
  // Subnormal half m * 2^-24: shift the leading 1 up to the implicit-bit position
  // (bit 10); each shift lowers the float exponent by one from 2^-14 (biased 113).
  uint32_t shift = 0;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    ++shift;
  }
  return BitsToFloat(sign | ((113 - shift) << 23) | ((mantissa & 0x3ffu) << 13));
}

inline uint16_t FloatToHalf(float f) {
  const uint32_t x = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u)  // NaN: force the quiet bit so a payload in the low bits stays NaN
    return sign | 0x7e00u | static_cast<uint16_t>((a >> 13) & 0x3ffu);
  if (a >= 0x47800000u) return sign | 0x7c00u;  // >= 2^16 (or inf): beyond the largest finite half
  if (a >= 0x38800000u) {
    // Normal half (>= 2^-14): rebias the exponent (127 -> 15, i.e. subtract 112 << 23)
    // and drop 13 mantissa bits with round-to-nearest-even. A carry out of the
    // mantissa correctly bumps the exponent, up to 0x7c00 (inf) for >= 65520.
    uint32_t h = (a - 0x38000000u) >> 13;
    const uint32_t rest = a & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
    return sign | static_cast<uint16_t>(h);
  }
  if (a < 0x33000000u) return sign;  // below 2^-25 rounds to +-0 (2^-25 itself ties to even 0 below)
  // Half subnormal: value = m * 2^(e-150) with the 24-bit significand m, in units of
  // 2^-24 that is m >> (126 - e). e is in [102, 112], so the shift is in [14, 24].
  const uint32_t e = a >> 23;
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - e;
  uint32_t h = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1);
  const uint32_t halfway = 1u << (shift - 1);
  if (rest > halfway || (rest == halfway && (h & 1u))) ++h;  // may carry into the smallest normal
  return sign | static_cast<uint16_t>(h);
}

inline float BFloat16ToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

inline uint16_t FloatToBFloat16(float f) {
  const uint32_t x = FloatBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u)  // NaN: keep sign and top payload, force the quiet bit
    return static_cast<uint16_t>((x >> 16) | 0x0040u);
  const uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);  // a carry may reach inf: correct
}

}  // namespace nvgroup
