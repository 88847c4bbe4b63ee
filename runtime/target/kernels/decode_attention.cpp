// Attention of a few bf16 query rows (a decode step or a verified tree) over a bf16 KV cache, for CPUs.
//
// For the handful of query rows of a decode step, PyTorch's CPU SDPA spends its time on setup rather than
// arithmetic (scripts/bench_decode_ops.py measures both), and a target pass makes one call per layer. Here one task
// is a batch row's query heads that share a KV group (as many as fit in kMaxTaskRows rows), so each key and value is
// widened from bf16 once for all of them: scores against every visible key, a softmax, and the weighted sum of
// values, all in fp32 registers. Output is written as [B, T, H, D], the layout the attention module's output
// projection reads, so no transpose copy follows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#ifdef __AVX512BF16__
#include "avx512_round.h"
#endif

namespace {

constexpr int64_t kMaxRows = 16;  // query rows per call; longer passes (prefills) stay on SDPA
constexpr int64_t kMaxTaskRows = 64;  // query rows of one task: the rows of as many heads of a KV group as fit

inline __m256 widen8(const uint16_t* bits) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bits));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float horizontal_sum(__m256 v) {
  __m128 low = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  low = _mm_hadd_ps(low, low);
  low = _mm_hadd_ps(low, low);
  return _mm_cvtss_f32(low);
}

// One key's products with a query row [D], lane by lane: the first chunk multiplied, the others added in order.
template <int CHUNKS>
inline __m256 key_products(const uint16_t* key, const float* query) {
  __m256 acc = _mm256_mul_ps(widen8(key), _mm256_loadu_ps(query));
  for (int c = 1; c < CHUNKS; ++c) acc = _mm256_fmadd_ps(widen8(key + c * 8), _mm256_loadu_ps(query + c * 8), acc);
  return acc;
}

// The horizontal sums of a[0..7] as one vector [sum(a[0]), ..., sum(a[7])], each added in horizontal_sum's order
// ((v0 + v4) + (v1 + v5)) + ((v2 + v6) + (v3 + v7)), so a score is bit-identical either way.
inline __m256 horizontal_sums8(const __m256* a) {
  __m256 folded[4];
  for (int i = 0; i < 4; ++i) {
    folded[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                              _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
  }
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(folded[0], folded[1]), _mm256_hadd_ps(folded[2], folded[3]));
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // [a0 a2 a4 a6 a1 ...] -> order
}

// exp(x) for 8 floats with x <= 0 (scores minus their row maximum): the Cephes single-precision polynomial, within
// about 2 ulp of std::exp, and 0 below -87.
inline __m256 exp8(__m256 x) {
  const __m256 floor_x = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, floor_x, _CMP_LT_OQ);
  x = _mm256_max_ps(x, floor_x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(exponent)));
}

struct Strides {
  int64_t b, h, t;  // elements; the last dimension is contiguous
};

