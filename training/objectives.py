"""The training objectives of the three head types, as one module the DeepSpeed engine wraps.

``HeadObjective(batch) -> (loss, stats)``. The batch holds tokens (input_ids, assistant_mask [B, T]) and target
features (see training/features.py). Indexing convention: the target's distribution at position j, p_j, is over
token j+1, and counts only where token j+1 is an assistant token (``next_token_mask``).
  EAGLE-1 row t: (token t+1, feature t) -> feature t+1 and p_{t+1};
  EAGLE-3 step k row t: (token t+k+1, own hidden) -> p_{t+k+1}, restricted to the draft vocabulary;
  Medusa head i at row t: hidden t -> p_{t+1+i}.
Every rank runs the same sequence of module calls whatever its data (ZeRO-3 gathers parameters inside them), so no
branch here depends on the batch contents. ``HeadObjective(batch, depth=K) -> (loss, matches)`` evaluates a held-out
batch (training/evaluate.py) inside the same forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from heads.common import softcap_logits
from training.draft_vocab import target_to_draft_ids
from training.evaluate import eagle_matches, medusa_matches
from training.losses import (decay_weights, feature_regression_loss, hard_cross_entropy, soft_cross_entropy,
                             sparse_soft_cross_entropy, uniform_noise)
from training.masks import ChainCache, chain_attention_mask, next_token_mask, shift_left
from training.vocab_argmax import bf16_screening_pays, screened_argmax


class TargetDistribution:
    """The target's next-token distribution at the positions a loss needs (``positions`` [B, T] bool).

    Exact (dense) mode computes the target's logits once for all those positions (the loss steps and heads that
    reuse a position index into one table, instead of re-running the LM head); ``draft_ids`` [V'] restricts the
    distribution to a draft vocabulary and renormalises it; with a ``VocabScreen`` as well, only the draft rows are
    multiplied in fp32 and the greedy token comes from the bf16 screen (``training.vocab_argmax``). Stored top-k mode
    reads ``topk_logprobs``/``topk_ids``.
    hard: the losses train on the target's greedy token alone instead of its whole distribution.
    """

    def __init__(self, batch: dict, positions: torch.Tensor, lm_head_weight: torch.Tensor, softcap: float | None,
                 draft_ids: torch.Tensor | None = None, hard: bool = False, screen: VocabScreen | None = None):
        self.batch = batch
        self.hard = hard
        self.sparse = "topk_ids" in batch
        if self.sparse:
            return
        rows, cols = positions.nonzero(as_tuple=True)
        self.index = torch.full(positions.shape, -1, dtype=torch.long, device=positions.device)
        self.index[rows, cols] = torch.arange(rows.numel(), device=positions.device)
        with torch.no_grad():
            hidden = batch["hidden"][rows, cols].float()
            if draft_ids is not None and screen is not None:
                # Only the draft vocabulary's logits, and the greedy token through the bf16 screen: the table
                # below without the fp32 product over the whole vocabulary (training.vocab_argmax).
                self.greedy_table = screened_argmax(hidden, lm_head_weight, screen.weight_bf16)
                logits = softcap_logits(F.linear(hidden, screen.draft_weight), softcap)
            else:
                logits = softcap_logits(F.linear(hidden, lm_head_weight.float()), softcap)
                self.greedy_table = logits.argmax(-1)  # [N] the target's greedy token (full vocabulary)
                if draft_ids is not None:
                    logits = logits[:, draft_ids]
            self.logprob_table = F.log_softmax(logits, dim=-1)  # [N, V or V']

    def _lookup(self, rows, cols) -> torch.Tensor:
        index = self.index[rows, cols]
        if bool((index < 0).any()):
            raise IndexError("target distribution asked for a position outside the positions it was built for")
        return index

    def greedy(self, rows, cols) -> torch.Tensor:
        if self.sparse:
            return self.batch["topk_ids"][rows, cols, 0]
        return self.greedy_table[self._lookup(rows, cols)]

    def cross_entropy(self, draft_logits: torch.Tensor, rows, cols,
                      target_to_draft: torch.Tensor | None = None) -> torch.Tensor:
        """Soft CE [N] of draft logits [N, V'] against p at (rows, cols); sparse mode maps the top-k ids through
        ``target_to_draft`` [V] (ids outside the draft vocabulary drop out). Hard: CE against p's greedy token."""
        if self.hard:
            greedy = self.greedy(rows, cols)
            return hard_cross_entropy(draft_logits, greedy if target_to_draft is None else target_to_draft[greedy])
        if self.sparse:
            logprobs = self.batch["topk_logprobs"][rows, cols]
            ids = self.batch["topk_ids"][rows, cols]
            if target_to_draft is not None:
                ids = target_to_draft[ids]
                logprobs = logprobs.masked_fill(ids < 0, float("-inf"))
            return sparse_soft_cross_entropy(draft_logits, logprobs, ids)
        return soft_cross_entropy(draft_logits, self.logprob_table[self._lookup(rows, cols)])


@dataclass
class VocabScreen:
    """What ``TargetDistribution`` needs to skip the full-vocabulary fp32 product for a draft vocabulary: the LM
    head in bf16 (the screen) and its draft-vocabulary rows in fp32."""

    weight_bf16: torch.Tensor  # [V, H]
    draft_weight: torch.Tensor  # [V', H] fp32

    @staticmethod
    def of(lm_head_weight: torch.Tensor, draft_ids: torch.Tensor) -> VocabScreen:
        weight = lm_head_weight.detach()
        return VocabScreen(weight.to(torch.bfloat16), weight[draft_ids.to(weight.device)].float())


def _mean(values: torch.Tensor) -> torch.Tensor:
    return values.sum() / max(values.shape[0], 1)


class HeadObjective(nn.Module):
    def __init__(self, head: nn.Module, head_conf, target_lm_head_weight: torch.Tensor, softcap: float | None,
                 lora_target: nn.Module | None = None, pad_id: int = 0):
        super().__init__()
        self.head = head
        self.conf = head_conf
        self.head_type = head.head_type
        self.softcap = softcap
        self.pad_id = pad_id
        self.register_buffer("target_lm_head_weight", target_lm_head_weight.detach(), persistent=False)
        self.lora_target = lora_target  # Medusa-2: a peft-wrapped target whose adapters train
        self.hard = head_conf.targets == "hard"
        self._screen: VocabScreen | None = None

    def _vocab_screen(self, draft_ids: torch.Tensor | None) -> VocabScreen | None:
        """The bf16 screen of the target's LM head for the head's draft vocabulary ``draft_ids`` where it pays on
        this device (``bf16_screening_pays``), made once: the LM head is frozen, and so is the draft vocabulary."""
        weight = self.target_lm_head_weight
        if draft_ids is None or draft_ids.numel() >= weight.shape[0] or not bf16_screening_pays(weight.device):
            return None
        if self._screen is None or self._screen.weight_bf16.device != weight.device:
            self._screen = VocabScreen.of(weight, draft_ids)
        return self._screen

    def forward(self, batch: dict, depth: int | None = None) -> tuple[torch.Tensor, dict | torch.Tensor]:
        """A training batch -> (loss, stats). With ``depth``, a held-out batch prepared by training/evaluate.py ->
        (loss, matches [N, depth]): the draft chain's (Medusa: the heads') top-1 against the target's greedy
        branches. Evaluation is a mode of this forward so that every call of the head happens inside the engine
        module's forward, as in training: ZeRO-3 partitions the head's parameters and gathers them for the calls
        it sees there (a multi-GPU evaluation that called the head from outside read empty LM head weights)."""
        if depth is not None:
            return self.acceptance(batch, depth)
        return self.loss(batch)

    def loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        if self.head_type == "eagle":
            return self.eagle_loss(batch)
        if self.head_type == "eagle3":
            return self.eagle3_loss(batch)
        return self.medusa_loss(batch)

    @torch.no_grad()
    def acceptance(self, batch: dict, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(held-out loss, matches [N, depth]) of one prepared held-out batch."""
        if self.head_type != "medusa":
            matches = eagle_matches(self.head, batch, depth)
        elif self.lora_target is not None:  # Medusa-2 reads the hidden states of the target being trained
            hidden = self.lora_target.get_decoder()(input_ids=batch["input_ids"], use_cache=False).last_hidden_state
            matches = medusa_matches(self.head, batch, hidden)
        else:
            matches = medusa_matches(self.head, batch, batch["hidden"])
        loss, _ = self.loss(batch)
        return loss, matches

    # ----- EAGLE-1/2
    def eagle_loss(self, batch):
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
        feature_loss = _mean(feature_regression_loss(predicted, features[rows, cols + 1]))
        target = TargetDistribution(batch, predict, self.target_lm_head_weight, self.softcap, hard=self.hard)
        logits = self.head.logits(predicted)
        ce = _mean(target.cross_entropy(logits, rows, cols + 1))
        loss = conf.feature_weight * feature_loss + conf.ce_weight * ce
        agree = logits.argmax(-1) == target.greedy(rows, cols + 1)
        return loss, {"loss": loss.detach(), "feature_loss": feature_loss.detach(), "ce": ce.detach(),
                      "acc": agree.float().sum() / max(agree.numel(), 1), "tokens": torch.tensor(float(rows.numel()))}

    # ----- EAGLE-3 training-time test
    def eagle3_loss(self, batch):
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

    # ----- Medusa (and Medusa-2)
    def medusa_loss(self, batch):
        conf = self.conf
        ids = batch["input_ids"]
        predict = next_token_mask(batch["assistant_mask"])
        teacher = TargetDistribution(batch, predict, self.target_lm_head_weight, self.softcap, hard=self.hard)
        if self.lora_target is not None:
            hidden = self.lora_target.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        else:
            hidden = batch["hidden"]
        loss = 0.0
        stats = {}
        for index, weight in enumerate(decay_weights(self.head.num_heads, conf.loss_decay)):
            rows, cols = shift_left(predict, 1 + index, False).nonzero(as_tuple=True)
            logits = self.head.head_logits(index, hidden[rows, cols])
            head_loss = _mean(teacher.cross_entropy(logits, rows, cols + 1 + index))
            loss = loss + weight * head_loss
            stats[f"ce_{index}"] = head_loss.detach()
            if index == 0:
                agree = logits.argmax(-1) == teacher.greedy(rows, cols + 1 + index)
                stats["acc"] = agree.float().sum() / max(agree.numel(), 1)
                stats["tokens"] = torch.tensor(float(rows.numel()))
        if self.lora_target is not None:  # Medusa-2 keeps the target's own next-token loss
            rows, cols = predict.nonzero(as_tuple=True)
            logits = self.lora_target.get_output_embeddings()(hidden[rows, cols])
            lm_loss = _mean(F.cross_entropy(logits.float(), ids[rows, cols + 1], reduction="none"))
            loss = loss + conf.lora.lm_loss_weight * lm_loss
            stats["lm_loss"] = lm_loss.detach()
        stats["loss"] = loss.detach()
        return loss, stats
