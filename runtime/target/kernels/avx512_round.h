// What the AVX512-BF16 kernels share: the rounding of fp32 results to bf16 in vector registers.
#pragma once

#include <immintrin.h>

// fp32 -> bf16 bits, round to nearest even and NaN -> 0x7FC0 (c10::BFloat16's conversion), 16 lanes at a time.
inline __m256i round_to_bf16(__m512 value) {
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}
