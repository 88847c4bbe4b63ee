"""EAGLE-3: one decoder layer over three fused target layers, with its own LM head over a draft vocabulary.

Features are the inputs of three target layers concatenated (F = 3H) and fused by ``fc``; a later draft step passes
the head's own output hidden instead (F = H, no fc). The layer's attention reads concat(norm(embed), norm(hidden))
(2H wide); ``norm`` + own ``lm_head`` over a draft vocabulary of ``draft_vocab_size`` tokens. ``d2t`` holds
offsets: target_id = draft_id + d2t[draft_id] (the SGLang/vLLM convention); ``draft_to_target`` is the direct map.
``t2d`` [V] is True for target ids in the draft vocabulary. Rows, positions and masks follow heads/eagle.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from heads.common import cache_argument, output_vocab_size
from heads.eagle import FeatureHead
from heads.gguf import GGUFLayout, llama_layer_tensors, llama_values
from heads.layouts import (PICKLE, SAFETENSORS, Layout, check_layer_settings, draft_layer_json, drop_embedding,
                           first_file, load_into, load_weights, mismatches, refuse_target_style, state_of)

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
# EAGLE-3 options of SpecForge / speculators that change the computation; our head implements none of them.
UNSUPPORTED_EAGLE3_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "input_norm")
# economize's EAGLE-3 technique: its settings that differ from our head's computation when not these values
ECONOMIZE_CONFIG, ECONOMIZE_WEIGHTS = "economize_config.json", "economize_model.safetensors"
ECONOMIZE_REFUSED = {"rope_theta": None, "rope_scaling": None, "norm_before_residual": False,
                     "zero_source_first": False, "head": "own", "partial_rotary_factor": 1.0, "attention_bias": None}


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

    @classmethod
    def export_refusal(cls, head_config: dict, target_layers: int | None, fmt: str) -> str | None:
        if not target_layers:
            return None
        layers = [int(i) for i in head_config.get("feature_layers") or default_feature_layers(target_layers)]
        if fmt in ("sglang", "vllm") and any(low >= high for low, high in zip(layers, layers[1:])):
            return (f"SGLang and vLLM capture the fused layers' inputs while running the target's layers in order, "
                    f"once each, so they fuse them in ascending order; this head fuses {layers} in that order, "
                    f"which they would serve as another head. Train it with ascending head.feature_layers "
                    f"(or export it for the EAGLE authors' code, --format reference, if they are its defaults)")
        if fmt == "reference" and layers != default_feature_layers(target_layers):
            return (f"the EAGLE authors' code always fuses the inputs of target layers "
                    f"{default_feature_layers(target_layers)} (2, N//2, N-3) and reads no layer ids; this head fuses "
                    f"{layers}. Export it for SGLang or vLLM (--format sglang / vllm), which read the ids")
        return None

    @classmethod
    def gguf_refusal(cls) -> str | None:
        return None

    def gguf_layout(self) -> GGUFLayout:
        """llama.cpp's ``eagle3`` draft: ``fc``, one block whose attention reads [norm(embed), norm(hidden)] (the
        hidden norm as ``attn_norm_2``), ``output_norm``, ``output`` over the draft vocabulary and ``d2t`` as absolute
        target ids. Its ``target_layers`` are our feature layers as they are: llama.cpp taps each layer's input, as we
        do (hidden_states[i])."""
        target = self.target_config
        values = llama_values("eagle3", self.layer_config, 1, self.hidden_size,
                              int(getattr(target, "max_position_embeddings", 2048)))
        values.update({"eagle3.target_layers": (self.feature_layers, "i32s"),
                       "eagle3.target_hidden_size": (self.hidden_size, "u32"),
                       "eagle3.norm_before_residual": (False, "bool"), "eagle3.norm_before_fc": (False, "bool"),
                       "eagle3.vocab_size": (self.target_vocab_size, "u32")})
        state = state_of(self)
        tensors = {"fc.weight": state["fc.weight"]}
        tensors.update(llama_layer_tensors("midlayer.", state, self.layer_config, 0))
        tensors.update({"blk.0.attn_norm_2.weight": state["midlayer.hidden_norm.weight"],
                        "output_norm.weight": state["norm.weight"], "output.weight": state["lm_head.weight"],
                        "d2t": self.draft_to_target.cpu()})
        return GGUFLayout("eagle3", values, tensors)

    def export_files(self, fmt: str, base_model: str | None = None) -> dict:
        """``LlamaForCausalLMEagle3`` (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``) with the layer
        ids in each engine's convention: vLLM reads a top-level ``eagle_aux_hidden_state_layer_ids`` (the index i of
        hidden_states[i], our ``feature_layers``), SGLang ``eagle_config.eagle_aux_hidden_state_layer_ids`` and adds 1
        (so i - 1); the nested ids are written only for non-default layers (SGLang's default is ours, and economize
        reads the nested ids in vLLM's convention). ``reference``: the EAGLE authors' config.json + pickle."""
        config = draft_layer_json(self, architectures=[EAGLE3_ARCHITECTURE], draft_vocab_size=self.draft_vocab_size)
        layers = self.feature_layers
        eagle_config = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True}
        if fmt in ("sglang", "vllm"):
            config["eagle_aux_hidden_state_layer_ids"] = list(layers)  # vLLM: hidden_states[i] as we index them
        if fmt == "sglang" and layers != default_feature_layers(int(self.target_config.num_hidden_layers)):
            eagle_config["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in layers]  # SGLang adds 1
        if fmt != "reference":
            config["eagle_config"] = eagle_config
        weights = PICKLE if fmt == "reference" else SAFETENSORS
        return {"config.json": config, weights: state_of(self)}

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


# ----- published layouts import reads (heads/formats.py: load_any_head)

def _eagle3_feature_layers(config: dict, num_layers: int, where: Path) -> list[int]:
    """Top-level ids (vLLM's convention: our indices), else the nested SGLang ids plus 1, else the default."""
    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    from_nested = [int(i) + 1 for i in nested] if nested else None
    if top and from_nested and [int(i) for i in top] != from_nested:
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {top} (vLLM's convention) and eagle_config's "
                         f"{nested} (SGLang's, which adds 1) name different layers; fix one of them")
    layers = [int(i) for i in top] if top else from_nested or default_feature_layers(num_layers)
    if len(layers) != 3:
        raise ValueError(f"{where}: EAGLE-3 heads here fuse 3 target layers, the config names {layers}")
    return layers


def _import_eagle3(directory: Path, config: dict, target_config) -> Eagle3Head:
    layer = config.get("transformer_layer_config")  # speculators nests the layer's fields
    config = {**layer, **{k: v for k, v in config.items() if v is not None}} if isinstance(layer, dict) else config
    eagle = config.get("eagle_config") or {}
    flags = [flag for flag in UNSUPPORTED_EAGLE3_FLAGS if config.get(flag) or eagle.get(flag)]
    if flags:
        raise ValueError(f"{directory}: EAGLE-3 options {flags} change the draft computation and are not supported")
    if config.get("target_hidden_size") not in (None, config.get("hidden_size")):
        raise ValueError(f"{directory}: a draft width other than the target's (target_hidden_size) is not supported")
    check_layer_settings(config, target_config, directory, "EAGLE-3")
    weights = first_file(directory, (SAFETENSORS, PICKLE))
    state = load_weights(weights)
    drop_embedding(state, target_config, weights)
    refuse_target_style(state, weights)
    return _eagle3_from_state(directory, weights, state, config, target_config)


def _eagle3_from_state(directory: Path, weights: Path, state: dict, config: dict, target_config) -> Eagle3Head:
    """Our head from a published EAGLE-3 state dict (one draft layer as ``layers.0.*`` or ``midlayer.*``; ``d2t``
    offsets, ``t2d`` checked against them) and its config (layer ids, vocabulary)."""
    renamed = {}
    for key, value in state.items():
        if key.startswith("layers.0."):
            key = "midlayer." + key[len("layers.0."):]
        elif key.startswith("layers."):
            raise ValueError(f"{weights}: EAGLE-3 heads with several draft layers are not supported ({key})")
        renamed[key] = value
    if "lm_head.weight" not in renamed:
        raise ValueError(f"{weights} has no lm_head.weight; an EAGLE-3 head has its own LM head")
    vocab = output_vocab_size(target_config)
    draft_vocab = int(renamed["lm_head.weight"].shape[0])
    problems = mismatches([("vocab_size", config.get("vocab_size"), vocab)])
    if draft_vocab > vocab:
        problems.append(f"draft vocabulary {draft_vocab} (this target's vocabulary: {vocab})")
    if problems:
        raise ValueError(f"the EAGLE-3 head at {directory} does not fit this target: " + "; ".join(problems))
    d2t = renamed.get("d2t")
    if d2t is None:
        if draft_vocab != vocab:
            raise ValueError(f"{weights}: lm_head.weight has {draft_vocab} rows but no d2t says which target tokens "
                             "they are")
        d2t = torch.zeros(draft_vocab, dtype=torch.long)
    d2t = d2t.to(torch.long)
    ids = torch.arange(d2t.shape[0]) + d2t
    if d2t.shape != (draft_vocab,) or int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != \
            draft_vocab:
        raise ValueError(f"{weights}: d2t does not map the {draft_vocab} draft tokens to distinct target tokens "
                         f"below {vocab}")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    stored = renamed.get("t2d")
    if stored is not None and (stored.shape != t2d.shape or not torch.equal(stored.to(torch.bool), t2d)):
        raise ValueError(f"{weights}: t2d disagrees with d2t (or has another length than the target's vocabulary "
                         f"{vocab})")
    renamed["d2t"], renamed["t2d"] = d2t, t2d
    layers = _eagle3_feature_layers(config, int(target_config.num_hidden_layers), directory)
    head = Eagle3Head(Eagle3Config(layers, draft_vocab if draft_vocab < vocab else 0), target_config)
    load_into(head, renamed, weights, "EAGLE-3")
    return head


def _import_economize(directory: Path, config: dict | None, target_config) -> Eagle3Head:
    """economize's EAGLE-3 technique (``economize_config.json`` + ``economize_model.safetensors``, tensors
    ``eagle3.{fc, layer.*, norm, lm_head, d2t, t2d}``): its layer ids are ours (inputs of layers 2, N//2, N-3 by
    default), its layer Llama-style with the target's geometry and rotary table."""
    meta_path = directory / ECONOMIZE_CONFIG
    try:
        meta = json.loads(meta_path.read_text())
        techniques = [t for t in meta["techniques"] if t["technique"] == "eagle3"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{meta_path} is not an economize checkpoint config ({error!r})") from None
    if len(techniques) != 1:
        raise ValueError(f"{meta_path}: expected one eagle3 technique, found "
                         f"{[t.get('technique') for t in meta['techniques']]}")
    settings = techniques[0]["config"]
    odd = {key: settings.get(key) for key, value in ECONOMIZE_REFUSED.items() if settings.get(key, value) != value}
    if odd:
        raise ValueError(f"{meta_path}: economize EAGLE-3 options our head does not implement: {odd}")
    hidden, heads = int(target_config.hidden_size), int(target_config.num_attention_heads)
    problems = mismatches([
        ("intermediate_size", settings.get("intermediate_size"), int(target_config.intermediate_size)),
        ("num_heads", settings.get("num_heads"), heads),
        ("num_kv_heads", settings.get("num_kv_heads"), int(getattr(target_config, "num_key_value_heads", None)
                                                           or heads)),
        ("head_dim", settings.get("head_dim"), int(getattr(target_config, "head_dim", None) or hidden // heads)),
        ("rms_norm_eps", settings.get("rms_norm_eps"), float(target_config.rms_norm_eps))])
    if problems:
        raise ValueError(f"the economize EAGLE-3 head at {directory} does not fit this target: " + "; ".join(problems))
    weights = directory / ECONOMIZE_WEIGHTS
    state = {}
    with safe_open(str(weights), "pt") as handle:
        for key in handle.keys():
            name = key.removeprefix("eagle3.")
            if name == key:
                raise ValueError(f"{weights}: unexpected tensor {key!r} (only the eagle3 technique is read)")
            if name.startswith("layer."):
                name = "midlayer." + name.removeprefix("layer.")
            state[name] = handle.get_tensor(key)
    default = default_feature_layers(int(target_config.num_hidden_layers))
    layers = [int(i) for i in settings.get("aux_layers") or default]
    converted = {"eagle_aux_hidden_state_layer_ids": layers, "draft_vocab_size": None}
    return _eagle3_from_state(directory, weights, state, converted, target_config)


def _is_eagle3(directory: Path, config: dict | None) -> bool:
    if config is None or first_file(directory, (SAFETENSORS, PICKLE)) is None:
        return False
    return "draft_vocab_size" in config or any("eagle3" in str(a).lower() for a in config.get("architectures") or [])


LAYOUTS = (
    Layout("eagle3", "eagle3", "EAGLE-3 (the EAGLE authors, SpecForge, our exports): config.json with draft_vocab_size "
           "or an Eagle3 architecture + model.safetensors or pytorch_model.bin", 30, _is_eagle3,
           lambda directory, config, target: _import_eagle3(directory, config, getattr(target, "config", target))),
    Layout("economize", "eagle3", f"economize's EAGLE-3 technique: {ECONOMIZE_CONFIG} + {ECONOMIZE_WEIGHTS}", 5,
           lambda directory, config: (directory / ECONOMIZE_CONFIG).is_file() and (directory / ECONOMIZE_WEIGHTS)
           .is_file(), lambda directory, config, target: _import_economize(directory, config,
                                                                             getattr(target, "config", target))),
)
