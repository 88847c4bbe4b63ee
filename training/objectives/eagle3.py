"""EAGLE-3: its training config, the training-time test objective, and the setup of a fresh head.

Step k of the training-time test at row t: (token t+k+1, own hidden) -> p_{t+k+1}, restricted to the draft
vocabulary. A fresh head gets its draft vocabulary (the most frequent assistant tokens of the training split) and,
with ``init_lm_head``, the target's LM head rows and final norm. Evaluation drafts an EAGLE chain
(``training.objectives.eagle.eagle_matches``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from heads.common import frozen_target_weights
from heads.eagle3 import default_feature_layers
from training.draft_vocab import build_draft_vocab, count_tokens, target_to_draft_ids
from training.losses import decay_weights, uniform_noise
from training.masks import ChainCache, chain_attention_mask, next_token_mask, shift_left
from training.objectives.base import HeadConf, HeadObjective, TargetDistribution
from training.objectives.eagle import eagle_matches


@dataclass
class Eagle3HeadConf(HeadConf):
    """EAGLE-3: fused low/mid/high features, draft vocabulary, training-time test over ttt_steps unrolled steps."""

    head_type: str = "eagle3"
    feature_layers: list[int] = field(default_factory=list)  # empty: inputs of layers 2, N//2, N-3
    draft_vocab_size: int = 8192  # 0: the target's whole vocabulary
    ttt_steps: int = 7
    loss_decay: float = 0.8
    noise_std: float = 0.0  # uniform noise on the fused input features, width noise_std (EAGLE's; 0: none)
    init_lm_head: bool = True  # start the draft LM head and norm from the target's (rows of the draft vocabulary)


def norm_scale(norm: nn.Module) -> torch.Tensor:
    """[H]: the per-channel scale ``norm`` (an RMSNorm) applies to an input of unit RMS: its weight for the Llama
    formula, 1 + weight for Gemma's. A head's Llama-style norm starts as the target's final norm with this weight."""
    weight = norm.weight
    with torch.no_grad():
        return norm(torch.ones(1, weight.shape[0], dtype=weight.dtype, device=weight.device))[0].detach()


class Eagle3Objective(HeadObjective):
    """EAGLE-3's training-time test: ``ttt_steps`` unrolled draft steps, each on the head's own hidden states."""

    head_type = "eagle3"
    conf_class = Eagle3HeadConf

    @classmethod
    def feature_layers(cls, head_conf, num_layers: int) -> list[int]:
        """The fused layers: the configured ones, else the default low, mid and high layers."""
        return [int(i) for i in head_conf.feature_layers] or default_feature_layers(num_layers)

    @classmethod
    def setup_head(cls, head: nn.Module, head_conf, target, train_split) -> None:
        """The draft vocabulary (unless it is the whole vocabulary) and, with ``init_lm_head``, the target's LM head
        rows and final norm as the draft LM head and norm."""
        if head.draft_vocab_size < target.vocab_size:
            counts = count_tokens(train_split["input_ids"], train_split["assistant_mask"], target.vocab_size)
            head.set_draft_vocab(*build_draft_vocab(counts, head.draft_vocab_size))
        if head_conf.init_lm_head:
            _, lm_head = frozen_target_weights(target.model)
            final_norm = getattr(target.model.get_decoder(), "norm", None)
            head.init_output_from_target(lm_head, None if final_norm is None else norm_scale(final_norm))

    @classmethod
    def head_conf_for(cls, head: nn.Module) -> Eagle3HeadConf:
        return Eagle3HeadConf(feature_layers=list(head.feature_layers), draft_vocab_size=head.draft_vocab_size)

    @classmethod
    def head_description(cls, head: nn.Module) -> dict:
        return {"feature_layers": list(head.feature_layers), "draft_vocab": head.draft_vocab_size}

    def loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        conf = self.conf
        ids = batch["input_ids"]
        batch_size, length = ids.shape
        predict = next_token_mask(batch["assistant_mask"])
        draft_ids = self.head.draft_to_target
        target = TargetDistribution(batch, predict, self.target_lm_head_weight, self.softcap, draft_ids=draft_ids,
                                    hard=self.hard, screen=self._vocab_screen(draft_ids))
        to_draft = target_to_draft_ids(self.head.d2t, self.head.t2d.shape[0])
        cache = ChainCache()
        hidden = batch["layer_hidden"]
        if self.training and conf.noise_std > 0:  # EAGLE's feature noise, on the fused layers' inputs
            hidden = hidden + uniform_noise(hidden.shape, conf.noise_std, int(batch["noise_seed"]), hidden.device,
                                            hidden.dtype)
        loss = 0.0
        stats = {}
        for step, weight in enumerate(decay_weights(conf.ttt_steps, conf.loss_decay)):
            positions = (torch.arange(length, device=ids.device) + step)[None].expand(batch_size, -1)
            mask = chain_attention_mask(length, step, ids.device)
            hidden = self.head.hidden_states(shift_left(ids, step + 1, self.pad_id), hidden, positions, mask, cache)
            rows, cols = shift_left(predict, step + 1, False).nonzero(as_tuple=True)
            target_cols = cols + step + 1
            greedy = target.greedy(rows, target_cols)
            in_vocab = self.head.t2d[greedy]  # False where the draft vocabulary cannot express the target's token
            logits = self.head.logits(hidden[rows, cols])
            ce = target.cross_entropy(logits, rows, target_cols, to_draft)
            step_loss = (ce * in_vocab).sum() / max(int(in_vocab.sum()), 1)
            loss = loss + weight * step_loss
            agree = (logits.argmax(-1) == to_draft[greedy]) & in_vocab
            stats[f"ce_{step}"] = step_loss.detach()
            if step == 0:
                stats["acc"] = agree.float().sum() / max(agree.numel(), 1)
                stats["tokens"] = torch.tensor(float(rows.numel()))
        stats["loss"] = loss.detach()
        return loss, stats

    def matches(self, batch: dict, depth: int) -> torch.Tensor:
        return eagle_matches(self.head, batch, depth)
