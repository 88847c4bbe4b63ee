"""DFlash: its training config, the block objective, the block matches, and the setup of a fresh head.

A block at anchor a (a reply token) is the drafter's pass over ``[x_a, MASK x (B - 1)]`` at positions a .. a + B - 1
that sees the context strictly before a (the target's features of x_0 .. x_{a-1}: decoding has no feature of its
root yet) and its own block, bidirectionally. Row k (1 .. B - 1) drafts token a + k: its loss is the soft CE against
p_{a+k-1}, the target's distribution over that token, where it is a reply token, weighted by exp(-(k - 1) / gamma)
(DFlash's decay: early rows decide acceptance). Training samples ``num_anchors`` anchors per sequence anew every step
(a fixed count, so every rank runs the same calls); all blocks of a batch go through the drafter in one pass, their
masks keeping them apart (``block_mask``).

Evaluation drafts a block at every reply anchor: row k's top-1 against the target's greedy branch g_k after prefix
x_0 .. x_a (the chain a decoding step would verify), so ``matches`` list the rows EAGLE's do, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from heads.dflash import ContextKV
from training.draft_vocab import build_draft_vocab, count_tokens, target_to_draft_ids
from training.masks import next_token_mask
from training.objectives.base import HeadConf, HeadObjective, TargetDistribution


@dataclass
class DFlashHeadConf(HeadConf):
    """DFlash: a block of block_size rows drafted in one pass; num_anchors blocks per sequence per step."""

    head_type: str = "dflash"
    lr: float = 6e-4  # SpecForge's DFlash default
    num_layers: int = 1
    block_size: int = 16
    feature_layers: list[int] = field(default_factory=list)  # empty: DFlash's evenly spaced num_features layers
    num_features: int = 5
    draft_vocab_size: int = 8192  # most frequent reply tokens of the training data; 0 = whole vocabulary
    mask_token_id: int = -1  # the target's mask token where it has one (its row starts the mask embedding)
    num_anchors: int = 32  # blocks per sequence per step
    loss_gamma: float = 7.0  # row k weighs exp(-(k - 1) / gamma); 0: every row alike


def sample_anchors(anchor_mask: torch.Tensor, count: int, generator: torch.Generator) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """``count`` anchors per row drawn without replacement among the True columns of anchor_mask [B, T] ->
    (anchors [B, count] long ascending, keep [B, count] bool). A row with fewer candidates keeps them all; its
    other slots repeat column 0 with keep False."""
    scores = torch.rand(anchor_mask.shape, generator=generator).to(anchor_mask.device)
    scores = scores.masked_fill(~anchor_mask, -1.0)
    count = min(count, anchor_mask.shape[1])
    top, index = scores.topk(count, dim=1)
    keep = top >= 0
    anchors = torch.where(keep, index, torch.zeros_like(index))
    order = torch.where(keep, anchors, torch.full_like(anchors, anchor_mask.shape[1])).argsort(dim=1)
    return anchors.gather(1, order), keep.gather(1, order)


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """anchors [B, N] -> positions [B, N * block_size] of the blocks' rows (a .. a + B - 1 for each)."""
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors[:, :, None] + offsets).reshape(anchors.shape[0], -1)


