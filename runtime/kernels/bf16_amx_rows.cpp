// One to a few dozen bf16 rows times a bf16 weight matrix, with AMX tiles, over the weight packed for
// bf16_packed_rows.cpp: out[m, n] = bf16(sum_k x[m, k] * w[n, k] + bias[n]).
//
// On a CPU with AMX a tile product multiplies up to 16 rows by 32 k of 16 output columns in one instruction, so a
// decode pass of a few rows costs what one row costs: the weights' read from memory. oneDNN computes the same
// product but spends about 20 microseconds a call around it, about as long as a small layer's product
// (scripts/bench_bf16_rows.py times both); this kernel reads the packed layout as it is.
//
// Packed layout (runtime.kernels.pack_bf16_weight): [ceil(N / 32), ceil(K / 2), 32, 2] bf16, element [b, p, c, e] =
// w[32 b + c, 2 p + e]. A weight tile (16 k pairs by 16 columns, each row the 64 bytes of one pair of k for 16
// columns: AMX's pair-interleaved layout) is that layout's rows with a stride of 128 bytes; the rows' tile is x's
// rows with their own stride. k pairs beyond the last whole tile of 16 are added with AVX512-BF16's dot product.
// Built only on CPUs that report AMX-BF16 (runtime.kernels).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "avx512_round.h"
#include "bf16_linear.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kBlockCols = 32;  // output columns per packed block
constexpr int64_t kTileRows = 16;   // rows of x per tile product
constexpr int64_t kTilePairs = 16;  // k pairs per tile product: 32 bf16 of each row, 64 bytes
constexpr int64_t kGroupCols = 16;  // output columns per accumulator tile
constexpr int kMaxGroups = 4;       // accumulator tiles per pass over k: two packed blocks

// Tiles: 0 holds rows of x, 1-4 accumulate four groups of 16 columns, 5 and 6 hold weight tiles.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void configure_tiles(int64_t rows) {
  TileConfig config;
  std::memset(&config, 0, sizeof(config));
  config.palette_id = 1;
  for (int t = 0; t <= 4; ++t) {
    config.rows[t] = static_cast<uint8_t>(rows);
    config.colsb[t] = 64;
  }
  for (int t = 5; t <= 6; ++t) {
    config.rows[t] = kTilePairs;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

inline __m512bh pair_of(const uint16_t* x) {  // x[0], x[1] broadcast to every lane
  int32_t bits;
  std::memcpy(&bits, x, sizeof(bits));
  return (__m512bh)_mm512_set1_epi32(bits);
}

// The weight tile of group g (block g / 2, columns 16 (g % 2) ..) at the tile of k pairs starting at pair p.
inline const uint16_t* weight_tile(const uint16_t* blocks, int64_t pairs, int g, int64_t p) {
  return blocks + (g / 2) * pairs * 2 * kBlockCols + p * 2 * kBlockCols + (g % 2) * 2 * kGroupCols;
}

// `rows` rows of x (row stride x_stride elements) times GROUPS groups of 16 columns from `blocks` (the first of one
// or two packed blocks) over the whole tiles of k -> sums[rows, 64] fp32 (the first 16 GROUPS columns written).
template <int GROUPS>
void tile_products(const uint16_t* x, int64_t x_stride, const uint16_t* blocks, int64_t pairs, int64_t tiles,
                   float* sums) {
  _tile_zero(1);
  _tile_zero(2);
  if constexpr (GROUPS > 2) {
    _tile_zero(3);
    _tile_zero(4);
  }
  const int64_t weight_stride = 2 * kBlockCols * sizeof(uint16_t);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t p = t * kTilePairs;
    _tile_loadd(0, x + 2 * p, x_stride * sizeof(uint16_t));
    _tile_loadd(5, weight_tile(blocks, pairs, 0, p), weight_stride);
    _tile_loadd(6, weight_tile(blocks, pairs, 1, p), weight_stride);
    _tile_dpbf16ps(1, 0, 5);
    _tile_dpbf16ps(2, 0, 6);
    if constexpr (GROUPS > 2) {
      _tile_loadd(5, weight_tile(blocks, pairs, 2, p), weight_stride);
      _tile_loadd(6, weight_tile(blocks, pairs, 3, p), weight_stride);
      _tile_dpbf16ps(3, 0, 5);
      _tile_dpbf16ps(4, 0, 6);
    }
  }
  const int64_t sums_stride = kMaxGroups * kGroupCols * sizeof(float);
  _tile_stored(1, sums, sums_stride);
  _tile_stored(2, sums + kGroupCols, sums_stride);
  if constexpr (GROUPS > 2) {
    _tile_stored(3, sums + 2 * kGroupCols, sums_stride);
    _tile_stored(4, sums + 3 * kGroupCols, sums_stride);
  }
}

}  // namespace

