"""A rolling acceptance rate per proposer, and a warning when it stays far below what the head measured in training.

A trained head drafts well for the model and the kind of text it was trained on. When the rate at which the target
accepts its first draft token falls far below the acc@1 measured in training, the head is drifting from its target
(another fine-tune, another quantisation) or is being used on data it was not trained for; decoding stays lossless,
but the speedup is gone. ``AcceptanceMonitor`` keeps the depth-1 acceptance of the last ``window`` drafting passes
and warns (``AcceptanceWarning``, once per monitor) when, after ``min_passes`` drafting passes, that rate is below
``tolerance`` times the expected rate.

Every decoder holds one: ``SpeculativeDecoder.monitor`` (updated at each verification, so while iterating
``stream_tokens`` the rate after each chunk is ``decoder.monitor.rate``) and ``BatchedDecoder.monitor`` (over all
rows; each row's own acceptance is its ``GenerationResult.depth_acceptance[0]``). ``report()`` is the summary the
benchmark records. The expected rate is the proposer's ``trained_acceptance`` (``trained_acceptance(proposer)``):
acc@1 from the head config's ``tree.acceptance`` for heads loaded by ``runtime.proposers.load_head_proposer``, None
for proposers without a training measurement (plain decoding, prompt lookup, a draft model), which are tracked but
never warned about.
"""

from __future__ import annotations

import warnings
from collections import deque


class AcceptanceWarning(UserWarning):
    """A proposer's rolling acceptance stays far below the acceptance its head measured in training."""


def trained_acceptance(proposer) -> float | None:
    """The depth-1 acceptance ``proposer`` measured in training, or None.

    A head loaded from its directory carries it as ``trained_acceptance``; a head with prompt lookup first
    (``LookupFirstProposer``) is held to its head's rate (lookup drafts only where the text repeats, where it is
    usually accepted at least as often); any other proposer has none."""
    if proposer is None:
        return None
    value = getattr(proposer, "trained_acceptance", None)
    if value is None and hasattr(proposer, "lookup") and hasattr(proposer, "head"):
        value = trained_acceptance(proposer.head)
    return None if value is None else float(value)


class AcceptanceMonitor:
    """Depth-1 acceptance over the last ``window`` drafting passes.

    expected: the rate the proposer should reach (acc@1 measured in training); None: nothing to compare with, so
    no warning. tolerance: warn when the rolling rate is below ``tolerance * expected``. min_passes: drafting passes
    observed before any warning (a rate over a few passes says little). name: the proposer, for the message.
    """

    def __init__(self, expected: float | None, window: int = 128, tolerance: float = 0.5, min_passes: int = 128,
                 name: str = "proposer"):
        if window < 1:
            raise ValueError(f"window must be >= 1 (drafting passes), got {window}")
        if not 0 < tolerance <= 1:
            raise ValueError(f"tolerance must be in (0, 1] (a fraction of the expected rate), got {tolerance}")
        if min_passes < 1:
            raise ValueError(f"min_passes must be >= 1, got {min_passes}")
        if expected is not None and not 0 < expected <= 1:
            raise ValueError(f"expected must be an acceptance rate in (0, 1] or None, got {expected}")
        self.expected = expected
        self.window = window
        self.tolerance = tolerance
        self.min_passes = min_passes
        self.name = name
        self.recent: deque[bool] = deque(maxlen=window)
        self.passes = 0  # drafting passes observed
        self.accepted = 0  # of those, passes that accepted their depth-1 draft
        self.warned = False

    def observe(self, drafted_depth: int, accepted_depth: int) -> None:
        """One verification: the tree reached ``drafted_depth`` (0: nothing drafted, not counted); the accepted
        path holds ``accepted_depth`` drafted tokens."""
        if drafted_depth < 1:
            return
        hit = accepted_depth >= 1
        self.recent.append(hit)
        self.passes += 1
        self.accepted += hit
        if self.drifting and not self.warned:
            self.warned = True
            warnings.warn(self.message(), AcceptanceWarning, stacklevel=2)

    @property
    def rate(self) -> float | None:
        """Depth-1 acceptance over the last ``window`` drafting passes (None before the first)."""
        return sum(self.recent) / len(self.recent) if self.recent else None

    @property
    def overall_rate(self) -> float | None:
        return self.accepted / self.passes if self.passes else None

    @property
    def threshold(self) -> float | None:
        return None if self.expected is None else self.tolerance * self.expected

    @property
    def drifting(self) -> bool:
        """The rolling rate, over at least ``min_passes`` drafting passes, is below ``tolerance * expected``."""
        return (self.expected is not None and self.passes >= self.min_passes
                and self.rate is not None and self.rate < self.threshold)

    def message(self) -> str:
        return (f"{self.name}: the target accepted the first draft token in {self.rate:.0%} of the last "
                f"{len(self.recent)} drafting passes, far below the {self.expected:.0%} its head measured in training "
                f"(warning below {self.tolerance:g}x that). The head may be drifting from its target (another "
                f"fine-tune or quantisation of it) or be used on text it was not trained for; output is unchanged, "
                f"the speedup is lost.")

    def report(self) -> dict:
        """``expected``, ``rate`` (rolling), ``window_passes`` (passes in the window), ``passes`` and
        ``overall_rate`` (every drafting pass so far), ``drifting``, ``warned``."""
        def rounded(value):
            return None if value is None else round(value, 4)

        return {"expected": self.expected, "rate": rounded(self.rate), "window_passes": len(self.recent),
                "passes": self.passes, "overall_rate": rounded(self.overall_rate), "drifting": self.drifting,
                "warned": self.warned}

    def reset(self) -> None:
        """Forget every pass (and re-arm the warning)."""
        self.recent.clear()
        self.passes = self.accepted = 0
        self.warned = False


def monitor_for(proposer, **settings) -> AcceptanceMonitor:
    """An AcceptanceMonitor for ``proposer``, expecting its ``trained_acceptance``."""
    return AcceptanceMonitor(trained_acceptance(proposer), name=getattr(proposer, "name", "proposer"), **settings)
