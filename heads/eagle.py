"""EAGLE feature heads: the shared base, and EAGLE-1/2 (one or more decoder layers over the target's last feature).

Draft layers are transformers' Llama decoder layer, RMSNorm and rotary embedding for every target family, shaped
like the target's layers (``heads.common.draft_layer_config``: what SGLang, vLLM and the published heads build); they
are called with explicit position ids, a 4D boolean mask and any cache with ``update(key, value, layer_idx)``.

Row t of a forward sees the token that *follows* feature t: ``input_ids[:, t]`` is token t+1 and ``features[:, t]``
is the target's feature at position t; ``position_ids[:, t]`` is the feature's position (t). The row predicts the
next feature (EAGLE-1) and the distribution of token t+2. Rotary attention only sees position differences, so the
runtime may use any consistent offset.

EAGLE-1/2 (``EagleHead``): hidden = fc(concat(embed(token), feature)) -> decoder layer(s) without the input norm ->
the target's frozen LM head. Features are the target's last hidden state after the final norm (F = H).

The target's embedding (and for EAGLE-1 its LM head) are frozen, non-persistent buffers: never saved, attached from
the target when a head is built or loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from heads.base import DraftHead
from heads.common import (FrozenProjection, cache_argument, draft_layer_classes, draft_layer_config, output_vocab_size,
                          softcap_logits)
from heads.layouts import (PICKLE, SAFETENSORS, Layout, check_layer_settings, draft_layer_json, drop_embedding,
                           first_file, load_into, load_weights, mismatches, refuse_target_style, state_of, weight_keys)


class FeatureHead(DraftHead):
    """What the EAGLE family shares: rows of (token, feature), the target's embedding, its own rotary embedding and
    KV cache of ``cache_layers`` layers. Subclasses define ``hidden_states`` and ``logits``."""

    has_draft_layers = True

    def __init__(self, config, target_config, num_layers: int):
        super().__init__(config, target_config)
        self.layer_class, rotary_class = draft_layer_classes()
        self.layer_config = draft_layer_config(target_config, num_layers)
        self.rotary = rotary_class(self.layer_config)
        self.register_buffer("embed_weight", torch.empty(0), persistent=False)

    @property
    def cache_layers(self) -> int:
        """Attention layers of the head, hence layers of its KV cache."""
        return self.layer_config.num_hidden_layers

    @property
    def feature_size(self) -> int:
        """Width of the features a first draft step reads (H, or 3H for EAGLE-3's fused layers)."""
        return self.hidden_size * max(1, len(self.feature_layers))

    @property
    def draft_vocab_size(self) -> int:
        return self.target_vocab_size

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        """LongTensor [V'] of target ids for draft ids; None when draft ids are target ids."""
        return None

    def select_features(self, hidden: torch.Tensor, layer_hidden: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The head's features from the target's last hidden state [..., H] and the inputs of ``feature_layers``."""
        return hidden

    def attach_target_weights(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None) -> None:
        """Point the frozen buffers at the target's embedding; no copy when dtype/device match."""
        if embed_weight.shape[1] != self.hidden_size:
            raise ValueError(f"target embedding has width {embed_weight.shape[1]}, the head has hidden size "
                             f"{self.hidden_size}")
        self.embed_weight = embed_weight.detach()

    def embed(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.embed_weight.numel() == 0:
            raise RuntimeError("this head has no target embedding attached; load it with load_head(dir, target_model) "
                               "or call attach_target_weights(...)")
        return F.embedding(input_ids, self.embed_weight).to(dtype)

    def hidden_states(self, input_ids: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None = None, cache=None, **attention_kwargs) -> torch.Tensor:
        """input_ids [B, T], features [B, T, F] -> hidden [B, T, H]. ``attention_kwargs`` go to the attention
        function (the runtime's tree attention takes ``ragged``: rows packed into one sequence,
        ``runtime.engine.ragged``)."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V_draft]."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden [B, T, H], logits [B, T, V_draft]). attention_mask [B, 1, T, S] bool (True = attend) or None
        (causal over T; only valid without cached keys)."""
        hidden = self.hidden_states(input_ids, features, position_ids, attention_mask, cache)
        return hidden, self.logits(hidden)


@dataclass
class EagleConfig:
    """Architecture of an EAGLE-1/2 head."""

    num_layers: int = 1  # decoder layers (the reference uses one)
    fc_bias: bool = True  # the EAGLE-1 reference has a bias on fc

    def __post_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"an EAGLE head needs num_layers >= 1, got {self.num_layers}")


class EagleHead(FeatureHead):
    head_type = "eagle"
    config_class = EagleConfig
    legacy_config_keys = ("feature_layers", "draft_vocab_size")  # from the config EAGLE-1 once shared with EAGLE-3

    @classmethod
    def export_refusal(cls, head_config: dict, target_layers: int | None, fmt: str) -> str | None:
        if fmt == "vllm" and head_config.get("fc_bias", True):
            return ("vLLM's EAGLE-1 drafter has no bias on fc and this head was trained with one (fc_bias), which "
                    "vLLM would not load; serve it with SGLang (--format sglang) or the EAGLE authors' code "
                    "(--format reference)")
        return None

    def export_files(self, fmt: str, base_model: str | None = None) -> dict:
        """SGLang ``LlamaForCausalLMEagle`` (``fc`` with bias, ``layers.{i}.*``); vLLM ``LlamaForCausalLM``, which it
        prefixes to its registered ``EagleLlamaForCausalLM`` (fc without bias); the authors' code (config.json +
        pickle, with the embedding and ``bias``, which their strict loader needs)."""
        state = state_of(self)
        if "fc.bias" not in state and fmt != "vllm":  # SGLang's and the reference fc have a bias: a zero one is exact
            state["fc.bias"] = torch.zeros(self.hidden_size, dtype=state["fc.weight"].dtype)
        if fmt == "vllm":
            bias = state.pop("fc.bias", None)
            if bias is not None and bool(bias.any()):
                raise ValueError(self.export_refusal({"fc_bias": True}, None, "vllm"))
            return {"config.json": draft_layer_json(self, architectures=["LlamaForCausalLM"]), SAFETENSORS: state}
        if fmt == "sglang":
            return {"config.json": draft_layer_json(self, architectures=["LlamaForCausalLMEagle"]),
                    SAFETENSORS: state}
        state["embed_tokens.weight"] = self.embed_weight.detach().contiguous().cpu().clone()
        config = draft_layer_json(self, architectures=["LlamaForCausalLM"], bias=True)
        return {"config.json": config, PICKLE: state}

    def __init__(self, config: EagleConfig, target_config):
        super().__init__(config, target_config, config.num_layers)
        hidden = self.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
        self.layers = nn.ModuleList(self.layer_class(self.layer_config, layer_idx=i) for i in range(config.num_layers))
        # EAGLE-1: the first layer has no input norm (fc's output goes straight into attention).
        self.layers[0].input_layernorm = nn.Identity()
        self.target_lm_head = FrozenProjection()

    @property
    def target_lm_head_weight(self) -> torch.Tensor:
        return self.target_lm_head.weight

    def attach_target_weights(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None) -> None:
        """The target's embedding and LM head (EAGLE-1 drafts over the target's vocabulary with its LM head)."""
        super().attach_target_weights(embed_weight, lm_head_weight)
        if lm_head_weight is None:
            raise ValueError("an EAGLE-1/2 head needs the target's LM head weight")
        self.target_lm_head.weight = lm_head_weight.detach()

    def hidden_states(self, input_ids, features, position_ids, attention_mask=None, cache=None,
                      **attention_kwargs) -> torch.Tensor:
        hidden = self.fc(torch.cat((self.embed(input_ids, features.dtype), features), dim=-1))
        position_embeddings = self.rotary(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=attention_mask, position_ids=position_ids,
                           position_embeddings=position_embeddings, **cache_argument(layer, cache),
                           **attention_kwargs)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.target_lm_head.attached:
            raise RuntimeError("this EAGLE head has no target LM head attached; load it with load_head(dir, "
                               "target_model)")
        return softcap_logits(self.target_lm_head(hidden), self.softcap)


# ----- published layouts import reads (heads/formats.py: load_any_head)

def _import_eagle(directory: Path, config: dict, target_config) -> EagleHead:
    check_layer_settings(config, target_config, directory, "EAGLE-1")
    weights = first_file(directory, (SAFETENSORS, PICKLE))
    state = load_weights(weights)
    drop_embedding(state, target_config, weights)
    refuse_target_style(state, weights)
    vocab = output_vocab_size(target_config)
    problems = mismatches([("vocab_size", config.get("vocab_size"), vocab)])
    if problems:
        raise ValueError(f"the EAGLE-1 head at {directory} does not fit this target: " + "; ".join(problems))
    indices = {int(key.split(".")[1]) for key in state if key.startswith("layers.") and key.split(".")[1].isdigit()}
    if not indices:
        raise ValueError(f"{weights} holds no draft layer (layers.0.*)")
    head = EagleHead(EagleConfig(num_layers=max(indices) + 1, fc_bias="fc.bias" in state), target_config)
    load_into(head, state, weights, "EAGLE-1")
    return head


def _is_eagle(directory: Path, config: dict | None) -> bool:
    weights = first_file(directory, (SAFETENSORS, PICKLE))
    if config is None or weights is None:
        return False
    keys = weight_keys(weights)
    return "fc.weight" in keys and any(key.startswith("layers.") for key in keys)


LAYOUTS = (
    Layout("eagle", "eagle", "EAGLE-1 (the EAGLE authors, our exports): config.json + model.safetensors or "
           "pytorch_model.bin holding fc.weight [H, 2H] and layers.{i}.*", 40, _is_eagle,
           lambda directory, config, target: _import_eagle(directory, config, getattr(target, "config", target))),
)
