// Which rows of a bf16 weight (a vocabulary projection) can hold the largest output of each input row, from an int8
// copy of the weight that is half its size, with a bound that makes the answer certain.
//
// Greedy decoding needs only the first index of each row's largest logit, and on a CPU the vocabulary projection
// reads a quarter of a small model's weights per pass. Here each output is estimated from int8 weights (one scale
// per weight row) and each input row as two int8 rows (its rounding and the residual's, a scale each) with
// AVX512-VNNI's exact integer dot products, and given
// a bound on its distance from what the bf16 kernels compute (their fp32 sum of the exact bf16 products):
//   |sum - estimate| <= |x| (|w - s q| + gamma_K |w|) + s |q| |x - s_x x_q - s_r r_q| + rounding of the estimate
// (Cauchy-Schwarz on the weight's and the input's quantisation errors; gamma_K bounds any order of K fp32 additions).
// A row whose upper bound, rounded to bf16, falls below the largest lower bound rounded to bf16 cannot be the argmax
// (rounding to bf16 is monotone), so the argmax is among the rest; runtime.target.kernels.int8_argmax computes their
// outputs exactly with the same bf16 kernel and takes the first largest.
// Built only on CPUs that report AVX512-BF16 and AVX512-VNNI (runtime.target.kernels).
#include <torch/extension.h>

#include "bf16_bits.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kCols = 16;     // weight rows per packed block: one int32 lane each
constexpr int64_t kMaxRows = 16;  // input rows per call
constexpr int64_t kMaxDots = 2 * kMaxRows;  // each input row goes as two int8 rows: its rounding and the residual

// The largest bf16 value (as fp32) strictly below the rounding of `value` to bf16 (to nearest even): a value at or
// below it rounds to less than `value` does.
inline float bf16_below(float value) {
  const uint16_t bits = at::BFloat16(value).x;
  const float rounded = widen(bits);
  if (rounded == 0.0f) return widen(0x8001);  // the negative bf16 nearest to zero
  if (std::isinf(rounded) && rounded < 0) return -std::numeric_limits<float>::infinity();
  return widen(static_cast<uint16_t>(rounded > 0 ? bits - 1 : bits + 1));
}

// The integer dot products of one packed block (16 weight rows) with ROWS offset input rows (rows of 4 * quads bytes),
// in CHAINS independent accumulators per row (integer sums: any split is exact) so one row is not bound by the
// instruction's latency.
template <int ROWS, int CHAINS>
void block_dots(const int8_t* block, int64_t quads, const uint8_t* xq, __m512i* dots) {
  __m512i acc[ROWS][CHAINS];
  for (int m = 0; m < ROWS; ++m)
    for (int c = 0; c < CHAINS; ++c) acc[m][c] = _mm512_setzero_si512();
  int64_t p = 0;
  for (; p + CHAINS <= quads; p += CHAINS) {
    for (int c = 0; c < CHAINS; ++c) {
      const __m512i w = _mm512_loadu_si512(block + (p + c) * 4 * kCols);
      for (int m = 0; m < ROWS; ++m) {
        int32_t four;
        std::memcpy(&four, xq + m * quads * 4 + 4 * (p + c), sizeof(four));
        acc[m][c] = _mm512_dpbusd_epi32(acc[m][c], _mm512_set1_epi32(four), w);
      }
    }
  }
  for (; p < quads; ++p) {
    const __m512i w = _mm512_loadu_si512(block + p * 4 * kCols);
    for (int m = 0; m < ROWS; ++m) {
      int32_t four;
      std::memcpy(&four, xq + m * quads * 4 + 4 * p, sizeof(four));
      acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], _mm512_set1_epi32(four), w);
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    __m512i sum = acc[m][0];
    for (int c = 1; c < CHAINS; ++c) sum = _mm512_add_epi32(sum, acc[m][c]);
    dots[m] = sum;
  }
}

using BlockDots = void (*)(const int8_t*, int64_t, const uint8_t*, __m512i*);

// 1 to 32 int8 rows: four chains for up to two rows, two for up to eight, one beyond
template <int... ROWS>
constexpr std::array<BlockDots, kMaxDots + 1> dots_table(std::integer_sequence<int, ROWS...>) {
  return {nullptr, block_dots<ROWS + 1, (ROWS < 2 ? 4 : ROWS < 8 ? 2 : 1)>...};
}
constexpr auto kDots = dots_table(std::make_integer_sequence<int, kMaxDots>{});

}  // namespace

