"""Tree-attention backends. Pure tensor functions plus the one adapter transformers calls.

Shapes: query [B, H, T, D]; key/value [B, Hkv, S, D] (H a multiple of Hkv: grouped-query attention);
mask [B, 1, T, S] bool, True = may attend. Every backend returns [B, H, T, D] and must agree with SDPA.

Backends:
- ``sdpa``: ``F.scaled_dot_product_attention`` with a boolean mask and ``enable_gqa`` (no K/V copy per group). In
  bf16 on CPU, passes of up to 16 query rows (decode steps, verified trees) go through the compiled decode kernel
  (``runtime.target.kernels.decode_attention``): PyTorch's CPU SDPA has a large fixed cost per call at that size, mostly
  setup (``scripts/bench_decode_ops.py`` measures both); fp32 softmax and sums over the same bf16 values.
- ``flex``: FlexAttention with a mask_mod reading the same boolean mask (forward-only on CPU).
- ``cascade``: the flash-attn 2 path for CUDA. flash-attn has no arbitrary-mask kernel, so the prefix (which every
  tree node sees whole) is attended with a maskless kernel that returns its log-sum-exp, the tree's own keys with the
  small tree mask, and the two partial results are merged by log-sum-exp. Off CUDA the prefix kernel is the
  reference implementation below, which is also what the CUDA kernel is tested against.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from runtime.target.kernels import decode_attention

BACKENDS = ("sdpa", "flex", "cascade")
ATTN_IMPLEMENTATION = "headstart_tree"  # the name registered with transformers' AttentionInterface
DECODE_KERNEL_MAX_ROWS = 16
DECODE_KERNEL_HEAD_SIZES = (64, 128)
# fp32 scores the reference attention holds at once (256 MB; its softmax makes about two more of that size): a
# long prefill of a soft-capped or windowed layer, which no fused kernel takes, goes in chunks of query rows
MAX_REFERENCE_SCORES = 1 << 26


def decode_kernel_for(query, key, value, rows: int):
    """The compiled decode attention kernel where it takes this pass (``rows`` query rows per batch row, at most
    DECODE_KERNEL_MAX_ROWS; bf16 on CPU; a head size it has; no gradients), else None."""
    if (rows <= DECODE_KERNEL_MAX_ROWS and query.device.type == "cpu"
            and query.dtype == key.dtype == value.dtype == torch.bfloat16
            and query.shape[-1] in DECODE_KERNEL_HEAD_SIZES and not torch.is_grad_enabled()):
        return decode_attention()
    return None


def sdpa_attention(query, key, value, mask, scale: float) -> torch.Tensor:
    """SDPA over a boolean mask (None = causal when T == S). Returns [B, H, T, D]."""
    rows = query.shape[2]
    causal = mask is None and rows > 1
    if not causal and (kernel := decode_kernel_for(query, key, value, rows)) is not None:
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


def attention_with_lse(query, key, value, mask, scale: float, softcap: float | None = None,
                       max_scores: int = MAX_REFERENCE_SCORES) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention returning (out [B, H, T, D], lse [B, H, T]); mask [B or 1, 1, T or 1, S] bool or None
    (all).

    Computed in float32. A row that may attend to nothing gets out = 0 and lse = -inf, so merging ignores it.
    ``softcap``: Gemma-2's attention logit soft-capping, scores -> softcap * tanh(scores / softcap). The query rows
    go in chunks of at most ``max_scores`` scores [B, H, rows, S] each: every row's result is its own, and a long
    prefill through this path (a soft-capped or windowed layer) then needs memory for a chunk, not for T x S.
    """
    batch, heads, q_len, _ = query.shape
    rows = max(1, max_scores // max(1, batch * heads * key.shape[2]))
    if q_len <= rows:
        return _attention_with_lse(query, key, value, mask, scale, softcap)
    parts = [_attention_with_lse(query[:, :, start:start + rows], key, value,
                                 mask if mask is None or mask.shape[2] == 1 else mask[:, :, start:start + rows],
                                 scale, softcap)
             for start in range(0, q_len, rows)]
    return torch.cat([out for out, _ in parts], dim=2), torch.cat([lse for _, lse in parts], dim=2)


def _attention_with_lse(query, key, value, mask, scale: float, softcap: float | None):
    """``attention_with_lse`` for all of ``query``'s rows at once."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q = query.float().reshape(batch, kv_heads, groups, q_len, dim)
    scores = torch.einsum("bkgtd,bksd->bkgts", q, key.float()) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
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


def flash_prefix_attention(query, key, value, scale: float, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Maskless (or causal) attention with flash-attn 2 (CUDA, fp16/bf16). Same contract as the reference."""
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                  softmax_scale=scale, causal=causal, return_attn_probs=True)
    return out.transpose(1, 2).float(), lse.float()


