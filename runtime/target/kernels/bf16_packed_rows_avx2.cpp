// One to a few dozen bf16 rows times a bf16 weight matrix in pack_bf16_weight's layout, with AVX2 FMAs, for CPUs
// without AVX512-BF16: out[m, n] = bf16(sum_k x[m, k] * w[n, k] + bias[n]).
//
// bf16_rows.cpp multiplies the weights in their own [N, K] layout: each output is an 8-lane accumulator summed across
// its lanes at the end, and every 8 weights cost a load, a widening and a shift beside the FMAs. In the packed layout
// one 256-bit load holds 8 output columns' pair of weights at the same two k: a shift gives the even k's weights as
// fp32 and a mask the odd k's, each lane is an output of its own summed over all of K in order, and nothing is left to
// reduce. The rows go in as fp32 broadcasts, so the loop is two FMAs per load and row, which keeps a few rows on the
// weights' reading and more rows near the FMA units' rate (scripts/bench_bf16_rows.py measures both kernels).
// With 16 vector registers, a sweep over a block (in order: one sequential stream) holds the accumulators of its four
// 8-column vectors for two rows; more rows take more sweeps, which read the block again from L2. Sweeps over half a
// block (more rows, fewer columns) read it with gaps and ran slower from memory; sweeps of three rows spilled.
// Built on any CPU with AVX2 and FMA; the lean pass's products where AVX512-BF16 is missing (runtime.target.kernels).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "bf16_bits.h"
#include "bf16_packed.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;                        // fp32 lanes per accumulator: output columns per vector
constexpr int kVectors = kPackedBlockCols / kLanes;  // 8-column vectors per packed block
constexpr int kMaxRows = 12;                         // input rows per call of packed_block
constexpr int kSweepRows = 2;  // rows per sweep: 8 accumulators, 4 broadcasts and a weight pair of the 16 registers

// ROWS rows of x (fp32, row stride x_stride, 2 * pairs elements each) times one packed block ([pairs, 32, 2] bits,
// read in order: one sequential stream) -> sums[m * 32 + column] (fp32).
template <int ROWS>
inline void sweep(const float* x, int64_t x_stride, const uint16_t* block, int64_t pairs, float* sums) {
  __m256 acc[ROWS][kVectors];
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < kVectors; ++v) acc[m][v] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* w = block + p * 2 * kPackedBlockCols;
    __m256 x0[ROWS], x1[ROWS];
    for (int m = 0; m < ROWS; ++m) {
      x0[m] = _mm256_broadcast_ss(x + m * x_stride + 2 * p);
      x1[m] = _mm256_broadcast_ss(x + m * x_stride + 2 * p + 1);
    }
    for (int v = 0; v < kVectors; ++v) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + v * 2 * kLanes));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));  // w[c, 2p] in the high half: its value
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(bits, high));   // w[c, 2p + 1]
      for (int m = 0; m < ROWS; ++m) acc[m][v] = _mm256_fmadd_ps(odd, x1[m], _mm256_fmadd_ps(even, x0[m], acc[m][v]));
    }
  }
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < kVectors; ++v) _mm256_storeu_ps(sums + m * kPackedBlockCols + v * kLanes, acc[m][v]);
}

using Sweep = void (*)(const float*, int64_t, const uint16_t*, int64_t, float*);
template <int... ROWS>
constexpr std::array<Sweep, kSweepRows + 1> sweep_table(std::integer_sequence<int, ROWS...>) {
  return {nullptr, sweep<ROWS + 1>...};
}
constexpr auto kSweeps = sweep_table(std::make_integer_sequence<int, kSweepRows>{});

// rows rows times one whole packed block -> out[m * out_stride + c] for the block's first `columns` columns, the
// bias (fp32, 32 entries, or null) added in fp32 and one rounding (to nearest even, as Tensor.to). The rows go in
// near-equal sweeps of at most kSweepRows, each over the whole block in order: the first reads it from memory, the
// others from L2 (a block is 64 K bytes).
void packed_block(const float* x, int64_t x_stride, int64_t rows, const uint16_t* block, int64_t pairs,
                  const float* bias, at::BFloat16* out, int64_t out_stride, int64_t columns) {
  float sums[kMaxRows * kPackedBlockCols];
  const int64_t sweeps = (rows + kSweepRows - 1) / kSweepRows;
  for (int64_t s = 0, m = 0; s < sweeps; ++s) {
    const int64_t take = (rows - m) / (sweeps - s);
    kSweeps[take](x + m * x_stride, x_stride, block, pairs, sums + m * kPackedBlockCols);
    m += take;
  }
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t c = 0; c < columns; ++c) {
      const float value = sums[m * kPackedBlockCols + c];
      out[m * out_stride + c] = at::BFloat16(bias != nullptr ? value + bias[c] : value);
    }
}

}  // namespace

// x [M, K] bfloat16, packed [ceil(N / 32), ceil(K / 2), 32, 2] bfloat16 (pack_bf16_weight's layout of weight
// [N, K]), N -> (x @ weight^T + bias) [M, N] bfloat16. Each output is one fp32 sum over k in order of the exact
// products, the bias added in fp32, one rounding to bf16 (round to nearest even, as Tensor.to). An output depends on
// its own row only, never on how many rows share the call.
torch::Tensor bf16_packed_linear_avx2(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                                      const c10::optional<torch::Tensor>& bias) {
  const PackedOperands a = packed_operands(x, packed, N, bias);
  const int64_t M = a.M, pairs = a.pairs, blocks = a.blocks, x_stride = a.x_stride;
  std::vector<float> widened(M * x_stride);  // the rows widened once: every block broadcasts from them
  for (int64_t i = 0; i < M * x_stride; ++i) widened[i] = widen(a.x[i]);
  const float* xp = widened.data();
  const uint16_t* wp = a.w;
  const float* bp = a.b;
  at::BFloat16* op = a.o;
  for_each_block(M, N, blocks, kMaxRows, [&](int64_t b, int64_t m, int64_t rows, int64_t columns) {
    packed_block(xp + m * x_stride, x_stride, rows, wp + b * pairs * 2 * kPackedBlockCols, pairs,
                 bp != nullptr ? bp + b * kPackedBlockCols : nullptr, op + m * N + b * kPackedBlockCols, N, columns);
  });
  return a.out;
}

#ifndef HEADSTART_ONE_MODULE  // lean_layers.cpp's build links this source into its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_packed_linear_avx2", &bf16_packed_linear_avx2,
        "x [M, K] bf16 @ (weight [N, K] packed) ^T (+ bias [N]) -> [M, N] bf16", pybind11::arg("x"),
        pybind11::arg("packed"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none());
}
#endif
