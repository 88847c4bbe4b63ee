// What the bf16 linear-layer kernels share around their products: the checked fp32 bias and the one rounding.
#pragma once

#include <torch/extension.h>

#include <cstdint>

// The bias [N] of a bf16 linear layer as fp32, checked; an undefined tensor when there is none.
inline torch::Tensor linear_bias_fp32(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return torch::Tensor();
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->device().is_cpu(), "expected a bias [N]");
  return bias->to(torch::kFloat32).contiguous();
}

// out[m, n] = bf16(product[m, n] + bias[n]) for every row m and n in [begin, end): the layer's one rounding, to
// nearest even as Tensor.to. bias may be null.
inline void round_rows(const float* product, const float* bias, at::BFloat16* out, int64_t M, int64_t N,
                       int64_t begin, int64_t end) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = begin; n < end; ++n) {
      const float value = bias != nullptr ? product[m * N + n] + bias[n] : product[m * N + n];
      out[m * N + n] = at::BFloat16(value);
    }
  }
}
