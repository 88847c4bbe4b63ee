"""The target's context-free successors of every token: a prior for lookahead's recycled successor table.

Recycling keeps what the target computed after each token it has verified (``runtime.proposers.lookahead``), so a
token the generation has not verified yet has nothing to draft from, and a token seen in one context only has one
context's guess. The target itself can say what usually follows a token: put the token where a reply starts, after a
short chat turn, and read the target's top-k next tokens there. That is one row per vocabulary entry, all of them
sharing one cached prefix, so the whole vocabulary is a few hundred passes of a few hundred rows (a star-shaped
tree: each row sees the prefix and itself), measured once per target and cached like the cost curve.

The prior is a draft source only: whatever it holds, the verification's exact acceptance keeps the output the
target's, and it depends on nothing but the target, so it keeps a generation deterministic.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from runtime.assets import cache_dir
from runtime.proposers.lookahead import SUCCESSORS, SuccessorPrior
from runtime.prompts import encode_prompt
from runtime.target import Target
from runtime.tree import verification_mask

# What the prefix asks: any short request works about as well (the successors of a token barely depend on it).
PRIOR_REQUEST = "Write an answer."
# Part of the cache key: raised whenever what the prior holds changes (the prefix, k, the rule for reading it).
PRIOR_VERSION = 1
PRIOR_ROWS = 256  # tokens a pass: the pass is compute-bound well before this on a CPU
# The most a first use may spend measuring: a large target on a CPU (billions of weights, a vocabulary of 100k+)
# would take hours, so lookahead goes without the prior there, saying so, rather than stall its first generation.
PRIOR_BUDGET_SECONDS = 600.0


def prior_prefix(tokenizer, config=None) -> torch.Tensor:
    """[P] long, P >= 1: the context a prior's tokens follow: the chat template's opening of a reply to a short
    request where the tokenizer has a template, else its beginning-of-sequence token, else its end-of-sequence
    token (a document boundary); without a tokenizer, the model ``config``'s."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return encode_prompt(tokenizer, PRIOR_REQUEST)
    source = tokenizer if tokenizer is not None else config
    for name in ("bos_token_id", "eos_token_id"):
        token_id = getattr(source, name, None)
        if isinstance(token_id, (list, tuple)):
            token_id = token_id[0] if token_id else None
        if token_id is not None:
            return torch.tensor([int(token_id)], dtype=torch.long)
    raise ValueError("neither the tokenizer nor the model's config has a chat template, a beginning- or an "
                     "end-of-sequence token to start a successor prior from; build lookahead with "
                     "LookaheadSettings(prior=False)")


@torch.inference_mode()
def measure_successor_prior(target: Target, prefix: torch.Tensor, rows: int = PRIOR_ROWS,
                            keep: int = SUCCESSORS, progress: bool = True,
                            budget_seconds: float | None = None) -> SuccessorPrior | None:
    """The target's ``keep`` likeliest next tokens after each vocabulary token placed right after ``prefix`` [P],
    with their probabilities: ``rows`` tokens a pass over the prefix's cached K/V, each row seeing the prefix and
    itself at position P. None when the first pass shows that all of them would take more than
    ``budget_seconds``."""
    vocab, length, device = target.vocab_size, prefix.numel(), target.device
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
                print(f"[headstart] the successor prior would take about {projected / 60:.0f} min on this device "
                      f"(more than {budget_seconds / 60:.0f}); lookahead drafts without it", file=sys.stderr)
                return None
    return SuccessorPrior(tokens, probs)


def _prior_path(target: Target, prefix: torch.Tensor):
    key = f"{target.identity}|{target.dtype}|{target.device.type}|{prefix.tolist()}|v{PRIOR_VERSION}"
    return cache_dir() / "successor_priors" / f"{hashlib.sha1(key.encode()).hexdigest()[:12]}.safetensors"


def successor_prior(target: Target, prefix: torch.Tensor | None = None,
                    budget_seconds: float = PRIOR_BUDGET_SECONDS) -> SuccessorPrior | None:
    """The cached prior for this target after ``prefix`` [P] (default: ``prior_prefix`` of its tokenizer and config),
    measured on first use (one pass per ``PRIOR_ROWS`` vocabulary tokens); None where measuring it would take more
    than ``budget_seconds``."""
    if prefix is None:
        prefix = prior_prefix(target.tokenizer, target.config)
    path = _prior_path(target, prefix)
    if path.is_file():
        saved = load_file(str(path))
        return SuccessorPrior(saved["tokens"].long(), saved["probs"])
    print("[headstart] measuring the target's successor prior for lookahead (once) ...", file=sys.stderr)
    prior = measure_successor_prior(target, prefix, budget_seconds=budget_seconds)
    if prior is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    save_file({"tokens": prior.tokens.to(torch.int32).contiguous(), "probs": prior.probs.contiguous()},
              str(partial))
    os.replace(partial, path)
    return prior
