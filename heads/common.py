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
from torch import nn

from heads.kernels import bf16_rows_linear, native_bf16_matmul, rms_norm_rows


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


# Row counts up to which ``decode_linear`` computes weight @ hidden^T. Measured on a 2-core x86 CPU (2 threads, torch
# 2.13), where BLAS streams a weight matrix from memory much faster in that operand order for a few rows:
# - a 49152 x 576 LM head: 8.4 vs 9.8 ms at 1 row, 7.7 vs 21.5 ms at 4, 15.2 vs 22.8 ms at 8, 18.2 vs 25.7 ms at 16
#   against the hidden @ weight^T product F.linear uses (an 8192-row head gains alike);
# - SmolLM2-135M's 210 decoder linears in sequence: 31.8 vs 60.1 ms at 2 rows, 31.0 vs 59.3 at 4, 48.2 vs 58.6 at 8,
#   equal at 1 row.
# On a new machine, ``python scripts/bench_vocab_projection.py`` re-measures the LM-head product and
# ``python scripts/bench_verify_pass.py`` whole target passes with stock and decode linears.
WEIGHT_MAJOR_MAX_ROWS = 16


def decode_linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N]; equal to ``F.linear(hidden, weight, bias)``
    (in bfloat16, up to the order of the fp32 accumulation).

    Decoding multiplies one to a few rows by a weight matrix read from memory: a memory-bound product whose speed
    on CPU depends on the BLAS call's operand order. Few rows go through ``weight @ hidden^T``, the rest (and
    anything that needs gradients, or runs off CPU) through F.linear. In bfloat16, 2-16 rows go through the compiled
    row kernel (``heads.kernels``): PyTorch's bf16 product on a CPU without bf16 matrix instructions costs about one
    one-row product per row, the kernel reads the weights once. Many bf16 rows (a prefill) on such a CPU go through
    an fp32 product of the upcast operands.
    """
    if hidden.device.type != "cpu" or torch.is_grad_enabled():
        return torch.nn.functional.linear(hidden, weight, bias)
    rows = hidden.numel() // hidden.shape[-1]
    if rows > WEIGHT_MAJOR_MAX_ROWS:
        if weight.dtype == hidden.dtype == torch.bfloat16 and not native_bf16_matmul():
            # The same numbers as the bf16 product (bf16 products are exact in fp32, fp32 sums, one rounding at the
            # end), in another summation order; 5-6x faster here: 2.8 vs 17.4 ms for 150 rows of a 1536 x 576 layer.
            return torch.nn.functional.linear(hidden.float(), weight.float(),
                                              None if bias is None else bias.float()).to(torch.bfloat16)
        return torch.nn.functional.linear(hidden, weight, bias)
    flat = hidden.reshape(rows, hidden.shape[-1])
    if rows > 1 and weight.dtype == hidden.dtype == torch.bfloat16 and (kernel := bf16_rows_linear()) is not None:
        # One row stays on PyTorch's bf16 product, which is about as fast and gives plain decoding HF's exact numbers.
        out = kernel(flat.contiguous(), weight.contiguous(), bias)
        return out.reshape(*hidden.shape[:-1], weight.shape[0])
    # The product comes out as [N, rows]; handing a transposed view on would make every later op (rotary, SDPA,
    # which then falls back to its slow math kernel) work on a strided tensor, so copy the few rows once.
    out = torch.mm(weight, flat.t()).t().contiguous().reshape(*hidden.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [..., H] @ weight [V, H]^T -> logits [..., V] in hidden's dtype (see ``decode_linear``)."""
    return decode_linear(hidden, weight.to(hidden.dtype))


class DecodeLinear(nn.Linear):
    """An nn.Linear whose forward is ``decode_linear``: same parameters, same results, faster decode steps on CPU."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return decode_linear(hidden, self.weight, self.bias)


def use_decode_linears(module: nn.Module) -> nn.Module:
    """Switch every plain nn.Linear inside ``module`` to DecodeLinear in place (parameters untouched); returns it.

    Subclasses of nn.Linear (quantized or adapter layers) keep their own forward.
    """
    for child in module.modules():
        if type(child) is nn.Linear:
            child.__class__ = DecodeLinear
    return module


# RMSNorm classes of transformers that compute weight * (x * rsqrt(mean(x^2) + eps)).to(dtype) with the epsilon in
# ``variance_epsilon``: the formula rms_norm_rows implements. Others (Gemma's 1 + weight, ...) keep their own forward.
LLAMA_FORMULA_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


def _decode_norm_forward(self, hidden: torch.Tensor) -> torch.Tensor:
    if (hidden.dtype == self.weight.dtype == torch.bfloat16 and hidden.device.type == "cpu"
            and not torch.is_grad_enabled() and hidden.is_contiguous() and (kernel := rms_norm_rows()) is not None):
        return kernel(hidden, self.weight, self.variance_epsilon)
    return super(type(self), self).forward(hidden)


@functools.cache
def _decode_norm_class(norm_class: type) -> type:
    return type(f"Decode{norm_class.__name__}", (norm_class,), {"forward": _decode_norm_forward})


def use_decode_norms(module: nn.Module) -> nn.Module:
    """Switch every Llama-formula RMSNorm inside ``module`` to one that runs bf16 rows on CPU as one compiled call
    (``heads.kernels.rms_norm_rows``; parameters untouched, other dtypes and devices unchanged); returns it."""
    for child in module.modules():
        if type(child).__name__ in LLAMA_FORMULA_NORMS:
            child.__class__ = _decode_norm_class(type(child))
    return module


def use_decode_kernels(module: nn.Module) -> nn.Module:
    """``use_decode_linears`` and ``use_decode_norms``: the decode-sized layers of a target or a head; returns it."""
    return use_decode_norms(use_decode_linears(module))
