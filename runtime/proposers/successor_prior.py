"""The target's context-free successors of every token: a prior for lookahead's recycled successor table.

Recycling keeps what the target computed after each token it has verified (``runtime.proposers.lookahead``), so a
token the generation has not verified yet has nothing to draft from, and a token seen in one context only has one
context's guess. The target itself can say what usually follows a token: put the token where a reply starts, after a
short chat turn, and read the target's top-k next tokens there. That is one row per vocabulary entry, all of them
sharing one cached prefix, so the whole vocabulary is a few hundred passes of a few hundred rows (a star-shaped
tree: each row sees the prefix and itself), measured once per target and cached like the cost curve.

The prior is a draft source only: whatever it holds, the verification's exact acceptance keeps the output the
target's. Once cached it is a function of the target and the prefix, so drafts from it are deterministic; whether a
target has one at all depends on its tokenizer and on how long measuring would take here (``successor_prior``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tqdm import tqdm

from heads.layouts import save_tensors
from runtime.target.assets import cache_dir, write_json_atomically
from runtime.engine.prompts import encode_prompt
from runtime.target.model import Target
from runtime.engine.tree import verification_mask

# What the prefix asks: any short request works about as well (the successors of a token barely depend on it).
PRIOR_REQUEST = "Write an answer."
# Part of the cache key: raised whenever what the prior holds changes (the prefix's rule, the rule for reading it).
PRIOR_VERSION = 1
PRIOR_ROWS = 256  # tokens a pass: the pass is compute-bound well before this on a CPU
# The most a first use may spend measuring: a large target on a CPU (billions of weights, a vocabulary of 100k+)
# would take hours, so lookahead goes without the prior there, saying so, rather than stall its first generation.
PRIOR_BUDGET_SECONDS = 600.0
# A fixed date for chat templates that print one (Llama 3's "Today Date"): otherwise the prefix, and with it the
# cache key, would change every day.
PRIOR_DATE = "1 Jan 2025"


def prior_prefix(tokenizer, config=None) -> torch.Tensor:
    """[P] long, P >= 1: the context a prior's tokens follow: the chat template's opening of a reply to a short
    request where the tokenizer has a template (dated ``PRIOR_DATE`` where it prints a date), else the tokenizer's
    or the model ``config``'s beginning-of-sequence token, else their end-of-sequence token (a document boundary)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return encode_prompt(tokenizer, PRIOR_REQUEST, date_string=PRIOR_DATE)
    for name in ("bos_token_id", "eos_token_id"):
        for source in (tokenizer, config):
            token_id = getattr(source, name, None) if source is not None else None
            if isinstance(token_id, (list, tuple)):
                token_id = token_id[0] if token_id else None
            if token_id is not None:
                return torch.tensor([int(token_id)], dtype=torch.long)
    raise ValueError("neither the tokenizer nor the model's config has a chat template, a beginning- or an "
                     "end-of-sequence token to start a successor prior from; build lookahead without the prior "
                     "(lookahead:W,N,G,R,C,0, or LookaheadSettings(prior=False))")


# A prior's entries read as Python tuples are kept for reuse up to this many tokens (then dropped all at once): a
# generation touches a few thousand tokens, and a server left running would otherwise hold the whole vocabulary's.
PRIOR_MEMO_CAPACITY = 1 << 13
# Each token's likeliest successors kept (lookahead's recycled successors keep as many per tree node).
SUCCESSORS = 8


class SuccessorPrior:
    """The target's top-k next tokens after each vocabulary token out of context (``successor_prior``):
    tokens [V, K] long and probs [V, K] float, likeliest first. Entries are read as tuples when first asked for and
    kept for reuse, up to ``PRIOR_MEMO_CAPACITY`` of them."""

    def __init__(self, tokens: torch.Tensor, probs: torch.Tensor):
        if tokens.ndim != 2 or tokens.shape != probs.shape:
            raise ValueError(f"SuccessorPrior takes tokens and probs of one shape [V, K], got {tuple(tokens.shape)} "
                             f"and {tuple(probs.shape)}")
        self.tokens, self.probs = tokens, probs
        self._entries: dict[int, tuple[tuple[int, float], ...]] = {}

    def entry(self, token: int) -> tuple[tuple[int, float], ...]:
        """(successor, probability) pairs after ``token``, likeliest first; () for a token outside the vocabulary."""
        found = self._entries.get(token)
        if found is None:
            inside = 0 <= token < self.tokens.shape[0]
            found = tuple(zip(self.tokens[token].tolist(), self.probs[token].tolist())) if inside else ()
            if len(self._entries) >= PRIOR_MEMO_CAPACITY:
                self._entries.clear()
            self._entries[token] = found
        return found

    @property
    def vocab_size(self) -> int:
        return self.tokens.shape[0]



class PriorTooSlow(Exception):
    """Measuring a prior would take longer than the budget: ``projected_seconds``, from the first pass."""

    def __init__(self, projected_seconds: float):
        super().__init__(f"measuring the successor prior would take about {projected_seconds / 60:.0f} min")
        self.projected_seconds = projected_seconds


