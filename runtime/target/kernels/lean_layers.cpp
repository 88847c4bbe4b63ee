// The lean pass's stack of decoder layers in one call (runtime.target.lean.LeanLlama): each layer the same
// operations as LeanLlama._layer, in the same order and dtypes (the kernels' own functions and the same ATen ops), so
// the results are equal bit for bit. A pass of a few rows does about twenty small operations per layer beside its
// four products, and from Python each costs a few microseconds of interpreter and binding around it
// (scripts/bench_verify_pass.py times the pass both ways); from here each is one ATen call or a kernel's function.
// Built with the kernels' sources into one module; with HEADSTART_AMX the products are the AMX tile kernel's.
#include <torch/extension.h>

#include <vector>

#include "kernels.h"

namespace {

torch::Tensor product(const torch::Tensor& x, const torch::Tensor& packed, int64_t N) {
#ifdef HEADSTART_AMX
  return bf16_amx_linear(x, packed, N, c10::nullopt);
#else
  return bf16_packed_linear(x, packed, N, c10::nullopt);
#endif
}

}  // namespace

// x [B * T, H] bf16: the pass's embedded rows; weights: per layer, in order, the packed qkv, o, gate_up and down
// weights (pack_bf16_weight), the input and post-attention norms' weights; sizes: per layer the four products'
// output sizes; eps: per layer the norms' epsilon; cos, sin [B, T, 1, D] (sin with its first half negated); written
// [L, 2, B, Hkv, T, D] and read [L, 2, B, Hkv, S, D]: the cache's views for the pass (KVCache.pass_views); mask
// [B, 1, T, S] bool or None; kept: the layers whose inputs are returned. -> [x after the last layer, the kept inputs].
std::vector<torch::Tensor> lean_layers(torch::Tensor x, const std::vector<torch::Tensor>& weights,
                                       const std::vector<int64_t>& sizes, const std::vector<double>& eps,
                                       const torch::Tensor& cos, const torch::Tensor& sin,
                                       const torch::Tensor& written, const torch::Tensor& read,
                                       const c10::optional<torch::Tensor>& mask, int64_t batch, int64_t rows,
                                       int64_t heads, int64_t kv_heads, int64_t intermediate, double scale,
                                       const std::vector<int64_t>& kept) {
  const int64_t layers = static_cast<int64_t>(eps.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 6 * layers && static_cast<int64_t>(sizes.size()) == 4 * layers,
              "expected six weights and four sizes per layer");
  TORCH_CHECK(written.size(0) == layers && read.size(0) == layers, "expected the cache views of every layer");
  const int64_t dim = cos.size(-1);
  std::vector<torch::Tensor> out(1 + kept.size());
  size_t next = 0;
  for (int64_t index = 0; index < layers; ++index) {
    if (next < kept.size() && kept[next] == index) out[1 + next++] = x.view({batch, rows, -1});
    const torch::Tensor* w = weights.data() + 6 * index;
    const int64_t* n = sizes.data() + 4 * index;
    torch::Tensor h = rms_norm_rows(x, w[4], eps[index]);
    const torch::Tensor qkv = product(h, w[0], n[0]).view({batch, rows, heads + 2 * kv_heads, dim});
    torch::Tensor qk = qkv.slice(2, 0, heads + kv_heads);
    qk = qk * cos + qk.roll({dim / 2}, {-1}) * sin;
    const torch::Tensor query = qk.slice(2, 0, heads).transpose(1, 2);
    const torch::Tensor key = qk.slice(2, heads).transpose(1, 2);
    const torch::Tensor value = qkv.slice(2, heads + kv_heads).transpose(1, 2);
    const torch::Tensor into = written[index], from = read[index];
    into[0].copy_(key);
    into[1].copy_(value);
    const torch::Tensor attended = decode_attention(query, from[0], from[1], mask, scale, c10::nullopt);
    x = x + product(attended.reshape({batch * rows, heads * dim}), w[1], n[1]);
    h = rms_norm_rows(x, w[5], eps[index]);
    const torch::Tensor gate_up = product(h, w[2], n[2]);
    const torch::Tensor act = at::silu(gate_up.slice(1, 0, intermediate)) * gate_up.slice(1, intermediate);
    x = x + product(act, w[3], n[3]);
  }
  TORCH_CHECK(next == kept.size(), "expected kept layers in increasing order, each below the number of layers");
  out[0] = x;
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lean_layers", &lean_layers, "the lean pass's decoder layers over the cache's pass views (lean.py)");
#ifdef HEADSTART_AMX
  m.def("enable_amx", &enable_amx, "request the AMX tile state from Linux; whether granted");
#endif
}
