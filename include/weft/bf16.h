// weft/bf16.h — bfloat16 on the host: the top 16 bits of an fp32.
//
// DType::BF16 tensors store these as uint16_t. Conversion rounds to nearest,
// ties to even (CUDA's __float2bfloat16_rn; any NaN becomes 0x7fff), so a
// host reduction and a device one agree bit for bit.
//
//   uint16_t h = to_bf16(1.0f / 3.0f);   // 0x3eab
//   float x = bf16_to_float(h);          // 0.333984375
#pragma once

#include <bit>
#include <cstdint>

namespace weft {

inline uint16_t to_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  // Adding 0x7fff, plus one more when the kept part is odd, carries into the
  // kept bits exactly when the dropped part is above half, or half with odd kept bits.
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_to_float(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

// The bf16 sum of two bf16 values: added in fp32, rounded once. That is the
// correctly rounded sum: two bf16 values whose exponents differ by 15 or less
// add exactly in fp32 (8 + 15 + 1 bits fit in 24); with a larger gap the
// smaller one is below 1/256 of the larger one's bf16 ulp, so the sum, fp32
// rounding included, stays far from a bf16 rounding boundary.
inline uint16_t bf16_add(uint16_t a, uint16_t b) {
  return to_bf16(bf16_to_float(a) + bf16_to_float(b));
}

// x rounded to the nearest bf16, as an fp32.
inline float round_to_bf16(float x) { return bf16_to_float(to_bf16(x)); }

inline void to_bf16(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = to_bf16(x[i]);
}

inline void bf16_to_float(const uint16_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_float(x[i]);
}

}  // namespace weft
