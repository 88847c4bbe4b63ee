// The lean pass's stack of decoder layers in one call (runtime.target.lean.LeanLlama): each layer the same
// operations as LeanLlama._layer, in the same order and dtypes (the kernels' own functions and the same ATen ops), so
// the results are equal bit for bit. A pass of a few rows does about twenty small operations per layer beside its
// four products, and from Python each costs a few microseconds of interpreter and binding around it
// (scripts/bench_verify_pass.py times the pass both ways); from here each is one ATen call or a kernel's function.
// Built with the kernels' sources into one module; with HEADSTART_AMX the products are the AMX tile kernel's, with
// HEADSTART_AVX2 the AVX2 packed kernel's (CPUs without AVX512-BF16), else the AVX512-BF16 packed kernel's.
#include <torch/extension.h>

#include "bf16_bits.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

// Rotary on the query and key heads of qkv [B, T, Hq + 2 Hkv, D] (bf16, contiguous) with cos, sin [B, T, 1, D] (sin's
// first half negated): each value bf16(bf16(x cos) + bf16(roll(x, D / 2) sin)), as the three bf16 ATen ops of
// LeanLlama._layer compute it. The queries go to query [B, T, Hq, D] (contiguous), the keys to key [B, Hkv, T, D] and
// the values, unrotated, to value [B, Hkv, T, D] (the cache's slots for the pass: any strides, the last dimension's 1).
void rotate_into(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& query,
                 torch::Tensor& key, torch::Tensor& value, int64_t heads, int64_t kv_heads) {
  const int64_t B = qkv.size(0), T = qkv.size(1), D = qkv.size(3), half = D / 2, all = heads + 2 * kv_heads;
  const auto* src = reinterpret_cast<const uint16_t*>(qkv.data_ptr<at::BFloat16>());
  const auto* cp = reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>());
  const auto* sp = reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>());
  auto* qp = reinterpret_cast<uint16_t*>(query.data_ptr<at::BFloat16>());
  auto* kp = reinterpret_cast<uint16_t*>(key.data_ptr<at::BFloat16>());
  auto* vp = reinterpret_cast<uint16_t*>(value.data_ptr<at::BFloat16>());
  const int64_t kb = key.stride(0), kh = key.stride(1), kt = key.stride(2);
  const int64_t vb = value.stride(0), vh = value.stride(1), vt = value.stride(2);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const uint16_t* row = src + (b * T + t) * all * D;
      const uint16_t *c = cp + (b * T + t) * D, *s = sp + (b * T + t) * D;
      for (int64_t h = 0; h < all; ++h) {
        const uint16_t* x = row + h * D;
        uint16_t* out = h < heads ? qp + ((b * T + t) * heads + h) * D
                                  : (h < heads + kv_heads ? kp + b * kb + (h - heads) * kh + t * kt
                                                          : vp + b * vb + (h - heads - kv_heads) * vh + t * vt);
        if (h >= heads + kv_heads) {
          std::memcpy(out, x, D * sizeof(uint16_t));
          continue;
        }
        for (int64_t d = 0; d < D; ++d) {
          const float a = round_bf16(widen(x[d]) * widen(c[d]));
          const float r = round_bf16(widen(x[(d + half) % D]) * widen(s[d]));
          out[d] = at::BFloat16(a + r).x;
        }
      }
    }
  }
}

torch::Tensor product(const torch::Tensor& x, const torch::Tensor& packed, int64_t N) {
#if defined(HEADSTART_AMX)
  return bf16_amx_linear(x, packed, N, c10::nullopt);
#elif defined(HEADSTART_AVX2)
  return bf16_packed_linear_avx2(x, packed, N, c10::nullopt);
#else
  return bf16_packed_linear(x, packed, N, c10::nullopt);
#endif
}

}  // namespace

// x [B * T, H] bf16: the pass's embedded rows; weights: per layer, in order, the packed qkv, o, gate_up and down
// weights (pack_bf16_weight), the input and post-attention norms' weights; sizes: per layer the four products'
// output sizes; eps: per layer the norms' epsilon; cos, sin [B, T, 1, D] (sin with its first half negated); written
// [L, 2, B, Hkv, T, D] and read [L, 2, B, Hkv, S, D]: the cache's views for the pass (KVCache.pass_views); mask
// [B, 1, T, S] bool or None; kept: the layers whose inputs are returned; first_input [B * T, K] or None: what the
// first layer's q, k and v read instead of its input norm of x (an EAGLE-3 draft layer's two norms side by side, K =
// 2H; runtime.proposers.lean_head). -> [x after the last layer, the kept inputs].
std::vector<torch::Tensor> lean_layers(torch::Tensor x, const std::vector<torch::Tensor>& weights,
                                       const std::vector<int64_t>& sizes, const std::vector<double>& eps,
                                       const torch::Tensor& cos, const torch::Tensor& sin,
                                       const torch::Tensor& written, const torch::Tensor& read,
                                       const c10::optional<torch::Tensor>& mask, int64_t batch, int64_t rows,
                                       int64_t heads, int64_t kv_heads, int64_t intermediate, double scale,
                                       const std::vector<int64_t>& kept,
                                       const c10::optional<torch::Tensor>& first_input) {
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
    torch::Tensor h = index == 0 && first_input.has_value() ? *first_input : rms_norm_rows(x, w[4], eps[index]);
    const torch::Tensor qkv = product(h, w[0], n[0]).view({batch, rows, heads + 2 * kv_heads, dim});
    torch::Tensor query = torch::empty({batch, rows, heads, dim}, qkv.options());
    const torch::Tensor into = written[index], from = read[index];
    torch::Tensor key = into[0], value = into[1];
    TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1 && cos.is_contiguous() && sin.is_contiguous(),
                "expected cache slots with a contiguous last dimension and contiguous cos and sin");
    rotate_into(qkv, cos, sin, query, key, value, heads, kv_heads);
    query = query.transpose(1, 2);
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
