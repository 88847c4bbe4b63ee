"""Proposer construction by name, shared by the scripts and tests."""

from __future__ import annotations

from runtime.proposers.base import NoProposer, Proposer, ProposeInput
from runtime.proposers.draft_model import DraftModelProposer
from runtime.proposers.ngram import NgramProposer

PROPOSER_NAMES = ("none", "ngram", "draft")


def build_proposer(name: str, target, draft_model: str | None = None, dtype=None) -> Proposer:
    """``none``, ``ngram`` or ``draft`` (needs ``draft_model``: an HF id, dir, .gguf or alias)."""
    if name == "none":
        return NoProposer()
    if name == "ngram":
        return NgramProposer()
    if name == "draft":
        if not draft_model:
            raise ValueError("--proposer draft needs --draft-model (a smaller model with the target's tokenizer)")
        from runtime.target import load_target

        draft = load_target(draft_model, dtype=dtype or target.dtype, device=target.device)
        return DraftModelProposer(draft, target)
    raise ValueError(f"unknown proposer {name!r}; choose one of {', '.join(PROPOSER_NAMES)}")


__all__ = ["NoProposer", "Proposer", "ProposeInput", "DraftModelProposer", "NgramProposer", "build_proposer",
           "PROPOSER_NAMES"]
