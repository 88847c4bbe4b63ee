"""What a benchmark reports: each method's measurements (``MethodStats``), summarised into rates and ratios per
method (``summarize``; per batch size, ``summarize_batch``), as markdown tables, accept-length histograms, and the
summary a results file keeps of each output (``output_summary``)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from bench.divergence import first_divergence
from bench.methods import BASELINE, HFBaseline, Method


@dataclass
class MethodStats:
    """One method's measurements over the prompts run so far (at one batch size)."""

    tokens: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0
    forwards: int = 0
    identical: int = 0
    prompts: int = 0
    per_prompt_tps: list[float] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    depth_attempts: list[int] = field(default_factory=list)
    depth_accepts: list[int] = field(default_factory=list)

    def add_output(self, tokens: list[int], details=None) -> None:
        """One output (a prompt's, or a row's of a batch) and, for a speculative decoder, its ``details`` (a
        GenerationResult or PeerDetails: what it drafted and what the target accepted)."""
        self.tokens += len(tokens)
        self.prompts += 1
        if details is not None:
            self.draft_seconds += details.draft_seconds
            self.accept_lengths.extend(details.accept_lengths)
            self.add_depths(details.depth_attempts, details.depth_accepts)

    def add_run(self, tokens: list[int], seconds: float, forwards: int, details=None) -> None:
        """One prompt decoded alone: its output, and the seconds and target forwards it took."""
        self.add_output(tokens, details)
        self.seconds += seconds
        self.forwards += forwards
        self.per_prompt_tps.append(len(tokens) / seconds)

    def add_depths(self, attempts: list[int], accepts: list[int]) -> None:
        for depth, (tried, taken) in enumerate(zip(attempts, accepts)):
            if depth == len(self.depth_attempts):
                self.depth_attempts.append(0)
                self.depth_accepts.append(0)
            self.depth_attempts[depth] += tried
            self.depth_accepts[depth] += taken

    def depth_acceptance(self) -> list[float]:
        """The fraction of drafted tokens accepted at each depth of the tree."""
        return [taken / tried for taken, tried in zip(self.depth_accepts, self.depth_attempts)]


def summarize(stats: dict[str, MethodStats], methods: dict[str, Method], decoders: dict, temperature: float) -> dict:
    """Per-method rates and ratios over the prompts run so far.

    ``speedup`` is over ``hf-greedy``; when HF greedy also ran in another dtype (``HFBaseline('hf-greedy',
    'bfloat16')``), every row also gets ``speedup_vs_fastest_hf_greedy``, over whichever HF greedy run was faster.
    """
    rate = {name: s.tokens / s.seconds for name, s in stats.items()}
    hf = {name for name, method in methods.items() if isinstance(method, HFBaseline)}
    greedy = [name for name in hf if methods[name].method == "hf-greedy"]
    base, fastest = rate[BASELINE], max(rate[name] for name in greedy)
    summary = {}
    for name, s in stats.items():
        tps = rate[name]
        sizing = decoders[name].tree_size_report() if name in decoders else {}
        summary[name] = {
            "tokens_per_s": tps,
            # tokens per pass after the prefill, as the decoders count it: the prefill pass and its token are left
            # out of HF's counts too (in HF's assisted modes that pass also verifies drafts); llama.cpp gives its
            # counts, not each pass's tokens
            "tau": (s.tokens - s.prompts) / max(s.forwards - s.prompts, 1) if name in hf or not s.accept_lengths else
            statistics.mean(s.accept_lengths),
            "speedup": tps / base,
            **({"speedup_vs_fastest_hf_greedy": tps / fastest} if len(greedy) > 1 else {}),
            "identical": s.identical / s.prompts if temperature == 0 else None,
            "per_prompt_tokens_per_s": {"min": min(s.per_prompt_tps), "median": statistics.median(s.per_prompt_tps),
                                        "max": max(s.per_prompt_tps)},
            "tokens": s.tokens, "seconds": s.seconds, "draft_share": s.draft_seconds / s.seconds,
            "tree_size": sizing.get("reason"), "tree_sizes_used": sizing.get("sizes"),
            "depth_acceptance": s.depth_acceptance(),
            "acceptance_monitor": decoders[name].monitor.report() if name in decoders else None,
        }
    return summary


