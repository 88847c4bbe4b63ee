"""The HF baselines: transformers' ``generate`` on the target, one prompt at a time or on left-padded batches.

They run on the target's own transformers model (``target.model``, a stock model outside ``Target.forward``) when
they run in the target's dtype; another dtype loads another copy of the target, once (``HFModels``). Every call
pins generation settings to plain decoding (``plain_generation_settings``), as this runtime decodes, and counts the
target's full forwards (``ForwardCounter``) for tau.
"""

from __future__ import annotations

import time

import torch

from bench.methods import HFBaseline, early_exit_layers
from runtime.engine.prompts import left_padded
from runtime.target.machine import synchronized_seconds
from runtime.target.model import load_target, parse_dtype

PLD_TOKENS = 10  # prompt_lookup_num_tokens of hf-pld
# generate() fills every setting a call leaves unset from the model's own generation_config; these would change
# the logits it picks from (a repetition penalty applies even to greedy decoding), so the baselines pin them to
# plain decoding, as this runtime decodes
PLAIN_DECODING = dict(repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0,
                      encoder_no_repeat_ngram_size=0, min_new_tokens=0, suppress_tokens=[],
                      begin_suppress_tokens=[], typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)
# settings with no neutral value to pin: a target whose generation_config holds one is refused
UNPINNABLE = ("bad_words_ids", "forced_bos_token_id", "forced_eos_token_id", "sequence_bias",
              "exponential_decay_length_penalty", "min_p", "guidance_scale", "watermarking_config")


class ForwardCounter:
    """Counts full forward calls of an HF model (to get tau for HF's own methods). An early-exit draft runs through
    the same model with ``config.num_hidden_layers`` lowered for the call; those passes are drafts, not counted."""

    def __init__(self, model):
        self.count = 0
        self.layers = model.config.num_hidden_layers
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += module.config.num_hidden_layers == self.layers

    def remove(self) -> None:
        self.handle.remove()


class HFModels:
    """The stock transformers models the HF baselines run on, one per dtype ({dtype: model}): the target's own model
    in the target's dtype, a copy of the target (loaded from ``target_name``) in any other; and the draft models of
    ``hf-assisted``, each loaded once."""

    def __init__(self, target, target_name: str):
        self.target_name = target_name
        self.device = target.device
        self.dtype = target.dtype
        self.models = {target.dtype: target.model}
        self.counters: dict[torch.dtype, ForwardCounter] = {}
        self.assistants: dict[tuple[str, torch.dtype], object] = {}

    def model(self, dtype: str | torch.dtype | None = None):
        dtype = self.dtype if dtype is None else parse_dtype(dtype)
        if dtype not in self.models:
            self.models[dtype] = load_target(self.target_name, dtype=dtype, device=self.device,
                                             attn_implementation="sdpa", quiet=True).model
        return self.models[dtype]

    def counter(self, dtype: str | torch.dtype | None = None) -> ForwardCounter:
        key = self.dtype if dtype is None else parse_dtype(dtype)
        if key not in self.counters:
            self.counters[key] = ForwardCounter(self.model(key))
        return self.counters[key]

    def assistant(self, name: str, dtype: str | torch.dtype | None = None):
        key = (name, self.dtype if dtype is None else parse_dtype(dtype))
        if key not in self.assistants:
            self.assistants[key] = load_target(name, dtype=key[1], device=self.device, attn_implementation="sdpa",
                                               quiet=True).model
        return self.assistants[key]

    def close(self) -> None:
        """Removes the forward counters' hooks (the target's own model stays as it was)."""
        for counter in self.counters.values():
            counter.remove()
        self.counters.clear()


def plain_generation_settings(model) -> dict:
    """``generate`` keyword arguments that make HF decode plainly whatever ``model.generation_config`` holds; a
    setting that cannot be pinned is a clear error before any work."""
    config = getattr(model, "generation_config", None)
    held = [name for name in UNPINNABLE if getattr(config, name, None) not in (None, 1.0)] if config else []
    if held:
        raise ValueError(f"the target's generation_config sets {', '.join(held)}, which HF generate would apply and "
                         f"this runtime does not: its baselines would not be plain decoding; clear them in "
                         f"generation_config.json (the runtime ignores them either way)")
    return dict(PLAIN_DECODING)


def run_hf(model, counter, ids, baseline: HFBaseline, max_new_tokens, eos, temperature=0.0, seed=0, assistant=None):
    """One ``generate`` call of ``baseline`` on ``model``: (new tokens, seconds, full target forwards, None)."""
    extra = plain_generation_settings(model)
    if baseline.method == "hf-pld":
        extra["prompt_lookup_num_tokens"] = PLD_TOKENS
    if baseline.method == "hf-assisted":
        extra["assistant_model"] = assistant
    if baseline.method == "hf-early-exit":
        extra["assistant_early_exit"] = early_exit_layers(baseline.early_exit_layers,
                                                          model.config.num_hidden_layers)
    if temperature > 0:  # plain temperature sampling, as our decoder does (no top-k/top-p from generation_config)
        extra.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        torch.manual_seed(seed)
    else:
        extra.update(do_sample=False)
    before = counter.count
    started = time.perf_counter()
    out = model.generate(ids[None].to(model.device), max_new_tokens=max_new_tokens, eos_token_id=eos,
                         pad_token_id=eos[0], **extra)
    seconds = time.perf_counter() - started
    return out[0, ids.numel():].tolist(), seconds, counter.count - before, None


def until_stop(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first stop token (what a row of a batched ``generate`` really produced;
    the rest is padding)."""
    for index, token in enumerate(tokens):
        if token in eos:
            return tokens[: index + 1]
    return tokens


def run_hf_batch(model, rows: list[torch.Tensor], max_new_tokens: int, eos: list[int], pad: int
                 ) -> tuple[list[list[int]], float]:
    """HF greedy ``generate`` on ``rows`` (token ids, each [P]) as one left-padded batch: (each row's new tokens up
    to its first stop token, seconds)."""
    input_ids, attention_mask = left_padded(rows, pad)
    started = time.perf_counter()
    out = model.generate(input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad,
                         **plain_generation_settings(model))
    seconds = synchronized_seconds(model.device, started)
    stops = set(eos)
    return [until_stop(row, stops) for row in out[:, input_ids.shape[1]:].tolist()], seconds


def run_hf_batches(model, rows: list[torch.Tensor], max_new_tokens: int, eos: list[int], pad: int,
                   batch_size: int) -> tuple[list[list[int]], float]:
    """``run_hf_batch`` on ``rows``, ``batch_size`` at a time (HF has no continuous batching: each batch runs until
    its longest row ends): (each row's new tokens, the seconds of all batches)."""
    outputs, seconds = [], 0.0
    for start in range(0, len(rows), batch_size):
        tokens, took = run_hf_batch(model, rows[start:start + batch_size], max_new_tokens, eos, pad)
        outputs.extend(tokens)
        seconds += took
    return outputs, seconds
