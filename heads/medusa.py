"""Medusa heads: K heads on the target's last hidden state; head i predicts the token i+2 positions ahead.

Each head is a stack of residual blocks x + SiLU(Linear(x)) with zero-initialised linears (every head starts as the
identity, so it starts as the target's own next-token predictor) followed by an LM head. The LM head is either the
target's, shared and frozen (``shared_lm_head``: right for small targets, whose vocabulary dwarfs the hidden size),
or one per head initialised from the target's. Module names follow vLLM's Medusa (``blocks.{h}.layers.{l}``,
``lm_heads.{h}``) so export is a renaming-free copy.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from heads.base import DraftHead
from heads.common import FrozenProjection, output_vocab_size, softcap_logits
from heads.layouts import SAFETENSORS, Layout, first_file, load_into, load_weights, mismatches, state_of

MEDUSA_REFERENCE_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
MEDUSA_REFERENCE_KEY = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


@dataclass
class MedusaConfig:
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    shared_lm_head: bool = True

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(f"Medusa needs num_heads >= 1 and num_layers >= 0 (got {self.num_heads}, "
                             f"{self.num_layers})")


class ResidualStack(nn.Module):
    """x -> x + SiLU(W x + b), ``num_layers`` times; zero-initialised, so it starts as the identity."""

    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = hidden + F.silu(layer(hidden))
        return hidden


class MedusaHeads(DraftHead):
    head_type = "medusa"
    config_class = MedusaConfig
    default_export_format = "vllm"  # SGLang has no Medusa

    @classmethod
    def export_refusal(cls, head_config: dict, target_layers: int | None, fmt: str) -> str | None:
        if fmt == "sglang":
            return ("SGLang has no Medusa drafter; export a Medusa head for vLLM (--format vllm) or the Medusa "
                    "authors' code and economize (--format reference)")
        if fmt == "reference" and int(head_config.get("num_layers", 1)) > 1:
            return (f"the Medusa authors' code repeats one residual block in each head (medusa_num_layers copies of "
                    f"the same weights) and this head has {head_config['num_layers']} different ones, which it would "
                    f"load as the last one repeated; export it for vLLM (--format vllm)")
        return None

    def export_files(self, fmt: str, base_model: str | None = None) -> dict:
        """vLLM: ``blocks.{h}.layers.{l}.*`` and ``lm_heads.{h}`` with ``medusa_fc_bias: true`` (else vLLM builds
        bias-free blocks and drops the trained biases); a shared LM head is written once per head, as vLLM builds one
        per head. ``reference``: FasterDecoding's ``medusa_lm_head.pt`` (``{h}.{l}.linear.*``, ``{h}.{L}.weight``),
        which economize reads too; ``base_model`` names the target in its config."""
        return _medusa_files(self, fmt, base_model)

    def __init__(self, config: MedusaConfig, target_config):
        super().__init__(config, target_config)
        self.vocab_size = self.target_vocab_size
        self.blocks = nn.ModuleList(ResidualStack(self.hidden_size, config.num_layers)
                                    for _ in range(config.num_heads))
        if config.shared_lm_head:
            self.target_lm_head = FrozenProjection()
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(self.hidden_size, self.vocab_size, bias=False)
                                          for _ in range(config.num_heads))

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def target_lm_head_weight(self) -> torch.Tensor:
        """The shared LM head (the target's), empty until attached or when each head has its own."""
        return self.target_lm_head.weight if self.config.shared_lm_head else torch.empty(0)

    def attach_target_weights(self, embed_weight, lm_head_weight: torch.Tensor, init_heads: bool = False) -> None:
        """Shared mode: point at the target's LM head (frozen, not saved). ``init_heads``: copy it into own heads
        (a new head starts as the target's next-token predictor)."""
        if lm_head_weight.shape[1] != self.hidden_size:
            raise ValueError(f"target LM head has width {lm_head_weight.shape[1]}, the heads have hidden size "
                             f"{self.hidden_size}")
        if self.config.shared_lm_head:
            self.target_lm_head.weight = lm_head_weight.detach()
        elif init_heads:
            with torch.no_grad():
                for head in self.lm_heads:
                    head.weight.copy_(lm_head_weight)

    def head_logits(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head ``index`` on hidden [..., H] -> logits [..., V] (predicts the token index+2 positions ahead)."""
        if self.config.shared_lm_head:
            return self._shared_logits(self.blocks[index](hidden))
        return softcap_logits(self.lm_heads[index](self.blocks[index](hidden)), self.softcap)

    def first_heads_logits(self, hidden: torch.Tensor, count: int) -> torch.Tensor:
        """Heads 0..count-1 on one hidden [..., H] -> logits [count, ..., V].

        With the shared LM head this is one product over all heads: on a CPU the vocabulary projection costs about
        as much for 4 rows as for 1, so drafting pays it once instead of once per head.
        """
        if not self.config.shared_lm_head:
            return torch.stack([self.head_logits(i, hidden) for i in range(count)])
        return self._shared_logits(torch.stack([self.blocks[i](hidden) for i in range(count)]))

    def _shared_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.target_lm_head.attached:
            raise RuntimeError("shared-LM-head Medusa has no target LM head attached; load it with "
                               "load_head(dir, target_model)")
        return softcap_logits(self.target_lm_head(hidden), self.softcap)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] (any leading dims) -> logits [K, B, T, V]."""
        return self.first_heads_logits(hidden, self.num_heads)


# ----- export, and the published layouts import reads (heads/formats.py: load_any_head)

def _medusa_lm_heads(head: MedusaHeads) -> list[torch.Tensor]:
    if head.config.shared_lm_head:
        if head.target_lm_head_weight.numel() == 0:
            raise RuntimeError("exporting a shared-LM-head Medusa needs the target attached (load the head with the "
                               "target model)")
        return [head.target_lm_head_weight.detach().contiguous().cpu()] * head.num_heads
    return [layer.weight.detach().contiguous().cpu() for layer in head.lm_heads]


def _medusa_files(head: MedusaHeads, fmt: str, base_model: str | None) -> dict:
    blocks = {name: tensor for name, tensor in state_of(head).items() if name.startswith("blocks.")}
    lm_heads = _medusa_lm_heads(head)
    num_layers = head.config.num_layers
    if fmt == "vllm":
        tensors = dict(blocks)
        for index, weight in enumerate(lm_heads):
            tensors[f"lm_heads.{index}.weight"] = weight.clone()
        config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": head.hidden_size,
                  "vocab_size": head.vocab_size, "truncated_vocab_size": head.vocab_size, "num_heads": head.num_heads,
                  "num_hidden_layers": num_layers, "medusa_num_heads": head.num_heads,
                  "medusa_num_layers": num_layers, "medusa_fc_bias": True, "original_lm_head": False}
        return {"config.json": config, SAFETENSORS: tensors}
    tensors = {}
    for name, tensor in blocks.items():  # blocks.{h}.layers.{l}.{weight,bias} -> {h}.{l}.linear.{weight,bias}
        _, h, _, layer, leaf = name.split(".")
        tensors[f"{h}.{layer}.linear.{leaf}"] = tensor
    for index, weight in enumerate(lm_heads):
        tensors[f"{index}.{num_layers}.weight"] = weight.clone()
    config = {"medusa_num_heads": head.num_heads, "medusa_num_layers": num_layers,
              "base_model_name_or_path": base_model, "hidden_size": head.hidden_size, "vocab_size": head.vocab_size}
    return {"config.json": config, "medusa_lm_head.pt": tensors}


def _medusa_head(heads_blocks: dict, lm_heads: list[torch.Tensor], num_layers: int, target_model, target_config,
                 where: Path) -> MedusaHeads:
    """Medusa heads from blocks ({name: tensor} in our naming, biases optional) and one LM head weight per head:
    heads whose LM heads all equal the target's load as a shared-LM-head Medusa (same logits, no copies)."""
    hidden, vocab = int(target_config.hidden_size), output_vocab_size(target_config)
    bad = [f"LM head {i}: {tuple(w.shape)}" for i, w in enumerate(lm_heads) if tuple(w.shape) != (vocab, hidden)]
    if bad:
        raise ValueError(f"the Medusa heads at {where} do not fit this target (vocabulary {vocab}, hidden size "
                         f"{hidden}): {'; '.join(bad)}")
    target_head = target_model.get_output_embeddings().weight if isinstance(target_model, nn.Module) else None
    shared = target_head is not None and all(
        torch.equal(w.to(target_head.dtype), target_head.detach().cpu()) for w in lm_heads)
    head = MedusaHeads(MedusaConfig(num_heads=len(lm_heads), num_layers=num_layers, shared_lm_head=shared),
                       target_config)
    state = dict(heads_blocks)
    for name, tensor in head.state_dict().items():  # bias-free blocks (vLLM without medusa_fc_bias): zero biases
        if name.endswith(".bias") and name not in state:
            state[name] = torch.zeros_like(tensor)
    if not shared:
        state.update({f"lm_heads.{i}.weight": w for i, w in enumerate(lm_heads)})
    load_into(head, state, where, "Medusa")
    return head


def _import_medusa_reference(directory: Path, config: dict, target_model, target_config) -> MedusaHeads:
    weights = first_file(directory, MEDUSA_REFERENCE_FILES)
    state = load_weights(weights)
    matches = {key: MEDUSA_REFERENCE_KEY.match(key) for key in state}
    bad = [key for key, match in matches.items() if match is None]
    if bad or not state:
        raise ValueError(f"{weights}: not FasterDecoding Medusa heads (keys {{h}}.{{l}}.linear.*, {{h}}.{{L}}.weight); "
                         f"unexpected {bad[:3]}")
    num_heads = 1 + max(int(m[1]) for m in matches.values())
    projections = {int(m[2]) for m in matches.values() if m[3] == "weight"}
    if len(projections) != 1:
        raise ValueError(f"{weights}: Medusa heads with different block counts {sorted(projections)}")
    num_layers = projections.pop()
    stated = (config.get("medusa_num_heads"), config.get("medusa_num_layers", 1))
    if stated != (num_heads, num_layers):  # published configs disagree with their weights; the weights decide
        warnings.warn(f"{directory / 'config.json'} states {stated[0]} heads with {stated[1]} blocks, the weights "
                      f"hold {num_heads} with {num_layers}; using the weights", stacklevel=3)
    blocks, lm_heads = {}, [None] * num_heads
    for key, match in matches.items():
        h, index, leaf = int(match[1]), int(match[2]), match[3]
        if leaf == "weight":
            lm_heads[h] = state[key]
        else:
            blocks[f"blocks.{h}.layers.{index}.{leaf.split('.')[1]}"] = state[key]
    missing = [i for i, w in enumerate(lm_heads) if w is None]
    if missing:
        raise ValueError(f"{weights}: heads {missing} have no vocabulary projection")
    return _medusa_head(blocks, lm_heads, num_layers, target_model, target_config, weights)


def _import_medusa_vllm(directory: Path, config: dict, target_model, target_config) -> MedusaHeads:
    weights = directory / SAFETENSORS
    state = {key.removeprefix("medusa_heads."): value for key, value in load_weights(weights).items()}
    if "token_map" in state:
        raise ValueError(f"{weights}: Medusa heads over a truncated vocabulary (token_map) are not supported")
    num_heads = int(config.get("num_heads", config.get("medusa_num_heads", 0)))
    num_layers = int(config.get("num_hidden_layers", config.get("medusa_num_layers", 1)))
    problems = mismatches([("hidden_size", config.get("hidden_size"), int(target_config.hidden_size)),
                            ("vocab_size", config.get("vocab_size"), output_vocab_size(target_config))])
    if problems:
        raise ValueError(f"the Medusa heads at {directory} do not fit this target: " + "; ".join(problems))
    blocks = {key: value for key, value in state.items() if key.startswith("blocks.")}
    if not config.get("medusa_fc_bias", False):  # what vLLM builds: bias-free blocks, any stored bias unused
        blocks = {key: value for key, value in blocks.items() if not key.endswith(".bias")}
    if config.get("original_lm_head", False):
        lm_heads = [state["lm_heads.0.weight"]] * num_heads
    else:
        lm_heads = [state.get(f"lm_heads.{i}.weight") for i in range(num_heads)]
    if any(w is None for w in lm_heads):
        raise ValueError(f"{weights} lacks LM heads lm_heads.{{0..{num_heads - 1}}}.weight")
    return _medusa_head(blocks, lm_heads, num_layers, target_model, target_config, weights)


def _is_medusa_reference(directory: Path, config: dict | None) -> bool:
    return config is not None and "medusa_num_heads" in config and first_file(directory,
                                                                               MEDUSA_REFERENCE_FILES) is not None


def _is_medusa_vllm(directory: Path, config: dict | None) -> bool:
    return (config is not None and (directory / SAFETENSORS).is_file()
            and (config.get("model_type") == "medusa" or "MedusaModel" in (config.get("architectures") or [])))


LAYOUTS = (
    Layout("medusa-reference", "medusa", "FasterDecoding Medusa (and our reference export): config.json with "
           "medusa_num_heads + medusa_lm_head.safetensors or medusa_lm_head.pt", 10, _is_medusa_reference,
           lambda directory, config, target: _import_medusa_reference(directory, config, target,
                                                                      getattr(target, "config", target))),
    Layout("medusa-vllm", "medusa", "vLLM Medusa (our vllm export): config.json with model_type medusa + "
           "model.safetensors", 20, _is_medusa_vllm,
           lambda directory, config, target: _import_medusa_vllm(directory, config, target,
                                                                 getattr(target, "config", target))),
)
