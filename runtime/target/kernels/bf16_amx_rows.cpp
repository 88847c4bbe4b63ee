// One to a few dozen bf16 rows times a bf16 weight matrix, with AMX tiles, over the weight packed for
// bf16_packed_rows.cpp: out[m, n] = bf16(sum_k x[m, k] * w[n, k] + bias[n]).
//
// On a CPU with AMX a tile product multiplies up to 16 rows by 32 k of 16 output columns in one instruction, so a
// decode pass of a few rows costs what one row costs: the weights' read from memory. oneDNN computes the same
// product but spends about 20 microseconds a call around it, about as long as a small layer's product
// (scripts/bench_bf16_rows.py times both); this kernel reads the packed layout as it is.
//
// Packed layout (bf16_packed.h): [ceil(N / 32), ceil(K / 2), 32, 2] bf16, element [b, p, c, e] = w[32 b + c,
// 2 p + e]. A weight tile (16 k pairs by 16 columns, each row the 64 bytes of one pair of k for 16 columns: AMX's
// pair-interleaved layout) is that layout's rows at a stride of 128 bytes; a tile of rows is x's rows at their own
// stride. k pairs beyond the last whole tile of 16 are added with AVX512-BF16's dot product.
// Built only on CPUs that report AMX-BF16 (runtime.target.kernels).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "avx512_round.h"
#include "bf16_packed.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kBlockCols = kPackedBlockCols;
constexpr int64_t kTileRows = 16;   // rows of x per tile
constexpr int64_t kTilePairs = 16;  // k pairs per tile product: 32 bf16 of each row, 64 bytes
constexpr int64_t kGroupCols = 16;  // output columns per accumulator tile
constexpr int64_t kStepRows = 2 * kTileRows;    // rows of a step: two row tiles sharing each weight tile ...
constexpr int64_t kStepCols = 4 * kGroupCols;   // ... or one row tile against two blocks' four groups

// Tiles: 0 and 7 hold rows of x (the step's first and second 16), 5 and 6 weight tiles, and 1-4 the accumulators:
// four groups of 16 columns for one row tile, or two groups for each of two row tiles.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tile shapes for a step of `first` rows (1-16) and `second` more (0-16: 0 is a step of one row tile).
void configure_tiles(int64_t first, int64_t second) {
  TileConfig config;
  std::memset(&config, 0, sizeof(config));
  config.palette_id = 1;
  const int64_t rows[8] = {first, first, first, second > 0 ? second : first, second > 0 ? second : first,
                           kTilePairs, kTilePairs, second};
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = static_cast<uint8_t>(rows[t]);
    config.colsb[t] = rows[t] > 0 ? 64 : 0;
  }
  _tile_loadconfig(&config);
}

// The weight tile of group g (block g / 2, columns 16 (g % 2) ..) at the tile of k pairs starting at pair p.
inline const uint16_t* weight_tile(const uint16_t* blocks, int64_t pairs, int g, int64_t p) {
  return blocks + (g / 2) * pairs * 2 * kBlockCols + p * 2 * kBlockCols + (g % 2) * 2 * kGroupCols;
}