@torch.inference_mode()
def measure_successor_prior(target: Target, prefix: torch.Tensor, rows: int = PRIOR_ROWS,
                            keep: int = SUCCESSORS, progress: bool = True,
                            budget_seconds: float | None = None) -> SuccessorPrior:
    """The target's ``keep`` likeliest next tokens after each vocabulary token placed right after ``prefix`` [P],
    with their probabilities: ``rows`` tokens a pass over the prefix's cached K/V, each row seeing the prefix and
    itself at position P. Tokens are the model's input ids (the LM head may have more rows: those are never drafted
    from). Raises ``PriorTooSlow`` when the first pass shows that all of them would take more than
    ``budget_seconds``."""
    vocab = min(target.vocab_size, target.model.get_input_embeddings().num_embeddings)
    length, device = prefix.numel(), target.device
    keep = min(keep, vocab)
    cache = target.new_cache(1, length + rows)
    target.forward(prefix[None].to(device), torch.arange(length, device=device)[None], cache, None,
                   logits_from=length - 1)
    cache.commit(length)
    tokens = torch.empty(vocab, keep, dtype=torch.long)
    probs = torch.empty(vocab, keep, dtype=torch.float32)
    starts = range(0, vocab, rows)
    started = time.perf_counter()
    for start in tqdm(starts, desc="successor prior", unit="pass", disable=not progress):
        batch = torch.arange(start, min(start + rows, vocab), device=device)
        count = batch.numel()
        mask = verification_mask(torch.eye(count, dtype=torch.bool, device=device), length)
        positions = torch.full((1, count), length, dtype=torch.long, device=device)
        # the pass's K/V stay uncommitted: the next pass writes over them
        logits = target.forward(batch[None], positions, cache, mask).logits[0]
        chance, top = logits.float().softmax(-1).topk(keep, dim=-1)
        tokens[start:start + count], probs[start:start + count] = top.cpu(), chance.cpu()
        if start == 0 and budget_seconds is not None:
            projected = (time.perf_counter() - started) * len(starts)
            if projected > budget_seconds:
                raise PriorTooSlow(projected)
    return SuccessorPrior(tokens, probs)


def _prior_path(target: Target, prefix: torch.Tensor):
    key = (f"{target.identity}|{target.vocab_size}|{target.dtype}|{target.device.type}|{prefix.tolist()}|"
           f"k{SUCCESSORS}|v{PRIOR_VERSION}")
    return cache_dir() / "successor_priors" / f"{hashlib.sha1(key.encode()).hexdigest()[:12]}.safetensors"


def _verdict_path(prior_path):
    """Where the verdict that measuring the prior at ``prior_path`` takes too long on this machine is kept: a faster
    machine sharing the cache measures it."""
    from runtime.target.machine import machine_key

    digest = hashlib.sha1(f"{prior_path.stem}|{machine_key(torch.device('cpu'))}".encode()).hexdigest()[:12]
    return prior_path.parent / f"{digest}.too_slow.json"


def _read_verdict(path) -> float | None:
    """The projected seconds of an earlier verdict at ``path``, or None where there is none (or it does not read)."""
    try:
        return float(json.loads(path.read_text())["projected_seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _read_prior(path, vocab_size: int) -> SuccessorPrior | None:
    """The prior saved at ``path`` if it is whole and fits a vocabulary of ``vocab_size`` (two models under one
    identity, such as "in-memory", share a key), else None."""
    try:
        saved = load_file(str(path))
        tokens, probs = saved["tokens"].long(), saved["probs"]
    except (OSError, KeyError, SafetensorError):
        return None
    fits = tokens.ndim == 2 and tokens.shape == probs.shape and tokens.shape[0] <= vocab_size
    return SuccessorPrior(tokens, probs) if fits and int(tokens.max()) < vocab_size else None


def successor_prior(target: Target, prefix: torch.Tensor | None = None,
                    budget_seconds: float = PRIOR_BUDGET_SECONDS) -> SuccessorPrior | None:
    """The cached prior for this target after ``prefix`` [P] (default: ``prior_prefix`` of its tokenizer and config),
    measured on first use (one pass per ``PRIOR_ROWS`` vocabulary tokens); None, said on stderr, where the target
    gives no prefix or measuring it would take more than ``budget_seconds`` (on a CPU that verdict is cached for
    the machine, so later processes skip the probing pass; a larger budget measures again)."""
    if prefix is None:
        try:
            prefix = prior_prefix(target.tokenizer, target.config)
        except ValueError as error:
            print(f"[headstart] {error}; lookahead drafts without a successor prior", file=sys.stderr)
            return None
    path = _prior_path(target, prefix)
    if path.is_file():
        saved = _read_prior(path, target.vocab_size)
        if saved is not None:
            return saved
    verdict = _verdict_path(path) if target.device.type == "cpu" else None
    projected = _read_verdict(verdict) if verdict is not None else None
    if projected is not None and projected > budget_seconds:
        print(f"[headstart] the successor prior would take about {projected / 60:.0f} min on this machine (measured "
              f"earlier; more than {budget_seconds / 60:.0f}); lookahead drafts without it", file=sys.stderr)
        return None
    print("[headstart] measuring the target's successor prior for lookahead (once) ...", file=sys.stderr)
    try:
        prior = measure_successor_prior(target, prefix, budget_seconds=budget_seconds)
    except PriorTooSlow as slow:
        print(f"[headstart] the successor prior would take about {slow.projected_seconds / 60:.0f} min on this "
              f"device (more than {budget_seconds / 60:.0f}); lookahead drafts without it", file=sys.stderr)
        if verdict is not None:  # later processes on this machine skip the probing pass
            write_json_atomically(verdict, {"projected_seconds": slow.projected_seconds})
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")  # processes measuring at once each write their own
    save_tensors({"tokens": prior.tokens.to(torch.int32).contiguous(), "probs": prior.probs.contiguous()}, partial)
    os.replace(partial, path)
    return prior