def reference_prefix_attention(query, key, value, scale: float, causal: bool = False) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """The prefix kernel's reference: attention_with_lse over every key, or causally (queries are the last keys)."""
    return attention_with_lse(query, key, value, causal_mask(query.shape[2], key.shape[2], query.device)
                              if causal else None, scale)


def causal_mask(rows: int, keys: int, device) -> torch.Tensor:
    """[1, 1, rows, keys] bool: the rows are the last ``rows`` of the keys and each sees itself and what precedes."""
    return torch.ones(rows, keys, dtype=torch.bool, device=device).tril(keys - rows)[None, None]


FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash-attn's kernels take only these


FLASH_MIN_CAPABILITY = (8, 0)  # flash-attn 2 runs on Ampere and newer


def flash_attn_available(device: torch.device, dtype: torch.dtype | None = None) -> bool:
    """Whether flash-attn's kernels can run here: a CUDA GPU of compute capability 8.0 or more, flash-attn
    installed and (when given) a dtype it takes."""
    if device.type != "cuda" or (dtype is not None and dtype not in FLASH_DTYPES):
        return False
    if torch.cuda.get_device_capability(device) < FLASH_MIN_CAPABILITY:
        return False
    return importlib.util.find_spec("flash_attn") is not None


def cascade_attention(query, key, value, mask, scale: float, prefix_len: int,
                      prefix_kernel: Callable | None = None) -> torch.Tensor:
    """Prefix part with a maskless kernel + tree part with the mask, merged by log-sum-exp. Returns [B, H, T, D].

    ``mask[..., :prefix_len]`` must be all True (every query sees the whole prefix): the prefix kernel has no mask.
    ``mask`` None follows SDPA's convention: causal when there are several queries (a prefill), else everything.
    The prefix kernel is flash-attn's where it runs (CUDA, fp16/bf16), the reference elsewhere.
    """
    if prefix_kernel is None:
        use_flash = flash_attn_available(query.device, query.dtype)
        prefix_kernel = flash_prefix_attention if use_flash else reference_prefix_attention
    if mask is None and query.shape[2] > 1:  # a causal pass: the kernel's own causal mode, no merge needed
        out, _ = prefix_kernel(query, key, value, scale, causal=True)
        return out.to(query.dtype)
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


def default_backend(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The flash-attn cascade where flash-attn runs (CUDA, fp16/bf16, installed); SDPA otherwise."""
    return "cascade" if flash_attn_available(device, dtype) else "sdpa"


def available_backends(device: torch.device) -> list[str]:
    """Backends that run on ``device`` here (cascade always runs: off CUDA with its reference prefix kernel)."""
    names = ["sdpa", "cascade"]
    try:
        from torch.nn.attention import flex_attention as _  # noqa: F401

        names.append("flex")
    except ImportError:
        pass
    return names


def sliding_window_mask(mask: torch.Tensor | None, position_ids: torch.Tensor, key_len: int,
                        window: int, key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Restrict a pass's mask to keys fewer than ``window`` positions behind each query (a sliding-window layer).

    mask: [B or 1, 1, T, S] bool or None (causal when T > 1, everything for one row); position_ids [B, T]: the
    queries' positions. By default the first S - T keys are the committed cache, whose slot j holds position j, and
    the last T are the pass's own rows, at the queries' positions. ``key_positions`` [B or 1, S] gives each key
    slot's position instead: a batch whose rows have different committed lengths writes each row's new entries
    right after its own length, not at the end (slots a row's mask excludes may hold any position). Returns
    [B, 1, T, S] bool. A key is kept when query_position - key_position < window, as transformers' sliding-window
    masks do.
    """
    batch, rows = position_ids.shape
    if key_positions is None:
        prefix = key_len - rows
        cached = torch.arange(prefix, device=position_ids.device).expand(batch, prefix)
        key_positions = torch.cat([cached, position_ids], dim=1)  # [B, S]
    elif key_positions.shape[-1] != key_len:
        raise ValueError(f"key_positions covers {key_positions.shape[-1]} key slots, the pass has {key_len}")
    near = (position_ids[:, :, None] - key_positions[:, None, :]) < window  # [B, T, S]
    if mask is None:
        mask = causal_mask(rows, key_len, position_ids.device)
    return mask & near[:, None]


def transformers_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                   scaling: float | None = None, tree_backend: str = "sdpa",
                                   prefix_len: int | None = None, sliding_window: int | None = None,
                                   softcap: float | None = None, key_positions: torch.Tensor | None = None,
                                   ragged=None, **kwargs):
    """The function transformers' attention modules call (registered as ``ATTN_IMPLEMENTATION``).

    The backend and prefix length arrive as forward kwargs, so they flow through arguments, not model state. A
    sliding-window layer (its module passes ``sliding_window``) gets the window applied to the mask here, so every
    backend and every model family sees the same windowed tree mask (``key_positions``, a forward kwarg like the
    backend's, places the keys where a batch's rows have different lengths: see ``sliding_window_mask``); Gemma-2's
    ``softcap`` goes through the reference attention, which takes it. ``ragged`` (``runtime.engine.ragged.RaggedRows``,
    a forward kwarg): the pass's tokens come packed, query [1, H, T', D], each row attending over its own keys with
    its rows of the [B, 1, N, S] mask: the decode kernel takes them packed; any other path lays them out padded and
    back. Returns (out [B, T, H, D], None) as transformers expects ([1, T', H, D] for a packed pass).
    """
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError("this attention has sinks (s_aux: learnt per-head logits beside the keys), which the tree "
                         "attention does not apply: the target cannot be decoded here")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    keys = key.shape[2]
    windowed = sliding_window is not None and keys > sliding_window  # shorter contexts: the window cuts nothing
    if ragged is not None:
        if (tree_backend == "sdpa" and softcap is None and attention_mask is not None
                and (kernel := decode_kernel_for(query, key, value, ragged.width)) is not None):
            if windowed:
                attention_mask = sliding_window_mask(attention_mask, ragged.positions, keys, sliding_window,
                                                     key_positions)
            return kernel(query, key, value, attention_mask, scale, ragged.counts), None
        out, _ = transformers_attention_forward(module, ragged.pad(query, 2), key, value, attention_mask, dropout,
                                                scaling, tree_backend, prefix_len, sliding_window, softcap,
                                                key_positions, **{**kwargs, "position_ids": ragged.positions})
        return ragged.pack(out), None
    if windowed:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise ValueError("a sliding-window layer needs position_ids to place its window; pass position_ids")
        attention_mask = sliding_window_mask(attention_mask, position_ids, keys, sliding_window, key_positions)
    if softcap is not None or (windowed and tree_backend == "cascade"):
        # No fused kernel takes soft-capping, and the cascade's prefix kernel sees the whole prefix where a window
        # cuts into it: attend over the full mask with the reference (None is causal for several rows, as in SDPA),
        # which takes the query rows in chunks so that a long prefill's scores fit in memory.
        if attention_mask is None and query.shape[2] > 1:
            attention_mask = causal_mask(query.shape[2], keys, query.device)
        out, _ = attention_with_lse(query, key, value, attention_mask, scale, softcap)
        out = out.to(query.dtype)
    else:
        out = tree_attention(query, key, value, attention_mask, scale, tree_backend, prefix_len)
    return out.transpose(1, 2).contiguous(), None


