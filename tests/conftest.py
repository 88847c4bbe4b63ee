"""Tiny random targets built from configs, shared by the tests."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, GemmaConfig, LlamaConfig, MistralConfig, Qwen2Config

from runtime.target.model import target_from_model

# Tiny models gain nothing from a second thread, and one thread keeps the suite steady when the other core is busy
# (an oversubscribed OpenMP pool makes small ops orders of magnitude slower).
torch.set_num_threads(1)

COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, tie_word_embeddings=False)


SLIDING_WINDOW = 6


def tiny_config(arch: str, vocab_size: int = 64, **overrides):
    kwargs = {**COMMON, "vocab_size": vocab_size, **overrides}
    if arch == "llama":
        return LlamaConfig(**kwargs)
    if arch == "qwen2":
        return Qwen2Config(**kwargs)
    if arch == "gemma":
        return GemmaConfig(head_dim=8, **kwargs)
    # Sliding-window families, with a window far shorter than the test prompts: every layer (Mistral), the layers
    # from max_window_layers on (Qwen2), every other layer with attention and final logit soft-capping (Gemma-2).
    if arch == "mistral":
        return MistralConfig(**{"sliding_window": SLIDING_WINDOW, **kwargs})
    if arch == "qwen2-sliding":
        return Qwen2Config(**{"use_sliding_window": True, "sliding_window": SLIDING_WINDOW, "max_window_layers": 1,
                              **kwargs})
    if arch == "gemma2":
        return Gemma2Config(**{"head_dim": 8, "sliding_window": SLIDING_WINDOW, **kwargs})
    raise ValueError(arch)


def tiny_model(arch: str = "llama", seed: int = 0, vocab_size: int = 64, scale: float = 1.0, **overrides):
    """A random model; ``scale`` multiplies the output layer so that distributions are peakier or flatter."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, vocab_size, **overrides)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model


def tiny_target(arch: str = "llama", seed: int = 0, **kwargs):
    return target_from_model(tiny_model(arch, seed, **kwargs), identity=f"tiny-{arch}-{seed}")


@pytest.fixture(params=["llama", "qwen2", "gemma"])
def arch(request):
    return request.param
