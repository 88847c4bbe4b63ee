// A few rows times a bfloat16 weight matrix, reading the weights once: out[m, n] = sum_k x[m, k] * w[n, k].
//
// On CPUs without bf16 matrix instructions (AVX2, no AVX-512 BF16 or AMX), PyTorch multiplies M rows by a bf16
// matrix at about M times the cost of one row, so a tree verification pass in bf16 costs several plain decode steps.
// Here each weight row is widened to fp32 in registers and multiplied with all M input rows while it is in cache:
// the pass reads the weights once, like a one-row product. Accumulation is fp32, as in PyTorch's own bf16 kernels.
#include <torch/extension.h>

#include "bf16_bits.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "bf16_linear.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRowBlock = 8;  // input rows sharing one pass over a weight row (8 accumulators + 1 weight vector)
// Weight elements to prefetch ahead (16 KB): the weights stream from memory once per pass, and the hardware
// prefetcher alone left the loop waiting on memory (4-8K elements measured about equal; 1K clearly slower). They are
// prefetched into L2, not L1: 16 KB ahead in a 32-48 KB L1 evicted the rows and weights in use, and a 2-row call ran
// about 1.4x slower for it (scripts/bench_bf16_rows.py); from L2 a line reaches L1 in time.
constexpr int64_t kPrefetchAhead = 8192;

inline float horizontal_sum(__m256 v) {
  __m128 low = _mm256_castps256_ps128(v);
  __m128 high = _mm256_extractf128_ps(v, 1);
  low = _mm_add_ps(low, high);
  low = _mm_hadd_ps(low, low);
  low = _mm_hadd_ps(low, low);
  return _mm_cvtss_f32(low);
}

// ROWS input rows x [ROWS, K] (fp32, row stride K) times WROWS weight rows w [WROWS, K] (bf16 bits, row stride K)
// -> out[m * out_stride + j]. Both counts are template arguments so that the ROWS * WROWS accumulators live in
// registers; several weight rows per pass keep enough independent FMA chains in flight when ROWS is small.
template <int ROWS, int WROWS>
inline void dot_block(const float* x, const uint16_t* w, int64_t K, float* out, int64_t out_stride) {
  __m256 acc[WROWS][ROWS];
  for (int j = 0; j < WROWS; ++j)
    for (int m = 0; m < ROWS; ++m) acc[j][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    for (int j = 0; j < WROWS; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k + kPrefetchAhead), _MM_HINT_T1);
      __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * K + k));
      __m256 weights = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
      for (int m = 0; m < ROWS; ++m)
        acc[j][m] = _mm256_fmadd_ps(weights, _mm256_loadu_ps(x + m * K + k), acc[j][m]);
    }
  }
  for (int j = 0; j < WROWS; ++j) {
    for (int m = 0; m < ROWS; ++m) {
      float total = horizontal_sum(acc[j][m]);
      for (int64_t tail = k; tail < K; ++tail) total += widen(w[j * K + tail]) * x[m * K + tail];
      out[m * out_stride + j] = total;
    }
  }
}

// All N weight rows against ROWS input rows, WROWS weight rows at a time (then one at a time for the remainder).
template <int ROWS>
void dot_rows(const float* x, const uint16_t* w, int64_t K, float* out, int64_t out_stride, int64_t begin,
              int64_t end) {
  constexpr int WROWS = ROWS <= 2 ? 4 : (ROWS <= 4 ? 2 : 1);
  int64_t n = begin;
  for (; n + WROWS <= end; n += WROWS) dot_block<ROWS, WROWS>(x, w + n * K, K, out + n, out_stride);
  for (; n < end; ++n) dot_block<ROWS, 1>(x, w + n * K, K, out + n, out_stride);
}

using DotRows = void (*)(const float*, const uint16_t*, int64_t, float*, int64_t, int64_t, int64_t);
constexpr DotRows kDotRows[kRowBlock + 1] = {nullptr, dot_rows<1>, dot_rows<2>, dot_rows<3>, dot_rows<4>,
                                             dot_rows<5>, dot_rows<6>, dot_rows<7>, dot_rows<8>};

void check_weight(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "expected x [M, K] and weight [N, K]");
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16, "expected a bfloat16 weight");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.device().is_cpu() && weight.device().is_cpu(),
              "expected contiguous CPU tensors");
}

// out[m, n] for n in [begin, end), all M rows of x (fp32, contiguous).
void rows_times_weight(const float* xp, const uint16_t* wp, int64_t M, int64_t K, int64_t N, float* op,
                       int64_t begin, int64_t end) {
  for (int64_t m = 0; m < M; m += kRowBlock) {
    kDotRows[std::min(kRowBlock, M - m)](xp + m * K, wp, K, op + m * N, N, begin, end);
  }
}

}  // namespace

// x [M, K] float32 contiguous, weight [N, K] bfloat16 contiguous -> [M, N] float32
torch::Tensor bf16_rows_matmul(const torch::Tensor& x, const torch::Tensor& weight) {
  check_weight(x, weight);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "expected float32 rows and a bfloat16 weight");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) { rows_times_weight(xp, wp, M, K, N, op, begin, end); });
  return out;
}

// The whole bf16 linear layer in one call: x [M, K] bfloat16 -> (x @ weight^T + bias) [M, N] bfloat16, with the
// product and the bias added in fp32 and one rounding to bf16 at the end (round to nearest even, as Tensor.to).
// Equal bit for bit to (bf16_rows_matmul(x.float(), weight) + bias.float()).to(bfloat16), without the three
// PyTorch calls around the product, whose fixed costs add up over the hundreds of linears of a pass
// (scripts/bench_bf16_rows.py).
torch::Tensor bf16_rows_linear(const torch::Tensor& x, const torch::Tensor& weight,
                               const c10::optional<torch::Tensor>& bias) {
  check_weight(x, weight);
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "expected bfloat16 rows");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const torch::Tensor bias_fp32 = linear_bias_fp32(bias, N);
  const float* bp = bias_fp32.defined() ? bias_fp32.data_ptr<float>() : nullptr;
  std::vector<float> x_fp32(M * K);
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < M * K; ++i) x_fp32[i] = widen(xb[i]);
  std::vector<float> product(M * N);
  auto out = torch::empty({M, N}, x.options());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    rows_times_weight(x_fp32.data(), wp, M, K, N, product.data(), begin, end);
    round_rows(product.data(), bp, op, M, N, begin, end);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_rows_matmul", &bf16_rows_matmul, "x [M, K] fp32 @ weight [N, K] bf16 ^T -> [M, N] fp32");
  m.def("bf16_rows_linear", &bf16_rows_linear, "x [M, K] bf16 @ weight [N, K] bf16 ^T (+ bias [N]) -> [M, N] bf16",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none());
}
