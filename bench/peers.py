"""Other speculative decoders as benchmark methods, beside ours on the same prompts and heads (optional extra
``peers``: ``pip install -e ".[peers]"``).

- ``economize-eagle3`` / ``economize-medusa``: economize's chain decoder with one of our heads (the shipped one for
  the target, or ``head``), handed over as an export (EAGLE-3: the vLLM layout, whose top-level layer ids economize
  reads as we index them; Medusa: the FasterDecoding layout) and loaded into a copy of the target's transformers
  model. The same head in our runtime is what our tree search, verification and KV handling add.
- ``flashspec-ngram``: flashspec's engine with its prompt-lookup drafter on a copy of the target.

Peers decode greedily (temperature 0), one prompt at a time. ``PeerDecoder.generate`` returns what the benchmark's
other runners return: (new tokens, seconds, target forwards, details with the tokens emitted per forward).
"""

from __future__ import annotations

import copy
import importlib.util
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from heads.export import export_head
from heads.formats import load_any_head
from runtime.proposers import default_head

# method name -> (package it needs, head type it drafts with or None)
PEER_METHODS = {"economize-eagle3": ("economize", "eagle3"), "economize-medusa": ("economize", "medusa"),
                "flashspec-ngram": ("flashspec", None)}
PEERS_EXTRA = 'pip install -e ".[peers]"'
DEFAULT_TOKENS_PER_CYCLE = {"economize-eagle3": 6, "economize-medusa": 5, "flashspec-ngram": 5}
# head type -> the export layout economize loads it from (why these two: the module's docstring)
ECONOMIZE_LAYOUTS = {"eagle3": "vllm", "medusa": "reference"}


@dataclass(frozen=True)
class PeerMethod:
    """A peer decoder: ``name`` from ``PEER_METHODS``; ``head``: the head directory of an economize method (any
    layout ``heads.formats.load_any_head`` reads; None: the head shipped for the target); ``tokens_per_cycle``: the
    most tokens one target forward can emit (economize's ``cycle_length``, flashspec's ``gamma`` + 1; None: a
    default per method)."""

    name: str
    head: str | None = None
    tokens_per_cycle: int | None = None

    def __post_init__(self):
        if self.name not in PEER_METHODS:
            raise ValueError(f"PeerMethod.name: unknown peer {self.name!r}; choose one of {', '.join(PEER_METHODS)}")
        if self.head is not None and PEER_METHODS[self.name][1] is None:
            raise ValueError(f"PeerMethod.head: {self.name} drafts without a head")
        if self.tokens_per_cycle is not None and self.tokens_per_cycle < 2:
            raise ValueError(f"PeerMethod.tokens_per_cycle must be >= 2 (one drafted token at least), got "
                             f"{self.tokens_per_cycle}")

    @property
    def package(self) -> str:
        return PEER_METHODS[self.name][0]

    @property
    def head_type(self) -> str | None:
        return PEER_METHODS[self.name][1]


def missing_package(name: str) -> str | None:
    """Why peer method ``name`` cannot run here (its package is not installed, with the install command), or None."""
    package = PEER_METHODS[name][0]
    if importlib.util.find_spec(package) is None:
        return f"{name} needs the {package} package, which is not installed; install the peers extra: {PEERS_EXTRA}"
    return None


@dataclass
class PeerDetails:
    """What the benchmark reads of a run besides tokens and time (the fields of our GenerationResult it reads)."""

    accept_lengths: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    depth_attempts: list[int] = field(default_factory=list)
    depth_accepts: list[int] = field(default_factory=list)


class PeerDecoder:
    """A peer method ready to run on ``target`` (a ``runtime.target.model.Target``): ``generate(ids, max_new_tokens,
    eos)``."""

    def __init__(self, method: PeerMethod, target, target_name: str | None = None):
        problem = missing_package(method.name)
        if problem:
            raise ImportError(problem)
        self.method = method
        self.target = target
        self.cycle = method.tokens_per_cycle or DEFAULT_TOKENS_PER_CYCLE[method.name]
        # the peers attach hooks and caches to the model they get: a copy keeps the target as it was
        model = copy.deepcopy(target.model).eval()
        if method.package == "economize":
            self.model = self._economize(model)
        else:
            self.engine = self._flashspec(model, target_name or target.identity)

    def _economize(self, model):
        import economize

        head_dir = self.method.head or default_head(self.method.head_type, self.target)
        head, _ = load_any_head(head_dir, self.target.model, identity=self.target.identity,
                                tokenizer=self.target.tokenizer)
        layout = ECONOMIZE_LAYOUTS[self.method.head_type]
        with tempfile.TemporaryDirectory() as tmp:
            export_head(head.float(), Path(tmp) / layout, fmt=layout, base_model=self.target.identity)
            return economize.load(model, Path(tmp) / layout, check_teacher=False)

    def _flashspec(self, model, name: str):
        from flashspec import FlashSpecConfig, SamplingConfig, SpeculativeEngine
        from flashspec.engine.ngram import NgramDrafter
        from flashspec.engine.verifier import TargetModel

        dtype = str(self.target.dtype).removeprefix("torch.")
        # "auto" with prompt lookup as the only drafter runs it as the one arm (an explicit "bandit" wants as many
        # drafters as its default arm count)
        config = FlashSpecConfig(device=str(self.target.device), dtype=dtype, target_name=name,
                                 drafter_strategy="auto", compile=False,
                                 sampling=SamplingConfig(temperature=0.0, gamma=self.cycle - 1))
        verifier = TargetModel(name, self.target.device, self.target.dtype, model=model)
        return SpeculativeEngine(config, [NgramDrafter()], verifier)

    @torch.inference_mode()
    def generate(self, ids: torch.Tensor, max_new_tokens: int, eos: list[int]):
        """Greedy decoding of one prompt: (new tokens up to and including a stop token, seconds, target forwards,
        PeerDetails)."""
        ids = ids.to(self.target.device)
        started = time.perf_counter()
        if self.method.package == "economize":
            from economize import DecodeConfig

            result = self.model.decode(ids, max_new_tokens, decoding=DecodeConfig(cycle_length=self.cycle),
                                       stop=list(eos))
            seconds = time.perf_counter() - started
            tokens = result.tokens.tolist()
            lengths = [accepted + 1 for _, accepted in result.acceptance]
        else:
            result = self.engine.generate(ids[None], max_new_tokens, eos_token_ids=list(eos))
            seconds = time.perf_counter() - started
            tokens = [token for token in result.output_ids[0].tolist() if token != -1]
            lengths = [step.emitted for step in result.arm_steps]
        tokens = stop_at(tokens, eos)
        return tokens, seconds, max(len(lengths), 1), PeerDetails(accept_lengths=lengths)


def stop_at(tokens: list[int], eos) -> list[int]:
    """``tokens`` up to and including the first stop token, as transformers' greedy decoding returns them."""
    for index, token in enumerate(tokens):
        if token in eos:
            return tokens[: index + 1]
    return tokens