// x [M, K] bf16 (M <= 16); packed [ceil(N / 16), ceil(K / 4), 16, 4] int8 (element [b, p, c, e] = q[16 b + c, 4 p + e],
// zeros beyond); sums [N'] int32 (each weight row's sum of q, N' >= N); scale, c1, c2 [N'] fp32: per weight row its
// scale s, |w - s q| + gamma_K |w| and s |q| (rounded up); cap: the most candidates worth returning.
// -> sorted int64 indices of every weight row that may hold some input row's largest bf16 output, or an empty tensor
// when an input row is not finite or all zero, or there would be more than `cap` of them (the caller then computes
// every output).
torch::Tensor int8_candidates(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& sums,
                              const torch::Tensor& scale, const torch::Tensor& c1, const torch::Tensor& c2, int64_t N,
                              int64_t cap) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "expected x [M, K] bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 4 &&
                  packed.scalar_type() == torch::kInt8 && packed.is_contiguous(),
              "expected a packed int8 weight [ceil(N / 16), ceil(K / 4), 16, 4]");
  const int64_t M = x.size(0), K = x.size(1), quads = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "expected 1 to 16 rows");
  TORCH_CHECK(quads == (K + 3) / 4 && blocks == (N + kCols - 1) / kCols, "the packed weight does not match x and N");
  const int64_t padded = blocks * kCols;
  for (const auto* t : {&sums, &scale, &c1, &c2})
    TORCH_CHECK(t->dim() == 1 && t->size(0) >= padded && t->is_contiguous(), "expected per-row vectors over N");
  TORCH_CHECK(sums.scalar_type() == torch::kInt32 && scale.scalar_type() == torch::kFloat32 &&
                  c1.scalar_type() == torch::kFloat32 && c2.scalar_type() == torch::kFloat32,
              "expected int32 sums and fp32 scales and bounds");
  const auto none = torch::empty({0}, torch::kLong);
  // each input row as two offset unsigned int8 rows (x_q + 128: the row rounded at scale s_x, then what that leaves
  // rounded at scale s_r), the scales, |x| and |x - s_x x_q - s_r r_q|, the norms rounded up. The second row makes the
  // input's share of the bound (s |q| |x - ...|) about a hundred times smaller than one int8 row would: with the
  // outlier features of a normed hidden state, one row's rounding would dominate the bound.
  std::vector<uint8_t> xq(2 * M * quads * 4, 128);
  std::vector<float> x_scale(M), r_scale(M), x_norm(M), x_error(M);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  std::vector<double> residual(K);
  for (int64_t m = 0; m < M; ++m) {
    double largest = 0.0, norm = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double v = widen(xp[m * K + k]);
      if (!std::isfinite(v)) return none;
      largest = std::max(largest, std::abs(v));
      norm += v * v;
    }
    if (largest == 0.0) return none;
    const float s = static_cast<float>(largest / 127.0);
    uint8_t* first = xq.data() + 2 * m * quads * 4;
    uint8_t* second = first + quads * 4;
    double left = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double v = widen(xp[m * K + k]);
      const double q = std::max(-127.0, std::min(127.0, std::nearbyint(v / s)));
      first[k] = static_cast<uint8_t>(static_cast<int>(q) + 128);
      residual[k] = v - static_cast<double>(s) * q;
      left = std::max(left, std::abs(residual[k]));
    }
    const float r = static_cast<float>(left / 127.0);
    double error = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double q = r > 0 ? std::max(-127.0, std::min(127.0, std::nearbyint(residual[k] / r))) : 0.0;
      second[k] = static_cast<uint8_t>(static_cast<int>(q) + 128);
      const double e = residual[k] - static_cast<double>(r) * q;
      error += e * e;
    }
    x_scale[m] = s;
    r_scale[m] = r;
    x_norm[m] = static_cast<float>(std::sqrt(norm) * (1.0 + 1e-6));
    x_error[m] = static_cast<float>(std::sqrt(error) * (1.0 + 1e-6));
  }
  // upper bounds [M, N'] and each row's largest lower bound
  std::vector<float> upper(M * padded);
  const int threads = at::get_num_threads();
  std::vector<float> lower(threads * M, -std::numeric_limits<float>::infinity());
  const auto* wp = packed.data_ptr<int8_t>();
  const int32_t* sp = sums.data_ptr<int32_t>();
  const float *scp = scale.data_ptr<float>(), *c1p = c1.data_ptr<float>(), *c2p = c2.data_ptr<float>();
  constexpr float kUnit = 5.9604645e-08f;  // 2^-24
  const BlockDots dots_of = kDots[2 * M];
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    __m512 low[kMaxRows];
    for (int64_t m = 0; m < M; ++m) low[m] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512i dots[kMaxDots];
    for (int64_t b = begin; b < end; ++b) {
      dots_of(wp + b * quads * 4 * kCols, quads, xq.data(), dots);
      const int64_t first = b * kCols;
      const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(sp + first), 7);  // 128 * sum(q)
      const __m512 s = _mm512_loadu_ps(scp + first);
      const __m512 b1 = _mm512_loadu_ps(c1p + first), b2 = _mm512_loadu_ps(c2p + first);
      const __mmask16 keep = (__mmask16)((1u << std::min(kCols, N - first)) - 1);
      for (int64_t m = 0; m < M; ++m) {
        // the exact integer dot products of q with both int8 rows (exact in fp32 up to K = 1040; beyond, and for
        // the estimate's own roundings, the 8u term covers it)
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(dots[2 * m], offset));
        const __m512 rest = _mm512_cvtepi32_ps(_mm512_sub_epi32(dots[2 * m + 1], offset));
        const __m512 main_part = _mm512_mul_ps(_mm512_mul_ps(dot, s), _mm512_set1_ps(x_scale[m]));
        const __m512 rest_part = _mm512_mul_ps(_mm512_mul_ps(rest, s), _mm512_set1_ps(r_scale[m]));
        const __m512 estimate = _mm512_add_ps(main_part, rest_part);
        __m512 bound = _mm512_fmadd_ps(b1, _mm512_set1_ps(x_norm[m]), _mm512_mul_ps(b2, _mm512_set1_ps(x_error[m])));
        bound = _mm512_fmadd_ps(_mm512_add_ps(_mm512_abs_ps(main_part), _mm512_abs_ps(rest_part)),
                                _mm512_set1_ps(8 * kUnit), bound);
        bound = _mm512_add_ps(_mm512_mul_ps(bound, _mm512_set1_ps(1.0f + 1.0f / 1024)), _mm512_set1_ps(1e-30f));
        _mm512_storeu_ps(upper.data() + m * padded + first, _mm512_add_ps(estimate, bound));
        low[m] = _mm512_mask_max_ps(low[m], keep, low[m], _mm512_sub_ps(estimate, bound));
      }
    }
    float* mine = lower.data() + at::get_thread_num() * M;
    for (int64_t m = 0; m < M; ++m) mine[m] = std::max(mine[m], _mm512_reduce_max_ps(low[m]));
  });
  std::vector<uint8_t> chosen(N, 0);
  std::vector<int64_t> found;
  for (int64_t m = 0; m < M; ++m) {
    float low = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < threads; ++t) low = std::max(low, lower[t * M + m]);
    if (!std::isfinite(low)) return none;
    const float below = bf16_below(low);
    const float* up = upper.data() + m * padded;
    const __m512 threshold = _mm512_set1_ps(below);
    for (int64_t first = 0; first < N; first += kCols) {
      const __mmask16 keep = (__mmask16)((1u << std::min(kCols, N - first)) - 1);
      __mmask16 above = _mm512_mask_cmp_ps_mask(keep, _mm512_loadu_ps(up + first), threshold, _CMP_GT_OQ);
      for (; above != 0; above &= above - 1) {
        const int64_t n = first + __builtin_ctz(above);
        if (!chosen[n]) {
          chosen[n] = 1;
          found.push_back(n);
          if (static_cast<int64_t>(found.size()) > cap) return none;
        }
      }
    }
  }
  std::sort(found.begin(), found.end());
  auto out = torch::empty({static_cast<int64_t>(found.size())}, torch::kLong);
  std::copy(found.begin(), found.end(), out.data_ptr<int64_t>());
  return out;
}

