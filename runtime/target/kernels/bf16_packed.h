// What the kernels over pack_bf16_weight's layout share (bf16_packed_rows.cpp, bf16_amx_rows.cpp): the layout, the
// checks and preparation of their operands, and a pair of bf16 values broadcast for AVX512-BF16's dot product.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "bf16_linear.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

// Packed layout: [ceil(N / 32), ceil(K / 2), 32, 2] bf16, element [b, p, c, e] = w[32 b + c, 2 p + e], zeros beyond
// N and K (runtime.target.kernels.pack_bf16_weight). A block of 32 columns is one sequential stream of K * 64 bytes.
constexpr int64_t kPackedBlockCols = 32;

// A packed product's operands, checked, and its output: the rows (widened with a zero where K is odd: the last pair
// reads one element past each row, which the packed zeros multiply), the bias as fp32 over whole blocks, and the
// raw pointers and sizes the kernels loop over.
struct PackedOperands {
  torch::Tensor rows;  // [M, 2 ceil(K / 2)] bfloat16
  torch::Tensor bias;  // [ceil(N / 32) * 32] float32, or undefined
  torch::Tensor out;   // [M, N] bfloat16
  int64_t M, pairs, blocks, x_stride;
  const uint16_t* x;   // rows' bits
  const uint16_t* w;   // the packed weight's bits
  const float* b;      // bias, or null
  at::BFloat16* o;     // out
};

inline PackedOperands packed_operands(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                                      const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.size(2) == kPackedBlockCols && packed.size(3) == 2,
              "expected x [M, K] and a packed weight [ceil(N / 32), ceil(K / 2), 32, 2]");
  TORCH_CHECK(packed.size(0) == (N + kPackedBlockCols - 1) / kPackedBlockCols && packed.size(1) == (x.size(1) + 1) / 2,
              "the packed weight's shape does not match x [M, K] and N");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16,
              "expected bfloat16 rows and a bfloat16 packed weight");
  TORCH_CHECK(x.is_contiguous() && packed.is_contiguous() && x.device().is_cpu() && packed.device().is_cpu(),
              "expected contiguous CPU tensors");
  PackedOperands a;
  a.rows = x.size(1) % 2 == 0 ? x : torch::constant_pad_nd(x, {0, 1});
  a.bias = linear_bias_fp32(bias, N);
  if (a.bias.defined()) a.bias = torch::constant_pad_nd(a.bias, {0, packed.size(0) * kPackedBlockCols - N});
  a.out = torch::empty({x.size(0), N}, x.options());
  a.M = x.size(0);
  a.pairs = packed.size(1);
  a.blocks = packed.size(0);
  a.x_stride = a.rows.size(1);
  a.x = reinterpret_cast<const uint16_t*>(a.rows.data_ptr<at::BFloat16>());
  a.w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  a.b = a.bias.defined() ? a.bias.data_ptr<float>() : nullptr;
  a.o = a.out.data_ptr<at::BFloat16>();
  return a;
}

// Calls block(b, m, rows, columns) for every packed block b (in parallel) and every run [m, m + rows) of the M rows,
// split into near-equal runs of at most max_rows (16 rows in runs of at most 12 go as 8 + 8, not 12 + 4); columns:
// the block's columns below N.
template <typename Block>
inline void for_each_block(int64_t M, int64_t N, int64_t blocks, int64_t max_rows, const Block& block) {
  const int64_t runs = (M + max_rows - 1) / max_rows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t columns = std::min(kPackedBlockCols, N - b * kPackedBlockCols);
      for (int64_t r = 0, m = 0; r < runs; ++r) {
        const int64_t take = (M - m) / (runs - r);
        block(b, m, take, columns);
        m += take;
      }
    }
  });
}

#ifdef __AVX512BF16__  // the AVX2 kernel over this layout (bf16_packed_rows_avx2.cpp) widens its rows instead
inline __m512bh pair_of(const uint16_t* x) {  // x[0], x[1] broadcast to every lane
  int32_t bits;
  std::memcpy(&bits, x, sizeof(bits));
  return (__m512bh)_mm512_set1_epi32(bits);
}
#endif
