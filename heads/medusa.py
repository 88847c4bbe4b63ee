"""Medusa heads: K heads on the target's last hidden state; head i predicts the token i+2 positions ahead.

Each head is a stack of residual blocks x + SiLU(Linear(x)) with zero-initialised linears (every head starts as the
identity, so it starts as the target's own next-token predictor) followed by an LM head. The LM head is either the
target's, shared and frozen (``shared_lm_head``: right for small targets, whose vocabulary dwarfs the hidden size),
or one per head initialised from the target's. Module names follow vLLM's Medusa (``blocks.{h}.layers.{l}``,
``lm_heads.{h}``) so export is a renaming-free copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from heads.base import DraftHead
from heads.common import FrozenProjection, softcap_logits


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
