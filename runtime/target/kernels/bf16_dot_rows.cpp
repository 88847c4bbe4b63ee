// A few to a few dozen bf16 rows times a bf16 weight matrix with AVX512-BF16's dot-product instruction:
// out[m, n] = bf16(sum_k x[m, k] * w[n, k] + bias[n]).
//
// bf16_rows.cpp widens every weight to fp32 and multiplies with 8-wide AVX2 FMAs, which is memory-bound up to about
// 4 rows and compute-bound beyond (scripts/bench_bf16_rows.py). VDPBF16PS multiplies 32 bf16 pairs per instruction
// straight from the bf16 bits, each product exact in fp32 and summed in fp32 (denormals flushed), so the same
// weight stream feeds several times more rows before compute binds. The weights are walked in chunks small enough
// to stay in L2 while every block of rows passes over them, so each weight is read from memory once per call.
// Built only on CPUs that report AVX512-BF16 (runtime.target.kernels).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "bf16_linear.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kRowBlock = 8;  // input rows per block
// Weight rows per chunk: every block of input rows passes over a chunk while it is in L1, then the next chunk. With
// chunks of 32 rows the weights streamed from memory only while the first block passed over a chunk and the others
// read L2; small chunks keep the stream going through the whole call (scripts/bench_bf16_rows.py: 16-32 rows about
// 1.1x faster). 6 is a multiple of every block's WROWS below.
constexpr int64_t kChunkRows = 6;
constexpr int64_t kPrefetchAhead = 8192;  // weight elements ahead (16 KB), as in bf16_rows.cpp

inline __m512bh load_pairs(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load_pairs(const uint16_t* p, __mmask32 mask) { return (__m512bh)_mm512_maskz_loadu_epi16(mask, p); }

// ROWS rows x [ROWS, K] (bf16 bits, row stride K) times WROWS weight rows w [WROWS, K] -> fp32 out[m * stride + j].
// Each step loads the WROWS weight vectors and each row's vector once and applies them to all ROWS * WROWS
// accumulators: the loads, not the dot products, bound a block that reloads operands per product.
template <int ROWS, int WROWS>
inline void dot_block(const uint16_t* x, const uint16_t* w, int64_t K, float* out, int64_t out_stride) {
  __m512 acc[WROWS][ROWS];
  for (int j = 0; j < WROWS; ++j)
    for (int m = 0; m < ROWS; ++m) acc[j][m] = _mm512_setzero_ps();
  __m512bh weights[WROWS];
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    for (int j = 0; j < WROWS; ++j) {
      // into L2, not L1, as in bf16_rows.cpp (scripts/bench_bf16_rows.py --dot-baseline: 1-8 rows 1.4-1.6x faster)
      _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k + kPrefetchAhead), _MM_HINT_T1);
      weights[j] = load_pairs(w + j * K + k);
    }
    for (int m = 0; m < ROWS; ++m) {
      const __m512bh row = load_pairs(x + m * K + k);
      for (int j = 0; j < WROWS; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], weights[j], row);
    }
  }
  if (k < K) {  // the tail: masked-off lanes load zeros, which add nothing
    const __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
    for (int j = 0; j < WROWS; ++j) weights[j] = load_pairs(w + j * K + k, mask);
    for (int m = 0; m < ROWS; ++m) {
      const __m512bh row = load_pairs(x + m * K + k, mask);
      for (int j = 0; j < WROWS; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], weights[j], row);
    }
  }
  for (int j = 0; j < WROWS; ++j)
    for (int m = 0; m < ROWS; ++m) out[m * out_stride + j] = _mm512_reduce_add_ps(acc[j][m]);
}

// Weight rows [begin, end) against ROWS input rows, WROWS weight rows at a time (at most 24 accumulators of the 32
// registers, the rest for the operands).
template <int ROWS, int WROWS>
void dot_rows(const uint16_t* x, const uint16_t* w, int64_t K, float* out, int64_t out_stride, int64_t begin,
              int64_t end) {
  int64_t n = begin;
  for (; n + WROWS <= end; n += WROWS) dot_block<ROWS, WROWS>(x, w + n * K, K, out + n, out_stride);
  for (; n < end; ++n) dot_block<ROWS, 1>(x, w + n * K, K, out + n, out_stride);
}

// Weight rows side by side for a block of ROWS rows whose chunk is already in cache (a block after the first):
// enough independent accumulators to keep the dot products busy.
template <int ROWS>
constexpr int kCachedWeightRows = ROWS <= 4 ? 6 : 3;
// ... and for the only block of a call, which streams the chunk from memory: one or two rows are bound by memory,
// and one weight row at a time, read in order, measured faster there than several side by side
// (scripts/bench_bf16_rows.py --rows 1).
template <int ROWS>
constexpr int kStreamingWeightRows = ROWS <= 2 ? 1 : kCachedWeightRows<ROWS>;

using DotRows = void (*)(const uint16_t*, const uint16_t*, int64_t, float*, int64_t, int64_t, int64_t);
template <int... ROWS>
constexpr std::array<DotRows, kRowBlock + 1> streaming_table(std::integer_sequence<int, ROWS...>) {
  return {nullptr, dot_rows<ROWS + 1, kStreamingWeightRows<ROWS + 1>>...};
}
template <int... ROWS>
constexpr std::array<DotRows, kRowBlock + 1> cached_table(std::integer_sequence<int, ROWS...>) {
  return {nullptr, dot_rows<ROWS + 1, kCachedWeightRows<ROWS + 1>>...};
}
constexpr auto kStreaming = streaming_table(std::make_integer_sequence<int, kRowBlock>{});
// A call of more than kRowBlock rows ends in a block of 1-7 rows (a packed pass of ragged rows: 17 rows are 8 + 8 + 1),
// which reads the chunk the blocks before it brought into cache: one weight row at a time there would leave it bound
// on the latency of a single chain of dot products.
constexpr auto kCached = cached_table(std::make_integer_sequence<int, kRowBlock>{});

}  // namespace

// x [M, K] bfloat16 -> (x @ weight^T + bias) [M, N] bfloat16: fp32 sums, the bias added in fp32, one rounding to
// bf16 (round to nearest even, as Tensor.to). Equal to the fp32 product of the same values up to summation order,
// except that a product or partial sum below fp32's normal range (2^-126) counts as 0: each term is then off by less
// than 2^-126, far below a bf16 step of any sum a model's activations reach.
torch::Tensor bf16_dot_linear(const torch::Tensor& x, const torch::Tensor& weight,
                              const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "expected x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16,
              "expected bfloat16 rows and a bfloat16 weight");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.device().is_cpu() && weight.device().is_cpu(),
              "expected contiguous CPU tensors");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const torch::Tensor bias_fp32 = linear_bias_fp32(bias, N);
  const float* bp = bias_fp32.defined() ? bias_fp32.data_ptr<float>() : nullptr;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  std::vector<float> product(M * N);
  auto out = torch::empty({M, N}, x.options());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; chunk += kChunkRows) {
      const int64_t stop = std::min(end, chunk + kChunkRows);
      const auto& table = M > kRowBlock ? kCached : kStreaming;
      for (int64_t m = 0; m < M; m += kRowBlock)
        table[std::min(kRowBlock, M - m)](xp + m * K, wp, K, product.data() + m * N, N, chunk, stop);
    }
    round_rows(product.data(), bp, op, M, N, begin, end);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_dot_linear", &bf16_dot_linear, "x [M, K] bf16 @ weight [N, K] bf16 ^T (+ bias [N]) -> [M, N] bf16",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none());
}