def summarize_batch(stats: dict[int, dict[str, MethodStats]], methods: dict[str, Method],
                    decoders: dict[int, dict]) -> dict:
    """{batch size (str): {method: row}} for every batch size run, batch 1 first. A row: total tokens/s
    (``tokens_per_s``), the speedup over HF greedy at the same batch size (``speedup``), what the batch gains over the
    method's own batch-1 run (``batch_gain``), tau, the fraction of rows token-identical to HF greedy decoding each
    prompt alone (``identical``), the share of time spent drafting, the tree size and why, the acceptance per depth
    and the acceptance monitor's report. With HF greedy in several dtypes, ``speedup_vs_fastest_hf_greedy`` is over
    the fastest of them at that batch size."""
    greedy = [name for name, method in methods.items() if isinstance(method, HFBaseline)]
    summary = {}
    rate1 = {name: s.tokens / s.seconds for name, s in stats[1].items()}
    for size, by_method in stats.items():
        rate = {name: s.tokens / s.seconds for name, s in by_method.items()}
        fastest = max(rate[name] for name in greedy)
        rows = {}
        for name in methods:
            s, decoder = by_method[name], decoders[size].get(name)
            rows[name] = {
                "tokens_per_s": rate[name], "speedup": rate[name] / rate[BASELINE],
                **({"speedup_vs_fastest_hf_greedy": rate[name] / fastest} if len(greedy) > 1 else {}),
                "batch_gain": rate[name] / rate1[name],
                "tau": statistics.mean(s.accept_lengths) if s.accept_lengths else 1.0,
                "identical": s.identical / s.prompts, "tokens": s.tokens, "seconds": s.seconds,
                "draft_share": s.draft_seconds / s.seconds,
                "tree_size": decoder.tree_size_report()["reason"] if decoder is not None else None,
                "depth_acceptance": s.depth_acceptance(),
                "acceptance_monitor": decoder.monitor.report() if decoder is not None else None,
            }
        summary[str(size)] = rows
    return summary


def markdown_table(summary: dict) -> str:
    """The batch-1 benchmark's summary (``summarize``) as a markdown table, a line per method."""
    fastest = any("speedup_vs_fastest_hf_greedy" in row for row in summary.values())
    lines = ["| method | tokens/s | tau | speedup vs HF generate | " + ("vs fastest HF greedy | " if fastest else "")
             + "identical to HF greedy |", "|---|---:|---:|---:|" + ("---:|" if fastest else "") + "---:|"]
    for name, row in summary.items():
        identical = "n/a" if row["identical"] is None else f"{row['identical']:.0%}"
        versus_fastest = f"{row['speedup_vs_fastest_hf_greedy']:.2f}x | " if fastest else ""
        lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {row['tau']:.2f} | {row['speedup']:.2f}x | "
                     f"{versus_fastest}{identical} |")
    return "\n".join(lines)


def batch_markdown_table(summary: dict) -> str:
    """The batch benchmark's summary (``summarize_batch``) as a markdown table, a line per method and batch size."""
    lines = ["| method | batch | tokens/s | vs HF greedy | vs own batch 1 | tau | identical |", "|---|" + "---:|" * 6]
    for size, rows in summary.items():
        for name, row in rows.items():
            lines.append(f"| {name} | {size} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | "
                         f"{row['batch_gain']:.2f}x | {row['tau']:.2f} | {row['identical']:.0%} |")
    return "\n".join(lines)


def plot_histograms(stats: dict[str, MethodStats], path: Path) -> None:
    """Per-method histograms of the tokens each target forward emitted, side by side in one PNG (none when no
    method drafted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = {name: s for name, s in stats.items() if s.accept_lengths}
    if not shown:
        return
    fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 3), squeeze=False)
    for axis, (name, s) in zip(axes[0], shown.items()):
        top = max(s.accept_lengths)
        axis.hist(s.accept_lengths, bins=range(1, top + 2), align="left", rwidth=0.8)
        axis.set_title(f"{name} (tau {statistics.mean(s.accept_lengths):.2f})")
        axis.set_xlabel("tokens per target forward")
        axis.set_ylabel("passes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def output_summary(tokens: list[int], reference: list[int]) -> dict:
    """What a results file keeps of an output: its length, whether it equals ``reference`` (HF greedy decoding the
    prompt alone) and where it first differs (None: it does not)."""
    return {"tokens": len(tokens), "identical": tokens == reference,
            "first_difference": first_divergence(tokens, reference)}