// ROW_TILES tiles of rows of x (row stride x_stride elements) times GROUPS groups of 16 columns from `blocks` (the
// first of one or two packed blocks) over the whole tiles of k -> sums [32, 64] fp32: row m, column 16 g + c.
// ROW_TILES x GROUPS is 1 x 2, 1 x 4 or 2 x 2: accumulator 1 + GROUPS r + g holds row tile r, group g.
template <int ROW_TILES, int GROUPS>
void tile_products(const uint16_t* x, int64_t x_stride, const uint16_t* blocks, int64_t pairs, int64_t tiles,
                   float* sums) {
  static_assert(ROW_TILES * GROUPS <= 4 && (ROW_TILES == 1 || GROUPS == 2), "four accumulator tiles");
  _tile_zero(1);
  _tile_zero(2);
  if constexpr (ROW_TILES * GROUPS > 2) {
    _tile_zero(3);
    _tile_zero(4);
  }
  const int64_t x_bytes = x_stride * sizeof(uint16_t), weight_stride = 2 * kBlockCols * sizeof(uint16_t);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t p = t * kTilePairs;
    _tile_loadd(0, x + 2 * p, x_bytes);
    if constexpr (ROW_TILES == 2) _tile_loadd(7, x + kTileRows * x_stride + 2 * p, x_bytes);
    _tile_loadd(5, weight_tile(blocks, pairs, 0, p), weight_stride);
    _tile_loadd(6, weight_tile(blocks, pairs, 1, p), weight_stride);
    _tile_dpbf16ps(1, 0, 5);
    _tile_dpbf16ps(2, 0, 6);
    if constexpr (ROW_TILES == 2) {
      _tile_dpbf16ps(3, 7, 5);
      _tile_dpbf16ps(4, 7, 6);
    }
    if constexpr (GROUPS == 4) {
      _tile_loadd(5, weight_tile(blocks, pairs, 2, p), weight_stride);
      _tile_loadd(6, weight_tile(blocks, pairs, 3, p), weight_stride);
      _tile_dpbf16ps(3, 0, 5);
      _tile_dpbf16ps(4, 0, 6);
    }
  }
  const int64_t sums_bytes = kStepCols * sizeof(float);
  _tile_stored(1, sums, sums_bytes);
  _tile_stored(2, sums + kGroupCols, sums_bytes);
  if constexpr (ROW_TILES == 2) {
    _tile_stored(3, sums + kTileRows * kStepCols, sums_bytes);
    _tile_stored(4, sums + kTileRows * kStepCols + kGroupCols, sums_bytes);
  }
  if constexpr (GROUPS == 4) {
    _tile_stored(3, sums + 2 * kGroupCols, sums_bytes);
    _tile_stored(4, sums + 3 * kGroupCols, sums_bytes);
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
  const PackedOperands a = packed_operands(x, packed, N, bias);
  const int64_t tiles = a.pairs / kTilePairs;
  // Steps of up to 32 rows: beyond 16, two row tiles share each weight tile read (one block at a time); up to 16, one
  // row tile takes two blocks at a time. Threads split the blocks.
  at::parallel_for(0, a.blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kStepRows * kStepCols];
    for (int64_t m0 = 0; m0 < a.M; m0 += kStepRows) {
      const int64_t count = std::min(kStepRows, a.M - m0);
      const bool tall = count > kTileRows;
      configure_tiles(std::min(kTileRows, count), tall ? count - kTileRows : 0);
      const uint16_t* xm = a.x + m0 * a.x_stride;
      for (int64_t b = begin; b < end; b += tall ? 1 : 2) {
        const uint16_t* bw = a.w + b * a.pairs * 2 * kBlockCols;
        const int groups = !tall && b + 1 < end ? 4 : 2;
        if (tall) {
          tile_products<2, 2>(xm, a.x_stride, bw, a.pairs, tiles, sums);
        } else if (groups == 4) {
          tile_products<1, 4>(xm, a.x_stride, bw, a.pairs, tiles, sums);
        } else {
          tile_products<1, 2>(xm, a.x_stride, bw, a.pairs, tiles, sums);
        }
        for (int g = 0; g < groups; ++g) {
          const int64_t column = b * kBlockCols + g * kGroupCols;
          if (column >= N) break;
          const __mmask16 keep = (__mmask16)((1u << std::min<int64_t>(kGroupCols, N - column)) - 1);
          const __m512 shift = a.b != nullptr ? _mm512_loadu_ps(a.b + column) : _mm512_setzero_ps();
          for (int64_t m = 0; m < count; ++m) {
            __m512 acc = _mm512_loadu_ps(sums + m * kStepCols + g * kGroupCols);
            for (int64_t p = tiles * kTilePairs; p < a.pairs; ++p) {
              const __m512bh weights = (__m512bh)_mm512_loadu_si512(weight_tile(bw, a.pairs, g, p));
              acc = _mm512_dpbf16_ps(acc, weights, pair_of(xm + m * a.x_stride + 2 * p));
            }
            _mm256_mask_storeu_epi16(a.o + (m0 + m) * N + column, keep, round_to_bf16(_mm512_add_ps(acc, shift)));
          }
        }
      }
    }
    _tile_release();
  });
  return a.out;
}

#ifndef HEADSTART_ONE_MODULE  // lean_layers.cpp's build links this source into its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("enable_amx", &enable_amx, "request the AMX tile state from Linux; whether granted");
  m.def("bf16_amx_linear", &bf16_amx_linear,
        "x [M, K] bf16 @ (weight [N, K] packed) ^T (+ bias [N]) -> [M, N] bf16", pybind11::arg("x"),
        pybind11::arg("packed"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none());
}
#endif
