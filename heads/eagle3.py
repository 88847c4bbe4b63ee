"""EAGLE-3: one decoder layer over three fused target layers, with its own LM head over a draft vocabulary.

Features are the inputs of three target layers concatenated (F = 3H) and fused by ``fc``; a later draft step passes
the head's own output hidden instead (F = H, no fc). The layer's attention reads concat(norm(embed), norm(hidden))
(2H wide); ``norm`` + own ``lm_head`` over a draft vocabulary of ``draft_vocab_size`` tokens. ``d2t`` holds
offsets: target_id = draft_id + d2t[draft_id] (the SGLang/vLLM convention); ``draft_to_target`` is the direct map.
``t2d`` [V] is True for target ids in the draft vocabulary. Rows, positions and masks follow heads/eagle.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from heads.common import cache_argument
from heads.eagle import FeatureHead


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers: inputs of layers 2, N//2 and N-3 (clamped into 0..N-1)."""
    return [min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)]


@dataclass
class Eagle3Config:
    """Architecture of an EAGLE-3 head."""

    feature_layers: list[int] = field(default_factory=list)  # target layers whose inputs are fused; []: the default
    draft_vocab_size: int = 0  # 0 = the target's full vocabulary

    def __post_init__(self):
        self.feature_layers = [int(i) for i in self.feature_layers]
        if self.feature_layers and len(self.feature_layers) != 3:
            raise ValueError(f"EAGLE-3 fuses exactly 3 target layers; got feature_layers={self.feature_layers}")
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0 (0: the whole vocabulary), got {self.draft_vocab_size}")


class Eagle3Head(FeatureHead):
    head_type = "eagle3"
    config_class = Eagle3Config
    legacy_config_keys = ("num_layers", "fc_bias")  # from the config EAGLE-3 once shared with EAGLE-1

    def __init__(self, config: Eagle3Config, target_config):
        num_layers = int(target_config.num_hidden_layers)
        if not config.feature_layers:
            config = Eagle3Config(default_feature_layers(num_layers), config.draft_vocab_size)
        bad = [i for i in config.feature_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"EAGLE-3 feature layers {bad} are outside the target's layers 0..{num_layers - 1}")
        if config.draft_vocab_size > int(target_config.vocab_size):
            raise ValueError(f"draft_vocab_size={config.draft_vocab_size} exceeds the target's vocabulary "
                             f"({target_config.vocab_size}); use a smaller size or 0 for the whole vocabulary")
        super().__init__(config, target_config, 1)
        hidden = self.hidden_size
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = self.layer_class(self.layer_config, layer_idx=0)
        attention = self.midlayer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # attention reads concat(norm(embed), norm(hidden)): 2H wide
            old = getattr(attention, name)
            setattr(attention, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
        norm_class = type(self.midlayer.post_attention_layernorm)
        self.midlayer.hidden_norm = norm_class(hidden, eps=self.layer_config.rms_norm_eps)
        self.norm = norm_class(hidden, eps=self.layer_config.rms_norm_eps)
        draft_vocab = config.draft_vocab_size or self.target_vocab_size
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.full((self.target_vocab_size,), draft_vocab == self.target_vocab_size))

    @property
    def feature_layers(self) -> list[int]:
        return list(self.config.feature_layers)

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features

    @property
    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def select_features(self, hidden: torch.Tensor, layer_hidden: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.cat(layer_hidden, dim=-1)

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"draft vocab maps have shapes {tuple(d2t.shape)}/{tuple(t2d.shape)}, the head expects "
                             f"{tuple(self.d2t.shape)}/{tuple(self.t2d.shape)}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def init_output_from_target(self, lm_head_weight: torch.Tensor, final_norm_weight: torch.Tensor | None) -> None:
        """Start the draft LM head as the target's rows for the draft vocabulary, and the output norm as the target's
        final norm. The head then only has to learn to produce target-like last hidden states; on a small training
        budget this beats learning the vocabulary projection from scratch."""
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_weight[self.draft_to_target].to(self.lm_head.weight.dtype))
            if final_norm_weight is not None and final_norm_weight.shape == self.norm.weight.shape:
                self.norm.weight.copy_(final_norm_weight)

    def hidden_states(self, input_ids, features, position_ids, attention_mask=None, cache=None,
                      **attention_kwargs) -> torch.Tensor:
        """features [B, T, 3H] (fused target layers, first step) or [B, T, H] (the head's own hidden, later steps)."""
        if features.shape[-1] == 3 * self.hidden_size:
            features = self.fc(features)
        elif features.shape[-1] != self.hidden_size:
            raise ValueError(f"EAGLE-3 features must be 3H={3 * self.hidden_size} (fused target layers) or "
                             f"H={self.hidden_size} (the head's own hidden), got {features.shape[-1]}")
        embeds = self.embed(input_ids, features.dtype)
        layer = self.midlayer
        position_embeddings = self.rotary(features, position_ids)
        attention_input = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(features)), dim=-1)
        attended, _ = layer.self_attn(hidden_states=attention_input, position_embeddings=position_embeddings,
                                      attention_mask=attention_mask, position_ids=position_ids,
                                      **cache_argument(layer.self_attn, cache), **attention_kwargs)
        hidden = features + attended
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))
