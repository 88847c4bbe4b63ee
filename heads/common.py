"""What a head needs to know about its target: stock layer classes, a signature to check, a tokenizer fingerprint.

Draft layers are Llama-style for every target family (``draft_layer_config``): what the serving engines and the
published heads build. Their shapes and rotary settings come from the target's config.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json

import torch
import torch.nn.functional as F
from torch import nn


def cache_argument(module: nn.Module, cache) -> dict:
    """``{name: cache}`` to pass a cache object to a stock transformers model, decoder layer or attention module.

    transformers 5.24 renamed the argument from ``past_key_values`` to ``cache``; the old name still works there
    with a FutureWarning and goes away in 5.40, while releases before 5.24 know only the old name.
    """
    return {_cache_argument_name(type(module).forward): cache}


@functools.cache
def _cache_argument_name(forward) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def draft_rope_parameters(target_config) -> dict:
    """The target's rotary settings for a draft layer: ``rope_parameters`` (transformers 5), or the full-attention
    entry where a family keeps one per layer type (Gemma-3), or the legacy ``rope_theta``/``rope_scaling``."""
    params = getattr(target_config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    if not isinstance(params, dict) or "rope_theta" not in params:
        params = dict(getattr(target_config, "rope_scaling", None) or {"rope_type": "default"})
        params["rope_theta"] = float(getattr(target_config, "rope_theta", 10000.0))
    return {key: value for key, value in params.items() if value is not None}


def draft_layer_config(target_config, num_layers: int = 1):
    """A ``LlamaConfig`` for the draft layers of an EAGLE head, derived from any target's config.

    The serving engines (SGLang, vLLM), the EAGLE authors' code and SpecForge build the draft layer Llama-style for
    every target family: no q/k/v bias (Qwen2), no q/k norm (Qwen3), SwiGLU with SiLU, RMSNorm ``w * x``. A head
    built from the target's own layer class would not export to them. The shapes and rotary settings are the
    target's: hidden size, heads, key/value heads, head width, MLP width, norm epsilon, rope.
    """
    from transformers import LlamaConfig

    heads = int(target_config.num_attention_heads)
    hidden = int(target_config.hidden_size)
    head_dim = getattr(target_config, "head_dim", None) or hidden // heads
    kv_heads = getattr(target_config, "num_key_value_heads", None) or heads
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=int(target_config.intermediate_size), num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=int(kv_heads),
        head_dim=int(head_dim), hidden_act="silu", rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(getattr(target_config, "max_position_embeddings", 2048)),
        rope_parameters=draft_rope_parameters(target_config), attention_bias=False, mlp_bias=False,
        vocab_size=int(target_config.vocab_size), tie_word_embeddings=False)
    config._attn_implementation = "sdpa"  # stock SDPA takes the runtime's 4D boolean tree masks
    return config


def draft_layer_classes() -> tuple[type, type]:
    """(DecoderLayer class, RotaryEmbedding class) of EAGLE draft layers: Llama's, whatever the target (see
    ``draft_layer_config``)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    return LlamaDecoderLayer, LlamaRotaryEmbedding


def tokenizer_fingerprint(tokenizer) -> str | None:
    """A short hash of the vocabulary (token -> id), so a head can refuse a target with a different tokenizer."""
    if tokenizer is None:
        return None
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def output_vocab_size(target_model_or_config) -> int:
    """Rows of the target's LM head (may exceed the tokenizer's vocabulary; padded vocabularies are common)."""
    model = target_model_or_config
    if isinstance(model, nn.Module) and model.get_output_embeddings() is not None:
        return int(model.get_output_embeddings().weight.shape[0])
    config = getattr(model, "config", model)
    return int(config.vocab_size)


def target_signature(target_model_or_config, identity: str | None = None, tokenizer=None) -> dict:
    """What a head checkpoint records about its target, and what loading compares."""
    config = getattr(target_model_or_config, "config", target_model_or_config)
    return {
        "identity": identity,
        "model_type": config.model_type,
        "hidden_size": int(config.hidden_size),
        "vocab_size": output_vocab_size(target_model_or_config),
        "num_hidden_layers": int(config.num_hidden_layers),
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }


def frozen_target_weights(target_model) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding weight [V, H], LM head weight [V', H]) of a transformers causal LM, detached."""
    embed = target_model.get_input_embeddings().weight.detach()
    lm_head = target_model.get_output_embeddings().weight.detach()
    return embed, lm_head


def softcap_logits(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma-style final logit soft-capping: softcap * tanh(logits / softcap); unchanged when softcap is None/0."""
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


class FrozenProjection(nn.Module):
    """hidden [..., H] -> logits [..., V] over a weight [V, H] a head borrows from its target (the target's LM head):
    a non-persistent buffer, never saved, attached when the head is built or loaded."""

    def __init__(self):
        super().__init__()
        self.register_buffer("weight", torch.empty(0), persistent=False)

    @property
    def attached(self) -> bool:
        return self.weight.numel() > 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight.to(hidden.dtype))
