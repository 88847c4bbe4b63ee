// RMSNorm of a few bf16 rows in one call, the same operations as the Llama-family RMSNorm of transformers:
// weight * bf16(x * rsqrt(mean(x^2) + eps)), with x widened to fp32 and two roundings to bf16 (the normalised row,
// then its product with the weight). Only the order of the fp32 sum of squares differs from PyTorch's mean.
//
// The module's forward is eight PyTorch calls with a fixed cost each (scripts/bench_decode_ops.py), and a decode
// pass runs two per layer. This is one call.
#include <torch/extension.h>

#include "bf16_bits.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

// x [..., H] bf16 (contiguous), weight [H] bf16 -> [..., H] bf16
torch::Tensor rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16,
              "expected bfloat16 rows and weight");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.device().is_cpu() && weight.device().is_cpu(),
              "expected contiguous CPU tensors");
  const int64_t H = weight.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == H, "expected rows of the weight's size");
  const int64_t M = x.numel() / H;
  auto out = torch::empty_like(x);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float epsilon = static_cast<float>(eps);  // PyTorch adds a Python float to a float tensor in fp32
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* row = xp + m * H;
    __m256 squares = _mm256_setzero_ps();
    int64_t h = 0;
    for (; h + 8 <= H; h += 8) {
      __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + h));
      __m256 values = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
      squares = _mm256_fmadd_ps(values, values, squares);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, squares);
    float sum = 0.0f;
    for (float lane : lanes) sum += lane;
    for (; h < H; ++h) sum += widen(row[h]) * widen(row[h]);
    const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(H) + epsilon);
    for (h = 0; h < H; ++h) {
      const float normalised = round_bf16(widen(row[h]) * inverse);
      op[m * H + h] = at::BFloat16(widen(wp[h]) * normalised).x;
    }
  }
  return out;
}

#ifndef HEADSTART_ONE_MODULE  // lean_layers.cpp's build links this source into its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm_rows", &rms_norm_rows, "weight * bf16(x * rsqrt(mean(x^2) + eps)) over bf16 rows",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"));
}
#endif
