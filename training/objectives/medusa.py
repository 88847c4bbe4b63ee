"""Medusa (and Medusa-2): its training config, objective, matches and ranks, and the static tree its evaluation
measures.

Medusa head i at row t: hidden t -> p_{t+1+i}. At evaluation head i at hidden t must equal g_{i+1} from prefix t
(g_1 is the target's bonus token, so the greedy branches run one step past the heads). Medusa-2 trains LoRA adapters
of the target with the heads (``LoraConf``), keeping the target's own next-token loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from heads.common import frozen_target_weights
from runtime.proposers.medusa import measured_rank_paths
from training.losses import decay_weights
from training.masks import next_token_mask, shift_left
from training.objectives.base import HeadConf, HeadObjective, TargetDistribution, safe_mean


@dataclass
class LoraConf:
    """Medusa-2: train LoRA adapters of the target jointly, keeping the target's own LM loss."""

    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    lm_loss_weight: float = 1.0


@dataclass
class MedusaHeadConf(HeadConf):
    head_type: str = "medusa"
    num_heads: int = 4
    num_layers: int = 1
    shared_lm_head: bool = True
    loss_decay: float = 0.8
    lr: float = 1e-3
    lora: LoraConf = field(default_factory=LoraConf)


@torch.no_grad()
def medusa_matches(heads, batch: dict, hidden: torch.Tensor) -> torch.Tensor:
    """Medusa's heads on hidden [B, T, H] against the greedy branches -> matches [N, heads] over the rows that count
    (the head's argmax is the branch's token: a rank of 0 in ``medusa_ranks``)."""
    return medusa_ranks(heads, batch, hidden) == 0


@torch.no_grad()
def medusa_ranks(heads, batch: dict, hidden: torch.Tensor) -> torch.Tensor:
    """Ranks [N, heads] of the greedy branches' tokens under each of Medusa's heads on hidden [B, T, H], over the
    rows that count: 0 where the head's argmax is the token, else how many tokens come before it (higher logits,
    or equal ones at lower ids, as argmax breaks ties).

    The runtime drafts from the hidden state of the token before the root (the root being the target's own next
    token), so a row counts where the *next* token is an assistant token, the rows training predicts from: head i
    at position t guesses the token after branch token i, t + 2 + i."""
    rows, cols = next_token_mask(batch["assistant_mask"]).nonzero(as_tuple=True)
    selected = hidden[rows, cols]
    ranks = []
    for i in range(heads.num_heads):
        logits = heads.head_logits(i, selected)
        token = batch["branches"][rows, cols, i + 1, None]
        truth = logits.gather(-1, token)
        earlier = torch.arange(logits.shape[-1], device=logits.device) < token
        ranks.append(((logits > truth) | ((logits == truth) & earlier)).sum(-1))
    return torch.stack(ranks, dim=-1)


class MedusaObjective(HeadObjective):
    """Medusa's heads, each on the target's last hidden state (Medusa-2: of the target being trained)."""

    head_type = "medusa"
    conf_class = MedusaHeadConf
    extra_branch_steps = 1  # Medusa's first head drafts the token after the bonus
    static_tree = True

    @classmethod
    def eval_depth(cls, head_conf, eval_conf) -> int:
        """Medusa's heads: each drafts one step."""
        return head_conf.num_heads

    @classmethod
    def setup_head(cls, head: nn.Module, head_conf, target, train_split) -> None:
        """Own LM heads (not shared) start as the target's."""
        if not head.config.shared_lm_head:
            embed, lm_head = frozen_target_weights(target.model)
            head.attach_target_weights(embed, lm_head, init_heads=True)

    @classmethod
    def head_conf_for(cls, head: nn.Module) -> MedusaHeadConf:
        return MedusaHeadConf(num_heads=head.num_heads)

    def target_hidden(self, batch: dict) -> torch.Tensor:
        """[B, T, H]: the batch's target hidden states; Medusa-2 reads those of the target being trained."""
        if self.lora_target is not None:
            return self.lora_target.get_decoder()(input_ids=batch["input_ids"], use_cache=False).last_hidden_state
        return batch["hidden"]

    def loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        conf = self.conf
        ids = batch["input_ids"]
        predict = next_token_mask(batch["assistant_mask"])
        teacher = TargetDistribution(batch, predict, self.target_lm_head_weight, self.softcap, hard=self.hard)
        hidden = self.target_hidden(batch)
        loss = 0.0
        stats = {}
        for index, weight in enumerate(decay_weights(self.head.num_heads, conf.loss_decay)):
            rows, cols = shift_left(predict, 1 + index, False).nonzero(as_tuple=True)
            logits = self.head.head_logits(index, hidden[rows, cols])
            head_loss = safe_mean(teacher.cross_entropy(logits, rows, cols + 1 + index))
            loss = loss + weight * head_loss
            stats[f"ce_{index}"] = head_loss.detach()
            if index == 0:
                agree = logits.argmax(-1) == teacher.greedy(rows, cols + 1 + index)
                stats["acc"] = agree.float().sum() / max(agree.numel(), 1)
                stats["tokens"] = torch.tensor(float(rows.numel()))
        if self.lora_target is not None:  # Medusa-2 keeps the target's own next-token loss
            rows, cols = predict.nonzero(as_tuple=True)
            logits = self.lora_target.get_output_embeddings()(hidden[rows, cols])
            lm_loss = safe_mean(F.cross_entropy(logits.float(), ids[rows, cols + 1], reduction="none"))
            loss = loss + conf.lora.lm_loss_weight * lm_loss
            stats["lm_loss"] = lm_loss.detach()
        stats["loss"] = loss.detach()
        return loss, stats

    def matches(self, batch: dict, depth: int) -> torch.Tensor:
        """The heads' matches [N, num_heads] (the depth is theirs: ``eval_depth``)."""
        return medusa_matches(self.head, batch, self.target_hidden(batch))

    def evaluation_report(self, prepared: list[dict], max_rank_paths: int) -> dict:
        """The static tree measured on the same positions: "rank_paths" and "rank_path_frequencies"
        (``measured_rank_paths``, ``max_rank_paths`` at most), "path_frequency", {path: frequency} of every path seen
        (``runtime.proposers.medusa.tree_tau`` scores any tree with it), and "ranks" [N, heads] with "run_lengths"
        and "reached" (``decoding_tau`` of ``tree_accepted`` scores any tree as decoding gets it)."""
        ranks = torch.cat([medusa_ranks(self.head, batch, batch["hidden"]) for batch in prepared])
        paths, frequencies = measured_rank_paths(ranks, max_paths=None)
        report = {"rank_paths": paths[:max_rank_paths], "rank_path_frequencies": frequencies[:max_rank_paths],
                  "path_frequency": dict(zip(paths, frequencies)),  # every path seen: scores any tree
                  "ranks": ranks.cpu()}
        for key in ("run_lengths", "reached"):
            report[key] = [value for batch in prepared for value in batch[key].tolist()]
        return report
