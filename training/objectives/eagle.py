"""EAGLE-1/2: its training config, objective and the draft-chain matches (which EAGLE-3 shares).

EAGLE-1 row t: (token t+1, feature t) -> feature t+1 and p_{t+1}: SmoothL1 on the next feature plus soft CE on the
target's distribution. Draft step k of an EAGLE chain at row t starts from the context x_0..x_{t+1} (features up to
t): its top-1 must equal the target's greedy g_k from prefix t+1; a step counts only while every earlier step was
accepted (training/evaluate.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.losses import feature_regression_loss, uniform_noise
from training.masks import ChainCache, chain_attention_mask, next_token_mask
from training.objectives.base import HeadConf, HeadObjective, TargetDistribution, safe_mean


@dataclass
class EagleHeadConf(HeadConf):
    """EAGLE-1/2: SmoothL1 on the next feature (feature_weight) + soft CE on the target's distribution (ce_weight)."""

    head_type: str = "eagle"
    num_layers: int = 1
    feature_weight: float = 1.0
    ce_weight: float = 0.1
    noise_std: float = 0.2  # uniform noise on input features, width noise_std


@torch.no_grad()
def eagle_matches(head, batch: dict, depth: int) -> torch.Tensor:
    """Draft chain of an EAGLE head -> matches [N, depth] over the rows that count."""
    ids = batch["input_ids"]
    features = batch["layer_hidden"] if head.feature_layers else batch["hidden"]
    batch_size, length = ids.shape
    steps = length - 1
    branches = batch["branches"][:, 1:]  # row t drafts after prefix t+1
    rows, cols = batch["assistant_mask"][:, 1:].nonzero(as_tuple=True)
    to_target = head.draft_to_target
    cache = ChainCache()
    hidden = features[:, :-1]
    matches = []
    for step in range(depth):
        tokens = ids[:, 1:] if step == 0 else branches[..., step - 1]
        positions = (torch.arange(steps, device=ids.device) + step)[None].expand(batch_size, -1)
        hidden = head.hidden_states(tokens, hidden, positions, chain_attention_mask(steps, step, ids.device), cache)
        top = head.logits(hidden[rows, cols]).argmax(-1)
        if to_target is not None:
            top = to_target[top]
        matches.append(top == branches[rows, cols, step])
    return torch.stack(matches, dim=-1)


class EagleObjective(HeadObjective):
    """EAGLE-1/2's objective: next feature and next-token distribution from (token t+1, feature t)."""

    head_type = "eagle"
    conf_class = EagleHeadConf

    def loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        conf = self.conf
        ids, features = batch["input_ids"], batch["hidden"]
        batch_size, length = ids.shape
        inputs = features[:, :-1]
        if self.training and conf.noise_std > 0:
            inputs = inputs + uniform_noise(inputs.shape, conf.noise_std, int(batch["noise_seed"]), inputs.device,
                                            inputs.dtype)
        positions = torch.arange(length - 1, device=ids.device)[None].expand(batch_size, -1)
        hidden = self.head.hidden_states(ids[:, 1:], inputs, positions)
        predict = next_token_mask(batch["assistant_mask"])
        rows, cols = predict[:, 1:].nonzero(as_tuple=True)
        predicted = hidden[rows, cols]
        feature_loss = safe_mean(feature_regression_loss(predicted, features[rows, cols + 1]))
        target = TargetDistribution(batch, predict, self.target_lm_head_weight, self.softcap, hard=self.hard)
        logits = self.head.logits(predicted)
        ce = safe_mean(target.cross_entropy(logits, rows, cols + 1))
        loss = conf.feature_weight * feature_loss + conf.ce_weight * ce
        agree = logits.argmax(-1) == target.greedy(rows, cols + 1)
        return loss, {"loss": loss.detach(), "feature_loss": feature_loss.detach(), "ce": ce.detach(),
                      "acc": agree.float().sum() / max(agree.numel(), 1), "tokens": torch.tensor(float(rows.numel()))}

    def matches(self, batch: dict, depth: int) -> torch.Tensor:
        return eagle_matches(self.head, batch, depth)
