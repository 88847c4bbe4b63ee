"""What a head needs to know about its target: stock layer classes, a signature to check, a tokenizer fingerprint.

Architecture differences between targets are data: the decoder layer, norm and rotary classes are looked up from the
target's config class in transformers, never re-implemented here.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib
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


def stock_classes(config) -> tuple[type, type]:
    """(DecoderLayer class, RotaryEmbedding class) of the transformers model family that ``config`` belongs to."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    model_type = config.model_type
    if model_type not in MODEL_MAPPING_NAMES:
        raise ValueError(f"transformers has no base model for model_type {model_type!r}; heads need a decoder-only "
                         f"family with a DecoderLayer class (llama, qwen2, mistral, ...)")
    model_name = MODEL_MAPPING_NAMES[model_type]
    module = importlib.import_module(f"transformers.models.{model_type_to_module_name(model_type)}.modeling_"
                                     f"{model_type_to_module_name(model_type)}")
    prefix = model_name[: -len("Model")] if model_name.endswith("Model") else model_name
    layer_cls = getattr(module, f"{prefix}DecoderLayer", None)
    rotary_cls = getattr(module, f"{prefix}RotaryEmbedding", None)
    if layer_cls is None or rotary_cls is None:
        raise ValueError(f"{module.__name__} has no {prefix}DecoderLayer/{prefix}RotaryEmbedding; "
                         f"model_type {model_type!r} is not supported by the draft heads")
    return layer_cls, rotary_cls


def head_layer_config(target_config, num_layers: int = 1):
    """A copy of the target's config for the head's own layers: stock SDPA attention (takes 4D bool masks)."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = num_layers
    config._attn_implementation = "sdpa"
    # Heads have no sliding-window/layer-type variety: every layer is a full-attention layer.
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"] * num_layers
    # SDPA takes no attention logit soft-capping (Gemma-2); a draft head's own layers do without it.
    if getattr(config, "attn_logit_softcapping", None) is not None:
        config.attn_logit_softcapping = None
    return config


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