// One task: R query rows [D] (the rows of one or more query heads of a KV group; each row has its own query, mask
// and output pointers) attend to S keys/values of that group. Every key and value is widened from bf16 once per
// task and used by all R rows, so the heads that share a KV group (grouped-query attention) share its loads too.
// D = 8 * CHUNKS. Each row's arithmetic is the same whatever else shares its task.
template <int CHUNKS>
void attend_rows(const uint16_t* const* q_rows, const bool* const* mask_rows, int64_t ms_s, uint16_t* const* out_rows,
                 int64_t R, const uint16_t* k, const uint16_t* v, int64_t ks_t, int64_t vs_t, int64_t S, float scale,
                 float* scores) {
  constexpr int64_t D = CHUNKS * 8;
  float query[kMaxTaskRows][D];
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t d = 0; d < D; ++d) {
      uint32_t wide = static_cast<uint32_t>(q_rows[r][d]) << 16;
      std::memcpy(&query[r][d], &wide, sizeof(float));
      query[r][d] *= scale;
    }
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float row_max[kMaxTaskRows];
  // Scores of 8 keys at a time for one row: 8 independent FMA chains (one key's chain alone waits on each FMA's
  // latency), summed across lanes together.
  for (int64_t r = 0; r < R; ++r) {
    const bool* mask = mask_rows[r];
    float* row = scores + r * S;
    __m256 top = _mm256_set1_ps(neg_inf);
    int64_t s = 0;
    for (; s + 8 <= S; s += 8) {
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = key_products<CHUNKS>(k + (s + j) * ks_t, query[r]);
      __m256 block = horizontal_sums8(acc);
      if (mask != nullptr) {
        alignas(32) int32_t visible[8];
        for (int j = 0; j < 8; ++j) visible[j] = mask[(s + j) * ms_s] ? -1 : 0;
        block = _mm256_blendv_ps(_mm256_set1_ps(neg_inf), block,
                                 _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(visible))));
      }
      top = _mm256_max_ps(top, block);
      _mm256_storeu_ps(row + s, block);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    row_max[r] = *std::max_element(lanes, lanes + 8);
    for (; s < S; ++s) {
      float score = neg_inf;
      if (mask == nullptr || mask[s * ms_s]) {
        score = horizontal_sum(key_products<CHUNKS>(k + s * ks_t, query[r]));
        if (score > row_max[r]) row_max[r] = score;
      }
      row[s] = score;
    }
  }
  float inverse_sum[kMaxTaskRows];
  for (int64_t r = 0; r < R; ++r) {
    float* row = scores + r * S;
    if (row_max[r] == neg_inf) {  // a row that may attend to nothing: zero output, not NaN
      std::fill(row, row + S, 0.0f);
      inverse_sum[r] = 0.0f;
      continue;
    }
    const __m256 top = _mm256_set1_ps(row_max[r]);
    __m256 total = _mm256_setzero_ps();
    int64_t s = 0;
    for (; s + 8 <= S; s += 8) {
      __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + s), top));
      _mm256_storeu_ps(row + s, p);
      total = _mm256_add_ps(total, p);
    }
    float sum = horizontal_sum(total);
    for (; s < S; ++s) {
      row[s] = std::exp(row[s] - row_max[r]);
      sum += row[s];
    }
    inverse_sum[r] = 1.0f / sum;
  }
  auto store_row = [&](int64_t r, int c, __m256 acc) {
    alignas(32) float lane[8];
    _mm256_store_ps(lane, _mm256_mul_ps(acc, _mm256_set1_ps(inverse_sum[r])));
    uint16_t* dest = out_rows[r] + c * 8;
    for (int i = 0; i < 8; ++i) dest[i] = at::BFloat16(lane[i]).x;
  };
  for (int64_t r0 = 0; r0 < R; r0 += 8) {
    const int64_t rows = std::min<int64_t>(8, R - r0);
    if (rows < 4) {
      // Few rows: a row's chunks are its independent chains (rows as chains would wait on FMA latency).
      for (int64_t r = r0; r < r0 + rows; ++r) {
        for (int c0 = 0; c0 < CHUNKS; c0 += 8) {
          __m256 acc[8];
          for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
          for (int64_t s = 0; s < S; ++s) {
            const __m256 weight = _mm256_set1_ps(scores[r * S + s]);
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(weight, widen8(v + s * vs_t + (c0 + j) * 8), acc[j]);
          }
          for (int j = 0; j < 8; ++j) store_row(r, c0 + j, acc[j]);
        }
      }
      continue;
    }
    for (int c = 0; c < CHUNKS; ++c) {
      __m256 acc[8];
      for (int64_t r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t s = 0; s < S; ++s) {
        const __m256 value = widen8(v + s * vs_t + c * 8);
        for (int64_t r = 0; r < rows; ++r)
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scores[(r0 + r) * S + s]), value, acc[r]);
      }
      for (int64_t r = 0; r < rows; ++r) store_row(r0 + r, c, acc[r]);
    }
  }
}