// weight [N, K] bf16, indices [C] int64 -> pack_bf16_weight(weight[indices]) ([ceil(C / 32), ceil(K / 2), 32, 2] bf16,
// zeros beyond C and K): the candidates' rows for the packed kernels, in one pass over them.
torch::Tensor gather_packed(const torch::Tensor& weight, const torch::Tensor& indices) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16 && weight.is_contiguous(),
              "expected a contiguous bf16 weight [N, K]");
  TORCH_CHECK(indices.dim() == 1 && indices.scalar_type() == torch::kLong && indices.is_contiguous(),
              "expected int64 indices [C]");
  constexpr int64_t kBlock = 32;
  const int64_t N = weight.size(0), K = weight.size(1), C = indices.size(0), pairs = (K + 1) / 2;
  const int64_t blocks = (C + kBlock - 1) / kBlock;
  auto out = torch::zeros({blocks, pairs, kBlock, 2}, weight.options());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint32_t*>(out.data_ptr<at::BFloat16>());  // one pair of bf16 values each
  const int64_t* ip = indices.data_ptr<int64_t>();
  for (int64_t c = 0; c < C; ++c) TORCH_CHECK(ip[c] >= 0 && ip[c] < N, "index out of range");
  const int64_t whole = K / 2;  // pairs without the padding zero
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t rows = std::min(kBlock, C - b * kBlock);
    const uint16_t* source[kBlock];
    for (int64_t r = 0; r < rows; ++r) source[r] = wp + ip[b * kBlock + r] * K;
    uint32_t* block = op + b * pairs * kBlock;
    for (int64_t p = 0; p < whole; ++p) {
      for (int64_t r = 0; r < rows; ++r) std::memcpy(block + p * kBlock + r, source[r] + 2 * p, sizeof(uint32_t));
    }
    if (whole < pairs) {  // odd K: the last pair is the row's last value and a zero
      for (int64_t r = 0; r < rows; ++r) std::memcpy(block + whole * kBlock + r, source[r] + 2 * whole, 2);
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gather_packed", &gather_packed, "pack_bf16_weight(weight[indices]) in one pass", pybind11::arg("weight"),
        pybind11::arg("indices"));
  m.def("int8_candidates", &int8_candidates,
        "the weight rows that may hold each bf16 input row's largest output, from an int8 copy of the weight",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("sums"), pybind11::arg("scale"),
        pybind11::arg("c1"), pybind11::arg("c2"), pybind11::arg("n"), pybind11::arg("cap"));
}