// Asks Linux for the AMX tile state (a process must before its first tile instruction); whether it may use them.
bool enable_amx() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// x [M, K] bfloat16, packed [ceil(N / 32), ceil(K / 2), 32, 2] bfloat16 (pack_bf16_weight's layout of weight
// [N, K]), N -> (x @ weight^T + bias) [M, N] bfloat16. Each output is an fp32 sum of the exact pair products (in
// the tiles' order, then the pairs past the last whole tile), the bias added in fp32, one rounding to bf16 (round to
// nearest even, as Tensor.to); as for AVX512-BF16's dot product, values below fp32's normal range count as 0. An
// output depends on its own row only, never on how many rows share the call. enable_amx() must have returned true.
torch::Tensor bf16_amx_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                              const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.size(2) == kBlockCols && packed.size(3) == 2,
              "expected x [M, K] and a packed weight [ceil(N / 32), ceil(K / 2), 32, 2]");
  TORCH_CHECK(packed.size(0) == (N + kBlockCols - 1) / kBlockCols && packed.size(1) == (x.size(1) + 1) / 2,
              "the packed weight's shape does not match x [M, K] and N");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16,
              "expected bfloat16 rows and a bfloat16 packed weight");
  TORCH_CHECK(x.is_contiguous() && packed.is_contiguous() && x.device().is_cpu() && packed.device().is_cpu(),
              "expected contiguous CPU tensors");
  const int64_t M = x.size(0), pairs = packed.size(1), blocks = packed.size(0);
  // an odd K reads one element past each row: widen the rows with a zero, which the packed zeros multiply
  const torch::Tensor rows = x.size(1) % 2 == 0 ? x : torch::constant_pad_nd(x, {0, 1});
  const int64_t x_stride = rows.size(1);
  torch::Tensor bias_fp32 = linear_bias_fp32(bias, N);
  if (bias_fp32.defined()) bias_fp32 = torch::constant_pad_nd(bias_fp32, {0, blocks * kBlockCols - N});
  const float* bp = bias_fp32.defined() ? bias_fp32.data_ptr<float>() : nullptr;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto out = torch::empty({M, N}, x.options());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t tiles = pairs / kTilePairs;
  const int64_t units = (blocks + 1) / 2;  // two packed blocks (64 columns) per unit of work
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kTileRows * kMaxGroups * kGroupCols];
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int64_t count = std::min(kTileRows, M - m0);
      configure_tiles(count);
      const uint16_t* xm = xp + m0 * x_stride;
      for (int64_t u = begin; u < end; ++u) {
        const int64_t first_block = 2 * u;
        const uint16_t* bw = wp + first_block * pairs * 2 * kBlockCols;
        const int groups = first_block + 1 < blocks ? 4 : 2;
        if (groups == 4) {
          tile_products<4>(xm, x_stride, bw, pairs, tiles, sums);
        } else {
          tile_products<2>(xm, x_stride, bw, pairs, tiles, sums);
        }
        const int64_t first_column = first_block * kBlockCols;
        for (int g = 0; g < groups; ++g) {
          const int64_t column = first_column + g * kGroupCols;
          if (column >= N) break;
          const __mmask16 keep = (__mmask16)((1u << std::min<int64_t>(kGroupCols, N - column)) - 1);
          const __m512 shift = bp != nullptr ? _mm512_loadu_ps(bp + column) : _mm512_setzero_ps();
          for (int64_t m = 0; m < count; ++m) {
            __m512 acc = _mm512_loadu_ps(sums + m * kMaxGroups * kGroupCols + g * kGroupCols);
            for (int64_t p = tiles * kTilePairs; p < pairs; ++p) {
              const __m512bh weights = (__m512bh)_mm512_loadu_si512(weight_tile(bw, pairs, g, p));
              acc = _mm512_dpbf16_ps(acc, weights, pair_of(xm + m * x_stride + 2 * p));
            }
            _mm256_mask_storeu_epi16(op + (m0 + m) * N + column, keep, round_to_bf16(_mm512_add_ps(acc, shift)));
          }
        }
      }
    }
    _tile_release();
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("enable_amx", &enable_amx, "request the AMX tile state from Linux; whether granted");
  m.def("bf16_amx_linear", &bf16_amx_linear,
        "x [M, K] bf16 @ (weight [N, K] packed) ^T (+ bias [N]) -> [M, N] bf16", pybind11::arg("x"),
        pybind11::arg("packed"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none());
}
