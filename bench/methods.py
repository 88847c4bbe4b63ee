"""What a benchmark compares, as typed values keyed by the name each is reported under.

``HFBaseline``: a transformers ``generate`` baseline on the target; ``DecoderMethod``: our ``SpeculativeDecoder``
with a ``ProposerSpec``; ``PeerMethod`` (bench/peers.py): another project's decoder; ``LlamaCppMethod``
(bench/llamacpp.py): llama.cpp's server on the same weights. Each checks what it can on its
own; ``check_methods`` and ``check_batch_methods`` check what needs the target or the kind of run. A results file
records every method (``method_to_json``) so that a later rescoring knows what ran (``method_from_json``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from bench.llamacpp import LlamaCppMethod
from bench.peers import PeerMethod
from heads.shipped import find_shipped
from runtime.proposers.spec import ProposerSpec
from runtime.target.model import parse_dtype, same_model_identities

HF_METHODS = ("hf-greedy", "hf-pld", "hf-assisted", "hf-early-exit")
BATCH_HF_METHODS = ("hf-greedy",)  # transformers' prompt lookup and assisted generation run one prompt at a time
BASELINE = "hf-greedy"  # the name of the method every ratio refers to and every output is compared with


def dtype_name(dtype: str | torch.dtype) -> str:
    """``float32`` / ``bfloat16`` / ``float16`` for any spelling ``runtime.target.model.parse_dtype`` accepts."""
    return str(parse_dtype(dtype)).removeprefix("torch.")


@dataclass(frozen=True)
class HFBaseline:
    """A transformers ``generate`` baseline on the target.

    ``method``: ``hf-greedy`` (plain decoding), ``hf-pld`` (prompt lookup decoding), ``hf-assisted`` (assisted
    generation drafting with ``draft_model``, a smaller model with the target's tokenizer) or ``hf-early-exit``
    (assisted generation drafting with the target's first ``early_exit_layers`` layers under its final norm and LM
    head; None: a quarter of them). ``dtype``: the dtype of the target copy it runs on (None: the target's own), e.g.
    ``bfloat16``: on CPUs where one bf16 token is faster than one fp32 token, that is the baseline to beat.
    """

    method: str
    dtype: str | None = None
    early_exit_layers: int | None = None
    draft_model: str | None = None

    def __post_init__(self):
        if self.method not in HF_METHODS:
            raise ValueError(f"HFBaseline.method: unknown HF baseline {self.method!r}; choose one of "
                             f"{', '.join(HF_METHODS)}")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.early_exit_layers is not None:
            if self.method != "hf-early-exit":
                raise ValueError(f"HFBaseline.early_exit_layers is for method='hf-early-exit', not {self.method!r}")
            if self.early_exit_layers < 1:
                raise ValueError(f"HFBaseline.early_exit_layers must be >= 1, got {self.early_exit_layers}")
        if self.method == "hf-assisted" and not self.draft_model:
            raise ValueError("HFBaseline.draft_model is required for method='hf-assisted' (a smaller model with the "
                             "target's tokenizer)")
        if self.draft_model is not None and self.method != "hf-assisted":
            raise ValueError(f"HFBaseline.draft_model is for method='hf-assisted', not {self.method!r}")


@dataclass(frozen=True)
class DecoderMethod:
    """Our decoder with the proposer ``proposer``; ``tree_size`` fixes its verified tree size (None: the
    benchmark's ``tree_size``, else the cost model's choice)."""

    proposer: ProposerSpec
    tree_size: int | None = None

    def __post_init__(self):
        if self.tree_size is not None and self.tree_size < 1:
            raise ValueError(f"DecoderMethod.tree_size must be >= 1, got {self.tree_size}")


Method = HFBaseline | DecoderMethod | PeerMethod | LlamaCppMethod


def method_to_json(method: Method) -> dict:
    if isinstance(method, HFBaseline):
        return {"hf": asdict(method)}
    if isinstance(method, PeerMethod):
        return {"peer": asdict(method)}
    if isinstance(method, LlamaCppMethod):
        return {"llamacpp": asdict(method)}
    return {"proposer": asdict(method.proposer), "tree_size": method.tree_size}


def method_from_json(data: dict) -> Method:
    if "hf" in data:
        return HFBaseline(**data["hf"])
    if "peer" in data:
        return PeerMethod(**data["peer"])
    if "llamacpp" in data:
        return LlamaCppMethod(**data["llamacpp"])
    return DecoderMethod(ProposerSpec(**data["proposer"]), data.get("tree_size"))


def with_baseline(methods: dict[str, Method]) -> dict[str, Method]:
    """``methods`` with HF greedy (``BASELINE``) first when they lack it: every ratio and comparison refers to it."""
    return methods if BASELINE in methods else {BASELINE: HFBaseline("hf-greedy"), **methods}


def early_exit_layers(requested: int | None, num_layers: int) -> int:
    """The draft depth of ``hf-early-exit``: ``requested``, checked against the target's layer count, or a quarter of
    the layers."""
    if requested is None:
        return max(1, num_layers // 4)
    if not 1 <= requested < num_layers:
        raise ValueError(f"HFBaseline.early_exit_layers must be a layer count from 1 to {num_layers - 1} (the target "
                         f"has {num_layers} layers), got {requested}")
    return requested


def check_methods(methods: dict[str, Method], num_layers: int) -> None:
    """What can only be checked against the target: early-exit depths, the baseline in the target's dtype."""
    for method in methods.values():
        if isinstance(method, HFBaseline) and method.method == "hf-early-exit":
            early_exit_layers(method.early_exit_layers, num_layers)
    baseline = methods.get(BASELINE)
    if not (isinstance(baseline, HFBaseline) and baseline.method == "hf-greedy"):
        raise ValueError(f"methods[{BASELINE!r}] must be HFBaseline('hf-greedy'), got {baseline!r}")


def check_greedy_peers(methods: dict[str, Method], temperature: float) -> None:
    """The peer decoders decode greedily: a sampling run with one of them is refused before any work."""
    if temperature > 0 and any(isinstance(method, (PeerMethod, LlamaCppMethod)) for method in methods.values()):
        raise ValueError("the peer decoders (economize-*, flashspec-ngram, llamacpp*) run greedy here: use "
                         "temperature 0")


def default_methods(target_name: str, draft_model: str | None = None) -> dict[str, Method]:
    """HF greedy, HF prompt lookup, our plain decoding and prompt lookup, the heads shipped for this target (each alone
    and with prompt lookup first), and our draft-model decoding and HF assisted generation when a draft model is
    given."""
    identities = same_model_identities(target_name)
    shipped = [kind for kind in ("eagle3", "dflash", "eagle", "medusa") if find_shipped(kind, identities) is not None]
    specs = [ProposerSpec("none"), ProposerSpec("ngram")] + [ProposerSpec(kind) for kind in shipped] + [
        ProposerSpec(kind, lookup_first=True) for kind in shipped]
    methods: dict[str, Method] = {"hf-greedy": HFBaseline("hf-greedy"), "hf-pld": HFBaseline("hf-pld")}
    methods.update({spec.label: DecoderMethod(spec) for spec in specs})
    if draft_model:
        methods["draft"] = DecoderMethod(ProposerSpec("draft", draft_model=draft_model))
        methods["hf-assisted"] = HFBaseline("hf-assisted", draft_model=draft_model)
    return methods


# --- throughput at a batch size ---


def check_batch_methods(methods: dict[str, Method]) -> None:
    """What ``run_batch_benchmark`` can run: HF greedy (in any dtype), our decoders and llama.cpp's (its server with
    as many slots as rows)."""
    for name, method in methods.items():
        if isinstance(method, PeerMethod):
            raise ValueError(f"{name}: the peer decoders run one prompt at a time; benchmark them without a batch size")
        if isinstance(method, HFBaseline) and method.method not in BATCH_HF_METHODS:
            raise ValueError(f"{name}: {method.method} runs one prompt at a time in transformers; at a batch size "
                             f"the HF baseline is hf-greedy (in any dtype)")


def batch_methods(methods: dict[str, Method]) -> dict[str, Method]:
    """``methods`` without the HF baselines that do not batch (``default_methods`` for ``run_batch_benchmark``)."""
    return {name: method for name, method in methods.items()
            if not (isinstance(method, HFBaseline) and method.method not in BATCH_HF_METHODS)}


def check_batch_sizes(batch_sizes) -> list[int]:
    """The batch sizes to run, ascending, batch 1 always among them (every row's reference and every method's own
    batch-1 run); a ValueError for a size below 1."""
    sizes = sorted(set(batch_sizes) | {1})
    if sizes[0] < 1:
        raise ValueError(f"batch sizes must be >= 1, got {sorted(set(batch_sizes))}")
    return sizes
