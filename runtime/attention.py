"""Tree-attention backends. Pure tensor functions plus the one adapter transformers calls.

Shapes: query [B, H, T, D]; key/value [B, Hkv, S, D] (H a multiple of Hkv: grouped-query attention);
mask [B, 1, T, S] bool, True = may attend. Every backend returns [B, H, T, D] and must agree with SDPA.

Backends:
- ``sdpa``: ``F.scaled_dot_product_attention`` with a boolean mask and ``enable_gqa`` (no K/V copy per group). In
  bf16 on CPU, passes of up to 16 query rows (decode steps, verified trees) go through the compiled decode kernel
  (``runtime.kernels.decode_attention``): PyTorch's CPU SDPA has a large fixed cost per call at that size, mostly
  setup (``scripts/bench_decode_ops.py`` measures both); fp32 softmax and sums over the same bf16 values.
- ``flex``: FlexAttention with a mask_mod reading the same boolean mask (forward-only on CPU).
- ``cascade``: the flash-attn 2 path for CUDA. flash-attn has no arbitrary-mask kernel, so the prefix (which every
  tree node sees whole) is attended with a maskless kernel that returns its log-sum-exp, the tree's own keys with the
  small tree mask, and the two partial results are merged by log-sum-exp. Off CUDA the prefix kernel is the
  reference implementation below, which is also what the CUDA kernel is tested against.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F

from runtime.kernels import decode_attention

BACKENDS = ("sdpa", "flex", "cascade")
ATTN_IMPLEMENTATION = "headstart_tree"  # the name registered with transformers' AttentionInterface
DECODE_KERNEL_MAX_ROWS = 16
DECODE_KERNEL_HEAD_SIZES = (64, 128)


def sdpa_attention(query, key, value, mask, scale: float) -> torch.Tensor:
    """SDPA over a boolean mask (None = causal when T == S). Returns [B, H, T, D]."""
    rows = query.shape[2]
    causal = mask is None and rows > 1
    if (not causal and rows <= DECODE_KERNEL_MAX_ROWS and query.device.type == "cpu"
            and query.dtype == key.dtype == value.dtype == torch.bfloat16
            and query.shape[-1] in DECODE_KERNEL_HEAD_SIZES and not torch.is_grad_enabled()
            and (kernel := decode_attention()) is not None):
        # [B, T, H, D] underneath: the caller's transpose back to that layout is then free
        return kernel(query, key, value, mask, scale).transpose(1, 2)
    gqa = query.shape[1] != key.shape[1]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=gqa)


def flex_attention(query, key, value, mask, scale: float) -> torch.Tensor:
    """FlexAttention with a block mask built from the boolean mask. Returns [B, H, T, D]."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention as flex

    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    if mask is None:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)[None, None]
    dense = mask.expand(batch, 1, q_len, kv_len)

    def mask_mod(b, h, q_idx, kv_idx):
        return dense[b, 0, q_idx, kv_idx]

    block_mask = create_block_mask(mask_mod, batch, None, q_len, kv_len, device=query.device)
    return flex(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1])


def attention_with_lse(query, key, value, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention returning (out [B, H, T, D], lse [B, H, T]); mask [B, 1, T, S] bool or None (all).

    Computed in float32. A row that may attend to nothing gets out = 0 and lse = -inf, so merging ignores it.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q = query.float().reshape(batch, kv_heads, groups, q_len, dim)
    scores = torch.einsum("bkgtd,bksd->bkgts", q, key.float()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G, T]
    weights = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
    weights = torch.nan_to_num(weights, nan=0.0)
    out = torch.einsum("bkgts,bksd->bkgtd", weights, value.float())
    return out.reshape(batch, heads, q_len, dim), lse.reshape(batch, heads, q_len)


def merge_attention(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results over disjoint key sets. out [B, H, T, D] (float32), lse [B, H, T]."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    weight_a = torch.exp(lse_a - safe).unsqueeze(-1)
    weight_b = torch.exp(lse_b - safe).unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse


def flash_prefix_attention(query, key, value, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Maskless attention of all queries to the prefix with flash-attn 2 (CUDA). Same contract as the reference."""
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                  softmax_scale=scale, causal=False, return_attn_probs=True)
    return out.transpose(1, 2).float(), lse.float()


def reference_prefix_attention(query, key, value, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_with_lse(query, key, value, None, scale)


def flash_attn_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None


def cascade_attention(query, key, value, mask, scale: float, prefix_len: int,
                      prefix_kernel: Callable | None = None) -> torch.Tensor:
    """Prefix part with a maskless kernel + tree part with the mask, merged by log-sum-exp. Returns [B, H, T, D].

    ``mask[..., :prefix_len]`` must be all True (every query sees the whole prefix): the prefix kernel has no mask.
    """
    if prefix_kernel is None:
        prefix_kernel = flash_prefix_attention if flash_attn_available(query.device) else reference_prefix_attention
    if prefix_len == 0:
        out, _ = attention_with_lse(query, key, value, mask, scale)
        return out.to(query.dtype)
    out_prefix, lse_prefix = prefix_kernel(query, key[:, :, :prefix_len], value[:, :, :prefix_len], scale)
    tree_mask = None if mask is None else mask[..., prefix_len:]
    out_tree, lse_tree = attention_with_lse(query, key[:, :, prefix_len:], value[:, :, prefix_len:], tree_mask, scale)
    out, _ = merge_attention(out_prefix, lse_prefix, out_tree, lse_tree)
    return out.to(query.dtype)


def tree_attention(query, key, value, mask, scale: float, backend: str = "sdpa",
                   prefix_len: int | None = None) -> torch.Tensor:
    """Dispatch to one backend. Returns [B, H, T, D]."""
    if backend == "sdpa":
        return sdpa_attention(query, key, value, mask, scale)
    if backend == "flex":
        return flex_attention(query, key, value, mask, scale)
    if backend == "cascade":
        if prefix_len is None:
            raise ValueError("the cascade backend needs prefix_len (the number of cached positions every query sees)")
        return cascade_attention(query, key, value, mask, scale, prefix_len)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def default_backend(device: torch.device) -> str:
    """The flash-attn cascade on CUDA when flash-attn is importable; SDPA otherwise."""
    return "cascade" if flash_attn_available(device) else "sdpa"


def available_backends(device: torch.device) -> list[str]:
    """Backends that run on ``device`` here (cascade always runs: off CUDA with its reference prefix kernel)."""
    names = ["sdpa", "cascade"]
    try:
        from torch.nn.attention import flex_attention as _  # noqa: F401

        names.append("flex")
    except ImportError:
        pass
    return names


def transformers_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                   scaling: float | None = None, tree_backend: str = "sdpa",
                                   prefix_len: int | None = None, **kwargs):
    """The function transformers' attention modules call (registered as ``ATTN_IMPLEMENTATION``).

    The backend and prefix length arrive as forward kwargs, so they flow through arguments, not model state.
    Returns (out [B, T, H, D], None) as transformers expects.
    """
    if kwargs.get("softcap") is not None:
        raise ValueError("attention logit soft-capping (Gemma-2 style) is not supported by the tree backends")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = tree_attention(query, key, value, attention_mask, scale, tree_backend, prefix_len)
    return out.transpose(1, 2).contiguous(), None


def register_with_transformers() -> str:
    """Register the tree attention with transformers once; returns the attn_implementation name to load with."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, transformers_attention_forward)
    # Plain 2D masks (training, HF generate) get the same boolean masks SDPA gets.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION
