"""What every head type's objective shares: the target's distribution, the vocabulary screen, and the base class
whose hooks a head type overrides (training/objectives/eagle.py, eagle3.py, medusa.py; the registry in __init__).

``objective(batch) -> (loss, stats)``. The batch holds tokens (input_ids, assistant_mask [B, T]) and target
features (see training/features.py). Indexing convention: the target's distribution at position j, p_j, is over
token j+1, and counts only where token j+1 is an assistant token (``next_token_mask``).
Every rank runs the same sequence of module calls whatever its data (ZeRO-3 gathers parameters inside them), so no
branch here depends on the batch contents. ``objective(batch, depth=K) -> (loss, matches)`` evaluates a held-out
batch (training/evaluate.py) inside the same forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from omegaconf import MISSING
from torch import nn

from heads.common import softcap_logits
from training.losses import hard_cross_entropy, soft_cross_entropy, sparse_soft_cross_entropy
from training.vocab_argmax import bf16_screening_pays, screened_argmax


@dataclass
class HeadConf:
    """What every head type's training config holds (its Hydra schema, ``conf_class``, extends it)."""

    head_type: str = MISSING  # the heads.registry name; set by the head group (head=eagle|eagle3|medusa)
    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    targets: str = "soft"  # soft: the target's whole next-token distribution; hard: its greedy token only


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


def safe_mean(values: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` [N] (0 for none: a batch may hold no row a loss counts)."""
    return values.sum() / max(values.shape[0], 1)


class HeadObjective(nn.Module):
    """A head and its training objective: the module the DeepSpeed engine wraps, and what evaluates it.

    One subclass per head type (listed in ``training.objectives.OBJECTIVES``; ``build_objective`` picks it) owns
    that type's parts, so that nothing else branches on the head type:
      ``head_type``, ``conf_class``: its ``heads.registry`` name and its typed Hydra config (conf/head/NAME.yaml
          starts from the schema it registers);
      ``loss(batch)`` -> (loss, stats): the training loss;
      ``matches(batch, depth)`` -> [N, depth]: its drafts' top-1 against the target's greedy branches;
      ``eval_depth`` and ``extra_branch_steps``: the draft steps an evaluation checks, and the greedy branch steps
          it needs beyond them;
      ``feature_layers``: the target layers whose inputs the head reads, known from its config alone;
      ``setup_head``: what a fresh head of the type needs besides the target's frozen weights;
      ``head_conf_for`` and ``head_description``: the config that scores a loaded head, and what a report says of it;
      ``static_tree`` and ``evaluation_report``: a head type that drafts a static tree of rank paths measures it.
    """

    head_type: str
    conf_class: type[HeadConf]
    extra_branch_steps: int = 0  # greedy branch steps an evaluation needs beyond eval_depth
    static_tree: bool = False  # drafts a static tree of rank paths (evaluation_report measures it; a head ships it)

    def __init__(self, head: nn.Module, head_conf, target_lm_head_weight: torch.Tensor, softcap: float | None,
                 lora_target: nn.Module | None = None, pad_id: int = 0):
        super().__init__()
        if head.head_type != getattr(type(self), "head_type", None):
            raise ValueError(f"{type(self).__name__} cannot train a {head.head_type} head: build an objective with "
                             f"training.objectives.build_objective, which picks the one of the head's type")
        self.head = head
        self.conf = head_conf
        self.softcap = softcap
        self.pad_id = pad_id
        self.register_buffer("target_lm_head_weight", target_lm_head_weight.detach(), persistent=False)
        self.lora_target = lora_target  # Medusa-2: a peft-wrapped target whose adapters train
        self.hard = head_conf.targets == "hard"
        self._screen: VocabScreen | None = None

    # ----- the head type's parts, class-level: what a run or an evaluation needs before any objective exists

    @classmethod
    def eval_depth(cls, head_conf, eval_conf) -> int:
        """Draft steps an evaluation checks (``eval.depth``, unless the head type fixes them)."""
        return eval_conf.depth

    @classmethod
    def feature_layers(cls, head_conf, num_layers: int) -> list[int]:
        """The layers of a ``num_layers``-layer target whose inputs a head of ``head_conf`` reads besides the last
        hidden state (what a recorded store records: training/recorded.py): none unless the type fuses some."""
        return []

    @classmethod
    def setup_head(cls, head: nn.Module, head_conf, target, train_split) -> None:
        """Prepare a fresh ``head`` (built from ``head_conf``, the target's frozen weights attached) for training on
        ``target`` with ``train_split`` (items {"input_ids", "assistant_mask"}): nothing unless the type needs it."""

    @classmethod
    def head_conf_for(cls, head: nn.Module) -> HeadConf:
        """The training config that scores a loaded ``head`` (the fields evaluation reads come from the head)."""
        return cls.conf_class()

    @classmethod
    def head_description(cls, head: nn.Module) -> dict:
        """What an evaluation report says of ``head`` beyond its type (scripts/eval_head.py): nothing by default."""
        return {}

    # ----- the objective

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
        """A training batch -> (loss, stats {"loss", "acc", "tokens", ...}): the head type's loss."""
        raise NotImplementedError

    def matches(self, batch: dict, depth: int) -> torch.Tensor:
        """A held-out batch prepared by training/evaluate.py -> matches [N, depth] over the rows that count."""
        raise NotImplementedError

    @torch.no_grad()
    def acceptance(self, batch: dict, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(held-out loss, matches [N, depth]) of one prepared held-out batch."""
        matches = self.matches(batch, depth)
        loss, _ = self.loss(batch)
        return loss, matches

    def evaluation_report(self, prepared: list[dict], max_rank_paths: int) -> dict:
        """Entries a one-process evaluation (``training.evaluate.samples_acceptance``) adds to its report for the
        prepared held-out batches ``prepared`` when asked for up to ``max_rank_paths`` rank paths: none unless the
        head type drafts a static tree (``static_tree``)."""
        return {}

    def _vocab_screen(self, draft_ids: torch.Tensor | None) -> VocabScreen | None:
        """The bf16 screen of the target's LM head for the head's draft vocabulary ``draft_ids`` where it pays on
        this device (``bf16_screening_pays``), made once: the LM head is frozen, and so is the draft vocabulary."""
        weight = self.target_lm_head_weight
        if draft_ids is None or draft_ids.numel() >= weight.shape[0] or not bf16_screening_pays(weight.device):
            return None
        if self._screen is None or self._screen.weight_bf16.device != weight.device:
            self._screen = VocabScreen.of(weight, draft_ids)
        return self._screen