def block_mask(anchors: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """The attention of N blocks over [context of S tokens ; the blocks' rows]: anchors [B, N] -> [B, 1, N * Bs,
    S + N * Bs] bool (True = attend). A row of the block at anchor a sees context columns < a and every row of its
    own block, nothing of another block."""
    batch, blocks = anchors.shape
    rows = blocks * block_size
    own = torch.arange(rows, device=anchors.device) // block_size  # [Q] the block of each row
    context = torch.arange(context_length, device=anchors.device)[None, None, :] < anchors.repeat_interleave(
        block_size, dim=1)[:, :, None]  # [B, Q, S]
    same = (own[:, None] == own[None, :]).expand(batch, -1, -1)  # [B, Q, Q]
    return torch.cat((context, same), dim=2)[:, None]


def row_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[block_size] loss weights of a block's rows: 0 for row 0 (the anchor itself), exp(-(k - 1) / gamma) for row
    k >= 1 (1 for every row with gamma 0)."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    weights = torch.ones(block_size, device=device) if gamma <= 0 else torch.exp(-(k - 1).clamp_min(0) / gamma)
    weights[0] = 0.0
    return weights


def blocks_hidden(head, batch: dict, anchors: torch.Tensor) -> torch.Tensor:
    """The drafter's output rows for blocks at anchors [B, N] of a batch (input_ids, layer_hidden) -> [B, N, Bs, H]."""
    ids, features = batch["input_ids"], batch["layer_hidden"]
    batch_size, length = ids.shape
    context = head.context(features)
    positions = torch.arange(length, device=ids.device)[None].expand(batch_size, -1)
    kv = ContextKV(head.context_kv(context, positions))
    embeddings = head.block_embeddings(ids.gather(1, anchors), context.dtype)
    size = head.block_size
    hidden = head.block_hidden(embeddings, block_positions(anchors, size), block_mask(anchors, length, size), kv)
    return hidden.view(batch_size, anchors.shape[1], size, -1)


def reply_anchors(assistant_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every anchor evaluation drafts from: a reply token after the first column -> (anchors [B, N] ascending, keep
    [B, N]), N the most any row has (in ``mask.nonzero()`` order for the kept ones)."""
    candidates = assistant_mask.bool().clone()
    candidates[:, 0] = False
    counts = candidates.sum(1)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    order = torch.where(candidates, torch.arange(candidates.shape[1], device=candidates.device),
                        candidates.shape[1]).sort(dim=1).values[:, :width]
    keep = order < candidates.shape[1]
    return torch.where(keep, order, 0), keep


@torch.no_grad()
def dflash_matches(head, batch: dict, depth: int) -> torch.Tensor:
    """Blocks at every reply anchor -> matches [N, depth]: row k's top-1 (k = 1 .. depth) against the target's
    greedy branch token k after prefix x_0 .. x_a, in the order of the EAGLE chain's rows."""
    anchors, keep = reply_anchors(batch["assistant_mask"])
    hidden = blocks_hidden(head, batch, anchors)  # [B, N, Bs, H]
    rows, slots = keep.nonzero(as_tuple=True)
    top = head.logits(hidden[rows, slots, 1: depth + 1]).argmax(-1)  # [M, depth]
    to_target = head.draft_to_target
    if to_target is not None:
        top = to_target[top]
    return top == batch["branches"][rows, anchors[rows, slots], :depth]


class DFlashObjective(HeadObjective):
    """DFlash's block objective: num_anchors blocks per sequence, rows weighted by their distance from the anchor."""

    head_type = "dflash"
    conf_class = DFlashHeadConf

    @classmethod
    def eval_depth(cls, head_conf, eval_conf) -> int:
        """Every drafted row of a block: block_size - 1 (the acceptance curve by block position)."""
        return head_conf.block_size - 1

    @classmethod
    def feature_layers(cls, head_conf, num_layers: int) -> list[int]:
        from heads.dflash import default_feature_layers

        return [int(i) for i in head_conf.feature_layers] or default_feature_layers(num_layers,
                                                                                    head_conf.num_features)

    @classmethod
    def setup_head(cls, head: nn.Module, head_conf, target, train_split) -> None:
        """The draft vocabulary (unless it is the whole vocabulary) and the mask embedding's start."""
        if head.draft_vocab_size < target.vocab_size:
            counts = count_tokens(train_split["input_ids"], train_split["assistant_mask"], target.vocab_size)
            head.set_draft_vocab(*build_draft_vocab(counts, head.draft_vocab_size))
        head.init_mask_embedding()

    @classmethod
    def head_conf_for(cls, head: nn.Module) -> DFlashHeadConf:
        config = head.config
        return DFlashHeadConf(num_layers=config.num_layers, block_size=config.block_size,
                              feature_layers=list(config.feature_layers), num_features=config.num_features,
                              draft_vocab_size=config.draft_vocab_size, mask_token_id=config.mask_token_id)

    @classmethod
    def head_description(cls, head: nn.Module) -> dict:
        return {"feature_layers": list(head.feature_layers), "block_size": head.block_size,
                "draft_layers": head.config.num_layers, "draft_vocab": head.draft_vocab_size}

    def loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        conf, head = self.conf, self.head
        ids, assistant = batch["input_ids"], batch["assistant_mask"].bool()
        length, size = ids.shape[1], head.block_size
        predict = next_token_mask(assistant)
        draft_ids = head.draft_to_target
        target = TargetDistribution(batch, predict, self.target_lm_head_weight, self.softcap, draft_ids=draft_ids,
                                    hard=self.hard, screen=self._vocab_screen(draft_ids))
        generator = torch.Generator().manual_seed(int(batch.get("noise_seed", 0)))
        candidates = assistant & (torch.arange(length, device=ids.device) > 0)[None]
        anchors, keep = sample_anchors(candidates, conf.num_anchors, generator)
        hidden = blocks_hidden(head, batch, anchors)  # [B, N, Bs, H]
        columns = anchors[:, :, None] + torch.arange(size, device=ids.device)  # [B, N, Bs] token each row drafts
        inside = columns < length
        counted = inside & predict.gather(1, (columns - 1).clamp(0, length - 1).view(ids.shape[0], -1)).view(
            columns.shape) & keep[:, :, None]
        counted[:, :, 0] = False
        rows, slots, offsets = counted.nonzero(as_tuple=True)
        previous = columns[rows, slots, offsets] - 1  # p_{a+k-1} is over token a + k
        greedy = target.greedy(rows, previous)
        to_draft = None if draft_ids is None else target_to_draft_ids(head.d2t, head.t2d.shape[0])
        in_vocab = torch.ones_like(greedy, dtype=torch.bool) if to_draft is None else head.t2d[greedy]
        logits = head.logits(hidden[rows, slots, offsets])
        ce = target.cross_entropy(logits, rows, previous, to_draft)
        weights = row_weights(size, conf.loss_gamma, ids.device)[offsets] * in_vocab
        loss = (ce * weights).sum() / weights.sum().clamp_min(1e-6)
        wanted = greedy if to_draft is None else to_draft[greedy]
        agree = (logits.argmax(-1) == wanted) & in_vocab
        first = offsets == 1
        stats = {"loss": loss.detach(), "acc": agree[first].float().sum() / max(int(first.sum()), 1),
                 "tokens": predict.sum().float(), "blocks": keep.sum().float()}
        for k in (1, 2, 4, 8):
            if k < size:
                at = offsets == k
                stats[f"acc_{k}"] = agree[at].float().sum() / max(int(at.sum()), 1)
        return loss, stats

    def matches(self, batch: dict, depth: int) -> torch.Tensor:
        return dflash_matches(self.head, batch, depth)

