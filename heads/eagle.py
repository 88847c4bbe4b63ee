"""EAGLE draft heads: EAGLE-1/2 (one decoder layer over the target's last feature) and EAGLE-3 (fused features).

Both are built from the target's own transformers classes (decoder layer, RMSNorm, rotary embedding) and called
with explicit position ids, a 4D boolean mask and any cache with ``update(key, value, layer_idx)``.

Row t of a forward sees the token that *follows* feature t: ``input_ids[:, t]`` is token t+1 and ``features[:, t]``
is the target's feature at position t; ``position_ids[:, t]`` is the feature's position (t). The row predicts the
next feature (EAGLE-1) and the distribution of token t+2. Rotary attention only sees position differences, so the
runtime may use any consistent offset.

EAGLE-1/2 (``kind="eagle"``): hidden = fc(concat(embed(token), feature)) -> decoder layer(s) without the input norm
-> the target's frozen LM head. Features are the target's last hidden state after the final norm (F = H).

EAGLE-3 (``kind="eagle3"``): features are the inputs of three target layers concatenated (F = 3H) and fused by
``fc``; a later draft step passes the head's own output hidden instead (F = H, no fc). The layer's attention reads
concat(norm(embed), norm(hidden)) (2H wide); ``norm`` + own ``lm_head`` over a draft vocabulary of
``draft_vocab_size`` tokens. ``d2t`` holds offsets: target_id = draft_id + d2t[draft_id] (the SGLang/vLLM
convention); ``draft_to_target`` is the direct map. ``t2d`` [V] is True for target ids in the draft vocabulary.

The target's embedding (and for EAGLE-1 its LM head) are frozen, non-persistent buffers: never saved, attached from
the target when a head is built or loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from heads.common import cache_argument, head_layer_config, softcap_logits, stock_classes, vocab_logits

KINDS = ("eagle", "eagle3")


@dataclass
class EagleConfig:
    """Architecture of an EAGLE head. ``feature_layers`` and ``draft_vocab_size`` apply to EAGLE-3 only."""

    kind: str = "eagle"
    num_layers: int = 1  # decoder layers of an EAGLE-1/2 head (the reference uses one); EAGLE-3 has exactly one
    fc_bias: bool = True  # the EAGLE-1 reference has a bias on fc; EAGLE-3 has none
    feature_layers: list[int] = field(default_factory=list)  # EAGLE-3: target layers whose inputs are fused
    draft_vocab_size: int = 0  # EAGLE-3: 0 = the target's full vocabulary

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown EAGLE head kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.kind == "eagle3" and self.num_layers != 1:
            raise ValueError("an EAGLE-3 head has exactly one decoder layer (num_layers=1)")
        self.feature_layers = [int(i) for i in self.feature_layers]


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers: inputs of layers 2, N//2 and N-3 (clamped into 0..N-1)."""
    return [min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)]


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig, target_config, embed_weight: torch.Tensor | None = None,
                 lm_head_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        self.target_config = target_config
        hidden = target_config.hidden_size
        self.hidden_size = hidden
        self.target_vocab_size = int(target_config.vocab_size)
        self.softcap = getattr(target_config, "final_logit_softcapping", None)
        layer_cls, rotary_cls = stock_classes(target_config)
        layer_config = head_layer_config(target_config, config.num_layers)
        self.rotary = rotary_cls(layer_config)
        self.register_buffer("embed_weight", torch.empty(0), persistent=False)
        self.register_buffer("target_lm_head_weight", torch.empty(0), persistent=False)

        if config.kind == "eagle":
            self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
            self.layers = nn.ModuleList(layer_cls(layer_config, layer_idx=i) for i in range(config.num_layers))
            # EAGLE-1: the first layer has no input norm (fc's output goes straight into attention).
            self.layers[0].input_layernorm = nn.Identity()
        else:
            if len(config.feature_layers) != 3:
                raise ValueError(f"EAGLE-3 fuses exactly 3 target layers; got feature_layers={config.feature_layers}")
            self.fc = nn.Linear(3 * hidden, hidden, bias=False)
            self.midlayer = layer_cls(layer_config, layer_idx=0)
            attention = self.midlayer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):  # attention reads concat(norm(embed), norm(hidden)): 2H wide
                old = getattr(attention, name)
                setattr(attention, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
            norm_cls = type(self.midlayer.post_attention_layernorm)
            self.midlayer.hidden_norm = norm_cls(hidden, eps=target_config.rms_norm_eps)
            self.norm = norm_cls(hidden, eps=target_config.rms_norm_eps)
            draft_vocab = config.draft_vocab_size or self.target_vocab_size
            self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.ones(self.target_vocab_size, dtype=torch.bool)
                                 if draft_vocab == self.target_vocab_size
                                 else torch.zeros(self.target_vocab_size, dtype=torch.bool))
        if embed_weight is not None:
            self.attach_target_weights(embed_weight, lm_head_weight)

    # ----- properties the runtime reads
    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def head_type(self) -> str:
        return self.config.kind

    @property
    def feature_layers(self) -> list[int]:
        """EAGLE-3: indices i of hidden_states[i] (the inputs of layers i) to concatenate as features."""
        return list(self.config.feature_layers)

    @property
    def feature_size(self) -> int:
        return self.hidden_size * (3 if self.kind == "eagle3" else 1)

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features if self.kind == "eagle3" else self.target_vocab_size

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        """EAGLE-3: LongTensor [V'] of target ids for draft ids (None for EAGLE-1: draft ids are target ids)."""
        if self.kind != "eagle3":
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"draft vocab maps have shapes {tuple(d2t.shape)}/{tuple(t2d.shape)}, the head expects "
                             f"{tuple(self.d2t.shape)}/{tuple(self.t2d.shape)}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def init_output_from_target(self, lm_head_weight: torch.Tensor, final_norm_weight: torch.Tensor | None) -> None:
        """EAGLE-3: start the draft LM head as the target's rows for the draft vocabulary, and the output norm as
        the target's final norm. The head then only has to learn to produce target-like last hidden states; on a
        small training budget this beats learning the vocabulary projection from scratch."""
        if self.kind != "eagle3":
            raise ValueError("only an EAGLE-3 head has its own LM head to initialise")
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_weight[self.draft_to_target].to(self.lm_head.weight.dtype))
            if final_norm_weight is not None and final_norm_weight.shape == self.norm.weight.shape:
                self.norm.weight.copy_(final_norm_weight)

    def attach_target_weights(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None) -> None:
        """Point the frozen buffers at the target's embedding (and EAGLE-1 LM head); no copy when dtype/device match."""
        if embed_weight.shape[1] != self.hidden_size:
            raise ValueError(f"target embedding has width {embed_weight.shape[1]}, the head has hidden size "
                             f"{self.hidden_size}")
        self.embed_weight = embed_weight.detach()
        if self.kind == "eagle":
            if lm_head_weight is None:
                raise ValueError("an EAGLE-1/2 head needs the target's LM head weight")
            self.target_lm_head_weight = lm_head_weight.detach()

    def _check_attached(self) -> None:
        if self.embed_weight.numel() == 0:
            raise RuntimeError("this head has no target embedding attached; load it with load_head(dir, target_model) "
                               "or call attach_target_weights(...)")

    # ----- forward
    def hidden_states(self, input_ids: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """input_ids [B, T], features [B, T, F] (F = H, or 3H for EAGLE-3's first step) -> hidden [B, T, H]."""
        self._check_attached()
        embeds = F.embedding(input_ids, self.embed_weight).to(features.dtype)
        if self.kind == "eagle":
            hidden = self.fc(torch.cat((embeds, features), dim=-1))
            position_embeddings = self.rotary(hidden, position_ids)
            for layer in self.layers:
                hidden = layer(hidden, attention_mask=attention_mask, position_ids=position_ids,
                               position_embeddings=position_embeddings, **cache_argument(layer, cache))
            return hidden
        if features.shape[-1] == 3 * self.hidden_size:
            features = self.fc(features)
        elif features.shape[-1] != self.hidden_size:
            raise ValueError(f"EAGLE-3 features must be 3H={3 * self.hidden_size} (fused target layers) or "
                             f"H={self.hidden_size} (the head's own hidden), got {features.shape[-1]}")
        layer = self.midlayer
        position_embeddings = self.rotary(features, position_ids)
        attention_input = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(features)), dim=-1)
        attended, _ = layer.self_attn(hidden_states=attention_input, position_embeddings=position_embeddings,
                                      attention_mask=attention_mask, position_ids=position_ids,
                                      **cache_argument(layer.self_attn, cache))
        hidden = features + attended
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V_draft] (EAGLE-1: the target's vocabulary)."""
        if self.kind == "eagle":
            return softcap_logits(vocab_logits(hidden, self.target_lm_head_weight), self.softcap)
        return vocab_logits(self.norm(hidden), self.lm_head.weight)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden [B, T, H], logits [B, T, V_draft]). attention_mask [B, 1, T, S] bool (True = attend) or None
        (causal over T; only valid without cached keys)."""
        hidden = self.hidden_states(input_ids, features, position_ids, attention_mask, cache)
        return hidden, self.logits(hidden)