def use_tree_attention(module: torch.nn.Module) -> torch.nn.Module:
    """Point the attention of every layer of ``module`` at the tree attention, in place; returns it. For modules the
    runtime owns (a draft head it loaded): their few-row drafting passes then take the decode kernel where the
    target's do (PyTorch's SDPA costs milliseconds per call at a batch of rows, ``scripts/bench_decode_ops.py``).
    With gradients, or where no kernel applies, the tree attention is SDPA over the same mask."""
    name = register_with_transformers()
    for config in _layer_configs(module):
        config._attn_implementation = name
    return module


@contextmanager
def tree_attention_for(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``use_tree_attention`` for the passes inside only, for a pass that needs what only the tree attention takes
    (rows packed, ``runtime.engine.ragged``), so a module a user hands us is not changed (``attention_set_to``)."""
    configs = _layer_configs(module)
    if not configs:
        raise ValueError(f"{type(module).__name__} has no layer whose config chooses its attention, so its passes "
                         f"cannot take the tree attention; build its layers from a transformers config")
    with attention_set_to(register_with_transformers(), configs):
        yield module


@contextmanager
def attention_set_to(name: str, configs: list) -> Iterator[None]:
    """``configs`` choose attention ``name`` for the passes inside; each config's own setting comes back afterwards,
    sub-configs included: the setter writes one value down into every sub-config, which would flatten a composite
    model's per-part choices (eager for a text part, sdpa for a vision part) when restored."""
    stock = [(config, config._attn_implementation_internal) for top in configs for config in _config_tree(top)]
    for config in configs:
        config._attn_implementation = name
    try:
        yield
    finally:
        for config, setting in stock:
            config._attn_implementation_internal = setting


def _layer_configs(module: torch.nn.Module) -> list:
    """The distinct configs the layers of ``module`` read their attention implementation from."""
    found: dict[int, object] = {}
    for child in module.modules():
        config = getattr(child, "config", None)
        if config is not None and hasattr(config, "_attn_implementation_internal"):
            found.setdefault(id(config), config)
    return list(found.values())


def _config_tree(config) -> list:
    """``config`` and its sub-configs, recursively (a composite model's text and vision parts)."""
    found = [config]
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "_attn_implementation_internal"):
            found += _config_tree(sub)
    return found


def register_with_transformers() -> str:
    """Register the tree attention with transformers once; returns the attn_implementation name to load with."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, transformers_attention_forward)
    # Plain 2D masks (training, HF generate) get the same boolean masks SDPA gets.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION
