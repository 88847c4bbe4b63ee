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

A proposer that drafts with several drafters (a head with prompt lookup first) is judged by its head's passes alone
(``judged_drafter``): lookup drafts where the text repeats and the head where it does not, so a window of both
measures the mix of text, not the head, and a window of the head's passes is the one its training figure speaks
for. Every drafter's own rate is in the report.
"""

from __future__ import annotations

import warnings
from collections import deque

from runtime.proposers.base import Proposer


class AcceptanceWarning(UserWarning):
    """A proposer's rolling acceptance stays far below the acceptance its head measured in training."""


def trained_acceptance(proposer: Proposer | None) -> float | None:
    """The depth-1 acceptance ``proposer`` measured in training (``Proposer.trained_acceptance``), or None.

    A head loaded from its directory carries it; a head with prompt lookup first (``LookupFirstProposer``) is held
    to its head's rate, on the head's own passes (``judged_drafter``); any other proposer has none."""
    value = None if proposer is None else proposer.trained_acceptance
    return None if value is None else float(value)


def judged_drafter(proposer) -> str | None:
    """The drafter (a name of ``Proposer.drafters``) whose passes are held to ``trained_acceptance``: the head of a
    proposer that drafts with several, None (every pass) for a proposer that is its own drafter."""
    named = proposer.drafters if proposer is not None else {}
    if len(named) < 2:
        return None
    trained = [name for name, drafter in named.items() if trained_acceptance(drafter) is not None]
    return trained[0] if len(trained) == 1 else None


class AcceptanceMonitor:
    """Depth-1 acceptance over the last ``window`` drafting passes.

    expected: the rate the proposer should reach (acc@1 measured in training); None: nothing to compare with, so
    no warning. tolerance: warn when the rolling rate is below ``tolerance * expected``. min_passes: drafting passes
    observed before any warning (a rate over a few passes says little). name: the proposer, for the message.
    drafter: the drafter whose passes the rolling rate holds (``judged_drafter``; None: every pass); other drafters'
    passes are counted apart (``report()["by_drafter"]``).
    """

    def __init__(self, expected: float | None, window: int = 128, tolerance: float = 0.5, min_passes: int = 128,
                 name: str = "proposer", drafter: str | None = None):
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
        self.drafter = drafter
        self.recent: deque[bool] = deque(maxlen=window)
        self.passes = 0  # drafting passes observed (of the judged drafter)
        self.accepted = 0  # of those, passes that accepted their depth-1 draft
        self.by_drafter: dict[str, list[int]] = {}  # drafter -> [drafting passes, of those accepted at depth 1]
        self.warned = False

    def observe(self, drafted_depth: int, accepted_depth: int, drafter: str | None = None) -> None:
        """One verification: the tree reached ``drafted_depth`` (0: nothing drafted, not counted); the accepted
        path holds ``accepted_depth`` drafted tokens; ``drafter`` drafted it (None: not known, taken as judged)."""
        if drafted_depth < 1:
            return
        hit = accepted_depth >= 1
        if drafter is not None:
            counts = self.by_drafter.setdefault(drafter, [0, 0])
            counts[0] += 1
            counts[1] += hit
            if self.drafter is not None and drafter != self.drafter:
                return
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
        whose = self.name if self.drafter is None else f"{self.name} ({self.drafter}'s passes)"
        return (f"{whose}: the target accepted the first draft token in {self.rate:.0%} of the last "
                f"{len(self.recent)} drafting passes, far below the {self.expected:.0%} its head measured in training "
                f"(warning below {self.tolerance:g}x that). The head may be drifting from its target (another "
                f"fine-tune or quantisation of it) or be used on text it was not trained for; output is unchanged, "
                f"the speedup is lost.")

    def report(self) -> dict:
        """``expected``, ``rate`` (rolling), ``window_passes`` (passes in the window), ``passes`` and
        ``overall_rate`` (every drafting pass so far), ``drifting``, ``warned``; for a proposer with several drafters
        also ``drafter`` (the judged one) and ``by_drafter``: {drafter: {"passes", "overall_rate"}}."""
        def rounded(value):
            return None if value is None else round(value, 4)

        report = {"expected": self.expected, "rate": rounded(self.rate), "window_passes": len(self.recent),
                  "passes": self.passes, "overall_rate": rounded(self.overall_rate), "drifting": self.drifting,
                  "warned": self.warned}
        if self.drafter is not None:
            report["drafter"] = self.drafter
            report["by_drafter"] = {name: {"passes": passes, "overall_rate": rounded(accepted / passes)}
                                    for name, (passes, accepted) in sorted(self.by_drafter.items())}
        return report

    def reset(self) -> None:
        """Forget every pass (and re-arm the warning)."""
        self.recent.clear()
        self.passes = self.accepted = 0
        self.by_drafter.clear()
        self.warned = False


def monitor_for(proposer, **settings) -> AcceptanceMonitor:
    """An AcceptanceMonitor for ``proposer``, expecting its ``trained_acceptance`` of its ``judged_drafter``."""
    return AcceptanceMonitor(trained_acceptance(proposer), name=proposer.name,
                             drafter=judged_drafter(proposer), **settings)
