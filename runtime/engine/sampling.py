"""Logits processing shared by the target and every draft: one function, so both sides always agree."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k / top_p as in Hugging Face (None = off)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k and top-p.

    top-p keeps the smallest set of most likely tokens whose mass reaches top_p (at least one token).
    """
    scores = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < scores.shape[-1]:
        kth = scores.topk(params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop_sorted = (cumulative - sorted_scores.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


def new_generator(seed: int | None) -> torch.Generator:
    """The random stream of one generation: a CPU generator whatever the model's device, so a seed gives the same
    draws on CPU and GPU and every draw goes through the same code (``sample`` and the acceptance tests)."""
    generator = torch.Generator(device="cpu")
    if seed is None:  # a non-deterministic seed for this generator alone (torch.seed() reseeds the caller's too)
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from [V] probabilities (on any device) with a CPU ``generator`` (``new_generator``)."""
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator))


CHUNK = 128  # columns a chunk in ``chunked_argmax`` and lookahead's ``chunked_topk``


def chunk_columns(rows: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """rows [R, V] -> [R, ceil(V / chunk), chunk]: each row's columns in chunks, the last one filled up with -inf
    (which no maximum picks). A view where V is a multiple of ``chunk``, else a padded copy.

    The reductions over vocabulary-wide rows that PyTorch's CPU kernels do not vectorise (argmax, top-k) run fast as
    a vectorised maximum per chunk followed by the same reduction over a few chunks (``scripts/bench_decode_ops.py``
    times the argmax)."""
    count, width = rows.shape
    chunks = -(-width // chunk)
    if chunks * chunk != width:
        rows = torch.nn.functional.pad(rows, (0, chunks * chunk - width), value=float("-inf"))
    return rows.view(count, chunks, chunk)


def chunked_argmax(values: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """values [..., V] -> [...] long: the first index of each row's largest value, what ``torch.argmax`` gives
    (a NaN counts as the largest, as there).

    The first occurrence lies in the first chunk whose maximum is the row's, at that chunk's first largest column:
    a maximum per chunk, an argmax over the chunk maxima, and one over a chunk (``chunk_columns``)."""
    width = values.shape[-1]
    if width <= chunk:
        return values.argmax(-1)
    blocks = chunk_columns(values.reshape(-1, width), chunk)
    first = blocks.amax(-1).argmax(-1)  # [R]: the first chunk holding the row's maximum
    inside = blocks[torch.arange(blocks.shape[0], device=values.device), first].argmax(-1)
    return (first * chunk + inside).view(values.shape[:-1])


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The target's greedy token at each row of logits [..., V] -> [...] long: the first index of the largest logit,
    as ``torch.argmax`` (and HF's greedy decoding, which takes it over fp32 logits) picks it.

    On CPUs PyTorch's argmax over bf16 is not vectorised: the logits are converted to fp32 first (exact), and the
    argmax taken by chunk maxima (``chunked_argmax``), several times faster at a verification pass's shapes
    (``scripts/bench_decode_ops.py`` measures them). Elsewhere the argmax runs on the logits as they are."""
    if logits.device.type != "cpu":
        return logits.argmax(-1)
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return chunked_argmax(logits)
