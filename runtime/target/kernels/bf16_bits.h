// bf16 values as their bits, for the kernels that convert one value at a time.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

// The fp32 value of bf16 bits (exact).
inline float widen(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// value rounded to bf16 (to nearest even, as Tensor.to), as fp32.
inline float round_bf16(float value) { return widen(at::BFloat16(value).x); }