#ifdef __AVX512BF16__
// The same task on CPUs with AVX512-BF16 (this file built a second time with those flags; runtime.target.kernels):
// a score is the dot product of the bf16 query and key rows with the dot-product instruction (32 exact products
// per instruction, summed in fp32), scaled after; the softmax and the weighted sum of fp32-widened values run
// 16 lanes wide. Scores of 16 keys come out of one transposing sum of 16 accumulators, so a key costs a few
// instructions per row rather than a widening and a chain of FMAs per row (scripts/bench_decode_ops.py).

// 16 accumulators' lane sums as one vector [sum(a[0]), ..., sum(a[15])]. Every accumulator's lanes are added in the
// same tree, so a score does not depend on the keys beside it.
inline __m512 horizontal_sums16(const __m512* a) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [A0+A2, B0+B2, A1+A3, B1+B3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of accumulators 4i .. 4i + 3
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}

// exp16: exp8's polynomial, 16 lanes.
inline __m512 exp16(__m512 x) {
  const __m512 floor_x = _mm512_set1_ps(-87.0f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, floor_x, _CMP_LT_OQ);
  x = _mm512_max_ps(x, floor_x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(~underflow, y, _mm512_castsi512_ps(exponent));
}

inline __m512 widen16(const uint16_t* bits) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}


// which of keys s .. s + count - 1 a row may attend to, as mask bits (all when the row has no mask)
inline __mmask16 visible_keys(const bool* mask, int64_t ms_s, int64_t s, int count) {
  const __mmask16 all = (__mmask16)((1u << count) - 1);
  if (mask == nullptr) return all;
  if (ms_s == 1 && count == 16)
    return _mm_test_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mask + s)), _mm_set1_epi8(-1));
  __mmask16 bits = 0;
  for (int j = 0; j < count; ++j) bits |= (mask[(s + j) * ms_s] ? 1u : 0u) << j;
  return bits;
}

// attend_rows with AVX512-BF16; PAIRS = D / 32 (one 512-bit load of a key or query row holds 32 bf16 values).
template <int PAIRS>
void attend_rows_bf16(const uint16_t* const* q_rows, const bool* const* mask_rows, int64_t ms_s,
                      uint16_t* const* out_rows, int64_t R, const uint16_t* k, const uint16_t* v, int64_t ks_t,
                      int64_t vs_t, int64_t S, float scale, float* scores) {
  constexpr int64_t D = PAIRS * 32;
  constexpr int kChunks = D / 16;  // fp32 vectors per value row
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 minus_infinity = _mm512_set1_ps(neg_inf);
  __m512 top[kMaxTaskRows];
  for (int64_t r = 0; r < R; ++r) top[r] = minus_infinity;
  // scores, 16 keys at a time for every row, the keys' block staying in L1 while the rows pass over it
  for (int64_t s = 0; s < S; s += 16) {
    const int count = static_cast<int>(std::min<int64_t>(16, S - s));
    for (int64_t r = 0; r < R; ++r) {
      __m512bh query[PAIRS];
      for (int p = 0; p < PAIRS; ++p) query[p] = (__m512bh)_mm512_loadu_si512(q_rows[r] + p * 32);
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_setzero_ps();
        if (j < count)
          for (int p = 0; p < PAIRS; ++p)
            acc[j] = _mm512_dpbf16_ps(acc[j], query[p], (__m512bh)_mm512_loadu_si512(k + (s + j) * ks_t + p * 32));
      }
      const __mmask16 visible = visible_keys(mask_rows[r], ms_s, s, count);
      const __m512 block = _mm512_mask_mul_ps(minus_infinity, visible, horizontal_sums16(acc), _mm512_set1_ps(scale));
      top[r] = _mm512_mask_max_ps(top[r], (__mmask16)((1u << count) - 1), top[r], block);
      _mm512_mask_storeu_ps(scores + r * S + s, (__mmask16)((1u << count) - 1), block);
    }
  }
  float inverse_sum[kMaxTaskRows];
  for (int64_t r = 0; r < R; ++r) {
    float* row = scores + r * S;
    const float row_max = _mm512_reduce_max_ps(top[r]);
    if (row_max == neg_inf) {  // a row that may attend to nothing: zero output, not NaN
      std::fill(row, row + S, 0.0f);
      inverse_sum[r] = 0.0f;
      continue;
    }
    const __m512 shift = _mm512_set1_ps(row_max);
    __m512 total = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; s += 16) {
      const __mmask16 lanes = (__mmask16)((1u << std::min<int64_t>(16, S - s)) - 1);
      const __m512 p = _mm512_maskz_mov_ps(lanes, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, row + s), shift)));
      _mm512_mask_storeu_ps(row + s, lanes, p);
      total = _mm512_add_ps(total, p);
    }
    inverse_sum[r] = 1.0f / _mm512_reduce_add_ps(total);
  }
  // the weighted sum of values, each value row widened once per block of rows
  constexpr int64_t kRowsPerBlock = 24 / kChunks;  // 24 accumulators
  for (int64_t r0 = 0; r0 < R; r0 += kRowsPerBlock) {
    const int64_t rows = std::min<int64_t>(kRowsPerBlock, R - r0);
    __m512 acc[kRowsPerBlock][kChunks];
    for (int64_t r = 0; r < rows; ++r)
      for (int c = 0; c < kChunks; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      __m512 value[kChunks];
      for (int c = 0; c < kChunks; ++c) value[c] = widen16(v + s * vs_t + c * 16);
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 weight = _mm512_set1_ps(scores[(r0 + r) * S + s]);
        for (int c = 0; c < kChunks; ++c) acc[r][c] = _mm512_fmadd_ps(weight, value[c], acc[r][c]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 norm = _mm512_set1_ps(inverse_sum[r0 + r]);
      for (int c = 0; c < kChunks; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_rows[r0 + r] + c * 16),
                            round_to_bf16(_mm512_mul_ps(acc[r][c], norm)));
    }
  }
}
#endif

}  // namespace

