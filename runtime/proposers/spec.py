"""What proposer to build, as a typed value: ``ProposerSpec`` (``build_proposer`` in ``runtime.proposers`` builds it).

The command-line spellings (``eagle3+ngram``, ``eagle3:DIR``) are parsed by the scripts (scripts/cli.py), not here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

HEAD_PROPOSERS = ("medusa", "eagle", "eagle3")  # proposers that draft with a trained head
PROPOSER_NAMES = ("none", "ngram", "draft", *HEAD_PROPOSERS)


@dataclass(frozen=True)
class ProposerSpec:
    """A proposer to build for a target.

    ``name``: ``none`` (plain decoding), ``ngram`` (prompt lookup), ``draft`` (a smaller model with the target's
    tokenizer, ``draft_model``: an HF id, directory, .gguf or alias), or a head proposer ``medusa`` / ``eagle`` /
    ``eagle3``. ``head``: the head directory (the OUTPUT_DIR/head of a training run) for a head proposer; None: the
    head shipped for the target (heads/shipped). ``lookup_first``: a head proposer drafts by prompt lookup where
    lookup finds a match and by the head elsewhere.
    """

    name: str
    head: str | None = None
    lookup_first: bool = False
    draft_model: str | None = None

    def __post_init__(self):
        if self.name not in PROPOSER_NAMES:
            raise ValueError(f"ProposerSpec.name: unknown proposer {self.name!r}; choose one of "
                             f"{', '.join(PROPOSER_NAMES)}")
        if isinstance(self.head, os.PathLike):
            object.__setattr__(self, "head", os.fspath(self.head))
        if self.head is not None and self.name not in HEAD_PROPOSERS:
            raise ValueError(f"ProposerSpec.head is a head directory for the head proposers "
                             f"({', '.join(HEAD_PROPOSERS)}), not for {self.name!r}")
        if self.lookup_first and self.name not in HEAD_PROPOSERS:
            raise ValueError(f"ProposerSpec.lookup_first puts prompt lookup in front of a head proposer "
                             f"({', '.join(HEAD_PROPOSERS)}), not of {self.name!r}")
        if self.name == "draft" and not self.draft_model:
            raise ValueError("ProposerSpec.draft_model is required for name='draft' (a smaller model with the "
                             "target's tokenizer: an HF id, directory, .gguf or alias)")
        if self.draft_model is not None and self.name != "draft":
            raise ValueError(f"ProposerSpec.draft_model is for name='draft', not {self.name!r}")

    @property
    def label(self) -> str:
        """A short display name: the proposer's name, ``+ngram`` when lookup goes first (``eagle3+ngram``)."""
        return self.name + ("+ngram" if self.lookup_first else "")
