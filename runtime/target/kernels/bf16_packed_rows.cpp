// One to a few dozen bf16 rows times a bf16 weight matrix packed for AVX512-BF16's dot-product instruction:
// out[m, n] = bf16(sum_k x[m, k] * w[n, k] + bias[n]).
//
// bf16_dot_rows.cpp multiplies the weights in their own [N, K] layout: each output is a 16-lane accumulator summed
// across its lanes at the end, and for a model's short rows (K = 576: 18 steps of 32 pairs per accumulator) that
// end costs nearly as much as the products, so its blocks reach about 60% of the instruction's rate. Here the
// weights are packed once (runtime.target.kernels.pack_bf16_weight) so that one 512-bit load holds 16 output columns' pair
// of weights at the same two k; every lane of an accumulator is an output of its own, summed over all of K in
// order, and nothing is left to reduce (scripts/bench_bf16_rows.py measures both).
// The packed layout is bf16_packed.h's.
// Built only on CPUs that report AVX512-BF16 (runtime.target.kernels).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx512_round.h"
#include "bf16_packed.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

namespace {

constexpr int64_t kLanes = 16;                   // fp32 lanes per accumulator: output columns per group
constexpr int kGroups = 2;                       // 16-column groups per block
constexpr int64_t kBlockCols = kLanes * kGroups;  // output columns per packed block
static_assert(kBlockCols == kPackedBlockCols, "a block is two groups of 16 lanes");
constexpr int kMaxRows = 12;                     // input rows per block: 24 accumulators of the 32 registers

// ROWS rows of x (bf16 bits, row stride x_stride, at least 2 * pairs elements each) times one packed block
// [pairs, 32, 2] -> out[m * out_stride + c] for the block's first `columns` columns, bias (fp32, 32 entries) or null.
template <int ROWS>
void packed_block(const uint16_t* x, int64_t x_stride, const uint16_t* block, int64_t pairs, const float* bias,
                  at::BFloat16* out, int64_t out_stride, int64_t columns) {
  __m512 acc[ROWS][kGroups];
  for (int m = 0; m < ROWS; ++m)
    for (int g = 0; g < kGroups; ++g) acc[m][g] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* w = block + p * 2 * kBlockCols;
    // no software prefetch: a block is one sequential stream, which the hardware prefetches; prefetches 2-32 KB
    // ahead into L1 or L2 were all slower at 1-32 rows (scripts/bench_bf16_rows.py --packed-baseline)
    __m512bh weights[kGroups];
    for (int g = 0; g < kGroups; ++g) weights[g] = (__m512bh)_mm512_loadu_si512(w + g * 2 * kLanes);
    for (int m = 0; m < ROWS; ++m) {
      const __m512bh row = pair_of(x + m * x_stride + 2 * p);
      for (int g = 0; g < kGroups; ++g) acc[m][g] = _mm512_dpbf16_ps(acc[m][g], weights[g], row);
    }
  }
  for (int g = 0; g < kGroups; ++g) {
    const int64_t first = g * kLanes;
    if (first >= columns) break;
    const __mmask16 keep = (__mmask16)((1u << std::min<int64_t>(kLanes, columns - first)) - 1);
    const __m512 shift = bias != nullptr ? _mm512_loadu_ps(bias + first) : _mm512_setzero_ps();
    for (int m = 0; m < ROWS; ++m)
      _mm256_mask_storeu_epi16(out + m * out_stride + first, keep, round_to_bf16(_mm512_add_ps(acc[m][g], shift)));
  }
}

using PackedBlock = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*, at::BFloat16*,
                             int64_t, int64_t);
template <int... ROWS>
constexpr std::array<PackedBlock, kMaxRows + 1> block_table(std::integer_sequence<int, ROWS...>) {
  return {nullptr, packed_block<ROWS + 1>...};
}
constexpr auto kBlocks = block_table(std::make_integer_sequence<int, kMaxRows>{});

}  // namespace

// x [M, K] bfloat16, packed [ceil(N / 32), ceil(K / 2), 32, 2] bfloat16 (pack_bf16_weight's layout of weight
// [N, K]), N -> (x @ weight^T + bias) [M, N] bfloat16. Each output is one fp32 sum over k in order of the exact pair
// products, the bias added in fp32, one rounding to bf16 (round to nearest even, as Tensor.to); a product or partial
// sum below fp32's normal range counts as 0, as in bf16_dot_rows.cpp. An output depends on its own row only, never
// on how many rows share the call.
torch::Tensor bf16_packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                                 const c10::optional<torch::Tensor>& bias) {
  const PackedOperands a = packed_operands(x, packed, N, bias);
  const int64_t M = a.M, pairs = a.pairs, blocks = a.blocks, x_stride = a.x_stride;
  const uint16_t *xp = a.x, *wp = a.w;
  const float* bp = a.b;
  at::BFloat16* op = a.o;
  for_each_block(M, N, blocks, kMaxRows, [&](int64_t b, int64_t m, int64_t rows, int64_t columns) {
    kBlocks[rows](xp + m * x_stride, x_stride, wp + b * pairs * 2 * kBlockCols, pairs,
                  bp != nullptr ? bp + b * kBlockCols : nullptr, op + m * N + b * kBlockCols, N, columns);
  });
  return a.out;
}

#ifndef HEADSTART_ONE_MODULE  // lean_layers.cpp's build links this source into its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_packed_linear", &bf16_packed_linear,
        "x [M, K] bf16 @ (weight [N, K] packed) ^T (+ bias [N]) -> [M, N] bf16", pybind11::arg("x"),
        pybind11::arg("packed"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none());
}
#endif