// query [B, H, T, D], key/value [B, Hkv, S, D] (bf16, last dimension contiguous, H a multiple of Hkv), mask
// [B or 1, 1, T, S] bool (True = may attend) or None (every key) -> [B, T, H, D] bf16 contiguous.
// With counts [B] (int64), the query rows come packed instead: query [1, H, T', D] holds batch row 0's counts[0]
// rows, then row 1's, ... (T' = sum(counts)), row b's t-th query reads the mask's row t of batch row b, and the output
// is [1, T', H, D] in the same order: rows of different lengths with nothing computed for padding.
torch::Tensor decode_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                               const c10::optional<torch::Tensor>& mask, double scale,
                               const c10::optional<torch::Tensor>& counts) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "expected 4D query, key and value");
  TORCH_CHECK(query.scalar_type() == torch::kBFloat16 && key.scalar_type() == torch::kBFloat16 &&
                  value.scalar_type() == torch::kBFloat16, "expected bfloat16 query, key and value");
  const bool packed = counts.has_value();
  const int64_t B = key.size(0), H = query.size(1), D = query.size(3);
  const int64_t Hkv = key.size(1), S = key.size(2);
  // each batch row's query rows and where they start along the query's row dimension
  std::vector<int64_t> rows_of(B, query.size(2)), start_of(B, 0);
  int64_t T = query.size(2);  // the most query rows of a batch row: the mask's rows
  if (packed) {
    const torch::Tensor given = counts->to(torch::kLong).contiguous();
    TORCH_CHECK(given.dim() == 1 && given.size(0) == B, "expected counts [B], one per batch row of key/value");
    TORCH_CHECK(query.size(0) == 1, "expected packed query rows [1, H, T', D] with counts");
    const int64_t* cp = given.data_ptr<int64_t>();
    int64_t total = 0;
    T = 0;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(cp[b] >= 1, "expected counts of at least 1");
      rows_of[b] = cp[b];
      start_of[b] = total;
      total += cp[b];
      T = std::max(T, cp[b]);
    }
    TORCH_CHECK(total == query.size(2), "counts must add up to the packed query rows");
  } else {
    TORCH_CHECK(query.size(0) == B, "key/value shapes do not match the query");
  }
  TORCH_CHECK((D == 64 || D == 128) && key.size(3) == D && value.size(3) == D, "expected head size 64 or 128");
  TORCH_CHECK(T >= 1 && T <= kMaxRows, "expected 1 to 16 query rows");
  TORCH_CHECK(value.size(0) == B && value.size(1) == Hkv && value.size(2) == S && H % Hkv == 0,
              "key/value shapes do not match the query");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1,
              "expected a contiguous last dimension");
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(), "expected CPU tensors");
  const bool* mp = nullptr;
  Strides ms{0, 0, 0};
  int64_t ms_s = 0;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->dim() == 4 && mask->size(2) == T && mask->size(3) == S &&
                    (mask->size(0) == B || mask->size(0) == 1) && mask->size(1) == 1,
                "expected a bool mask [B or 1, 1, T, S]");
    mp = mask->data_ptr<bool>();
    ms = {mask->size(0) == 1 ? 0 : mask->stride(0), 0, mask->stride(2)};
    ms_s = mask->stride(3);
  }
  auto out = packed ? torch::empty({1, query.size(2), H, D}, query.options()) : torch::empty({B, T, H, D},
                                                                                          query.options());
  const Strides qs{packed ? 0 : query.stride(0), query.stride(1), query.stride(2)};
  const Strides ks{key.stride(0), key.stride(1), key.stride(2)};
  const Strides vs{value.stride(0), value.stride(1), value.stride(2)};
  const auto* qp = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(key.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(value.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t group = H / Hkv;
  // heads per task: the most heads of a group whose rows fit in a task and divide the group evenly, while there are
  // still a few tasks per thread (a decode step of one row has only B * H of them to spread)
  const int64_t min_tasks = 4 * static_cast<int64_t>(at::get_num_threads());
  int64_t heads = 1;
  for (int64_t n = group; n >= 1; --n) {
    if (group % n == 0 && n * T <= kMaxTaskRows && B * (H / n) >= min_tasks) {
      heads = n;
      break;
    }
  }
  const int64_t tasks_per_row = H / heads;
  const float qk_scale = static_cast<float>(scale);
#ifdef __AVX512BF16__
  auto attend = D == 64 ? attend_rows_bf16<2> : attend_rows_bf16<4>;
#else
  auto attend = D == 64 ? attend_rows<8> : attend_rows<16>;
#endif
  at::parallel_for(0, B * tasks_per_row, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(heads * T * S);
    const uint16_t* q_rows[kMaxTaskRows];
    const bool* mask_rows[kMaxTaskRows];
    uint16_t* out_rows[kMaxTaskRows];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_row, first = (task % tasks_per_row) * heads, g = first / group;
      const int64_t rows = rows_of[b];
      for (int64_t i = 0; i < heads; ++i) {
        for (int64_t t = 0; t < rows; ++t) {
          const int64_t r = i * rows + t, h = first + i;
          const int64_t q_row = start_of[b] + t;  // along the query's row dimension
          q_rows[r] = qp + b * qs.b + h * qs.h + q_row * qs.t;
          mask_rows[r] = mp == nullptr ? nullptr : mp + b * ms.b + t * ms.t;
          out_rows[r] = op + ((packed ? q_row : b * T + t) * H + h) * D;
        }
      }
      attend(q_rows, mask_rows, ms_s, out_rows, heads * rows, kp + b * ks.b + g * ks.h, vp + b * vs.b + g * vs.h,
             ks.t, vs.t, S, qk_scale, scores.data());
    }
  });
  return out;
}

#ifndef HEADSTART_ONE_MODULE  // lean_layers.cpp's build links this source into its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "query [B, H, T, D] bf16 over key/value [B, Hkv, S, D] bf16 with a bool mask [B|1, 1, T, S] or None -> "
        "[B, T, H, D] bf16; with counts [B], query [1, H, sum(counts), D] packed -> [1, sum(counts), H, D]",
        pybind11::arg("query"), pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("mask"),
        pybind11::arg("scale"), pybind11::arg("counts") = pybind11::none());
}
#endif
