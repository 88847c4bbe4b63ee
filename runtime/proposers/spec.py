"""What proposer to build, as a typed value: ``ProposerSpec`` (``build_proposer`` in ``runtime.proposers`` builds it).

The command-line spellings (``eagle3+ngram``, ``eagle3:DIR``) are parsed by the command line (cli/args.py), not here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

HEAD_PROPOSERS = ("medusa", "eagle", "eagle3", "dflash")  # proposers that draft with a trained head
PROPOSER_NAMES = ("none", "ngram", "draft", "lookahead", *HEAD_PROPOSERS)
LOOKUP_PROPOSERS = (*HEAD_PROPOSERS, "lookahead")  # proposers that take prompt lookup beside them (lookup_first)


@dataclass(frozen=True)
class LookaheadSettings:
    """Lookahead decoding's sizes: ``window`` (W) future positions the Jacobi window guesses, n-grams of ``ngram``
    (N) tokens (the window keeps N - 1 levels of guesses; N >= 3), at most ``candidates`` (G) n-grams verified per
    step, also the most the pool keeps per first token, and ``recycled`` (R) tree nodes beyond them for the
    successors the target's verification passes computed (0: none). A pass carries (N - 1) W - 1 window rows and a
    tree of at most 1 + G (N - 1) + R nodes. ``carry``: the successors recorded in one generation serve the next
    ones (as Token Recycling inherits its table from the previous query); False starts each generation empty.
    ``prior``: a token with no successors recorded yet drafts from the target's context-free successors of it
    (``runtime.proposers.successor_prior``, measured once per target), and a token's recorded successors are mixed with
    them."""

    window: int
    ngram: int
    candidates: int
    recycled: int = 0
    carry: bool = True
    prior: bool = True

    def __post_init__(self):
        for name in ("carry", "prior"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LookaheadSettings.{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("window", "ngram", "candidates", "recycled"):
            value = getattr(self, name)
            least = 0 if name == "recycled" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"LookaheadSettings.{name} must be an integer >= {least}, got {value!r}")
        if self.ngram < 3:
            raise ValueError(f"LookaheadSettings.ngram must be >= 3 (the window keeps N - 1 >= 2 levels: the oldest "
                             f"starts each n-gram, the newest is guessed from the ones below), got {self.ngram}")

    @property
    def window_rows(self) -> int:
        """Extra rows a pass carries for the window: level 0 is the root and W - 1 guesses, each other level W."""
        return (self.ngram - 1) * self.window - 1

    @property
    def tree_size(self) -> int:
        """The most tree nodes G candidates of N - 1 tokens take (a trie shares their common prefixes), and R recycled
        nodes."""
        return 1 + self.candidates * (self.ngram - 1) + self.recycled

    def __str__(self) -> str:
        carried = "" if self.carry or not self.recycled else ", successors per generation"
        prior = "" if self.prior or not self.recycled else ", no prior"
        return f"W={self.window}, N={self.ngram}, G={self.candidates}, R={self.recycled}{carried}{prior}"


@dataclass(frozen=True)
class ProposerSpec:
    """A proposer to build for a target.

    ``name``: ``none`` (plain decoding), ``ngram`` (prompt lookup), ``draft`` (a smaller model with the target's
    tokenizer, ``draft_model``: an HF id, directory, .gguf or alias), or a head proposer ``medusa`` / ``eagle`` /
    ``eagle3`` / ``dflash``, or ``lookahead`` (lookahead decoding: the target's own Jacobi guesses, no draft
    model). ``head``: the head directory (the OUTPUT_DIR/head of a training run) for a head proposer; None: the head
    shipped for the target (heads/shipped). ``lookup_first``: a head proposer drafts by prompt lookup where lookup
    finds a match and by the head (or lookahead's n-gram pool and window) elsewhere.
    ``lookahead``: lookahead's sizes (``LookaheadSettings``, or (W, N, G)); None: chosen from the target's measured
    cost curve.
    """

    name: str
    head: str | None = None
    lookup_first: bool = False
    draft_model: str | None = None
    lookahead: LookaheadSettings | None = None

    def __post_init__(self):
        if self.name not in PROPOSER_NAMES:
            raise ValueError(f"ProposerSpec.name: unknown proposer {self.name!r}; choose one of "
                             f"{', '.join(PROPOSER_NAMES)}")
        if isinstance(self.head, os.PathLike):
            object.__setattr__(self, "head", os.fspath(self.head))
        if self.head is not None and self.name not in HEAD_PROPOSERS:
            raise ValueError(f"ProposerSpec.head is a head directory for the head proposers "
                             f"({', '.join(HEAD_PROPOSERS)}), not for {self.name!r}")
        if self.lookup_first and self.name not in LOOKUP_PROPOSERS:
            raise ValueError(f"ProposerSpec.lookup_first adds prompt lookup to a head proposer "
                             f"({', '.join(HEAD_PROPOSERS)}) or to lookahead, not to {self.name!r}")
        if self.lookahead is not None:
            if self.name != "lookahead":
                raise ValueError(f"ProposerSpec.lookahead holds lookahead's sizes, for name='lookahead', not "
                                 f"{self.name!r}")
            if isinstance(self.lookahead, dict):  # a spec read back from JSON (dataclasses.asdict)
                object.__setattr__(self, "lookahead", LookaheadSettings(**self.lookahead))
            elif isinstance(self.lookahead, (tuple, list)):
                if len(self.lookahead) not in (3, 4, 5, 6):
                    raise ValueError(f"ProposerSpec.lookahead: give (window, ngram, candidates[, recycled[, carry"
                                     f"[, prior]]]), got {self.lookahead!r}")
                object.__setattr__(self, "lookahead", LookaheadSettings(*self.lookahead))
            elif not isinstance(self.lookahead, LookaheadSettings):
                raise TypeError(f"ProposerSpec.lookahead must be LookaheadSettings or (window, ngram, candidates"
                                f"[, recycled[, carry[, prior]]]), got {self.lookahead!r}")
        if self.name == "draft" and not self.draft_model:
            raise ValueError("ProposerSpec.draft_model is required for name='draft' (a smaller model with the "
                             "target's tokenizer: an HF id, directory, .gguf or alias)")
        if self.draft_model is not None and self.name != "draft":
            raise ValueError(f"ProposerSpec.draft_model is for name='draft', not {self.name!r}")

    @property
    def label(self) -> str:
        """A short display name: the proposer's name, ``+ngram`` when lookup goes first (``eagle3+ngram``)."""
        return self.name + ("+ngram" if self.lookup_first else "")
