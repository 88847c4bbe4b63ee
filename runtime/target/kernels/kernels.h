// The kernels that lean_layers.cpp calls from C++, declared for a build that links their sources into one module
// (each source leaves out its own Python module when HEADSTART_ONE_MODULE is defined).
#pragma once

#include <torch/extension.h>

torch::Tensor bf16_packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                                 const c10::optional<torch::Tensor>& bias);
torch::Tensor bf16_packed_linear_avx2(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                                      const c10::optional<torch::Tensor>& bias);
torch::Tensor rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor decode_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                               const c10::optional<torch::Tensor>& mask, double scale,
                               const c10::optional<torch::Tensor>& counts);
#ifdef HEADSTART_AMX
bool enable_amx();
torch::Tensor bf16_amx_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                              const c10::optional<torch::Tensor>& bias);
#endif
