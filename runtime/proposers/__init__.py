"""Proposer construction from a typed ``ProposerSpec``, shared by the scripts and tests.

A head type's proposer is its entry in ``HEAD_PROPOSER_CLASSES`` (a ``Proposer`` with a ``from_head`` constructor);
``heads.registry.HEAD_TYPES`` names the head types, and tests check that every one has a proposer.
"""

from __future__ import annotations

from heads.formats import detect_layout, load_any_head
from heads.io import MERGED_ADAPTERS_KEY, adapter_fingerprint, target_adapters
from heads.shipped import find_shipped, shipped_heads
from runtime.proposers.base import NoProposer, Proposer, ProposeInput
from runtime.proposers.dflash import DFlashProposer
from runtime.proposers.draft_model import DraftModelProposer
from runtime.proposers.eagle import EagleProposer
from runtime.proposers.lookahead import LookaheadProposer
from runtime.proposers.lookup_first import LookupFirstProposer
from runtime.proposers.medusa import MedusaProposer
from runtime.proposers.ngram import NgramProposer
from runtime.proposers.spec import HEAD_PROPOSERS, LOOKUP_PROPOSERS, PROPOSER_NAMES, LookaheadSettings, ProposerSpec
from runtime.target.attention import use_tree_attention
from runtime.target.decode_layers import use_decode_layers
from runtime.target.model import load_target, parse_dtype, same_model_identities

# head type -> the proposer that drafts with such a head
HEAD_PROPOSER_CLASSES: dict[str, type[Proposer]] = {"eagle": EagleProposer, "eagle3": EagleProposer,
                                                    "medusa": MedusaProposer, "dflash": DFlashProposer}


class NoShippedHead(ValueError):
    """A head proposer was asked for without a head directory, and no head of its type ships for the target."""

    def __init__(self, head_type: str, identity: str, shipped: str):
        self.head_type, self.identity, self.shipped = head_type, identity, shipped
        super().__init__(f"no {head_type} head ships for target {identity!r} (shipped: {shipped}): pass "
                         f"ProposerSpec.head, a trained {head_type} head directory. Train one with "
                         f"`python training/train.py head={head_type} target.name=...`.")


def load_head_proposer(head_type: str, head_dir: str, target) -> Proposer:
    """A trained head from ``head_dir`` (the OUTPUT_DIR/head of a training run, an export of ours, or a published
    head in a layout ``heads.formats.load_any_head`` reads), checked against the target.

    Tree defaults come from the head's config: ``depth`` and ``top_k`` for EAGLE, optionally ``sizes`` (the verified
    tree size measured best by scripts/tune_tree.py in each target dtype, ``{"float32": 4, "bfloat16": 6}``; older
    heads: one ``size`` measured in ``size_dtype``) for both head types, and the acceptance measured during training
    (``acceptance``, acc@1..K), which calibrates Medusa's static tree (unless the config holds ``rank_paths``, the
    tree measured by scripts/eval_head.py) and otherwise sizes the verified tree; its
    acc@1 is the proposer's ``trained_acceptance`` (None when the config has none), which ``runtime.engine.monitor``
    holds the rolling acceptance to.
    A Medusa-2 head (trained with LoRA adapters on its target) loads only for a target with those adapters merged
    in (``scripts/export.py --merged-target``).
    """
    detected = detect_layout(head_dir)  # reads config.json, and checks the whole of ours
    if detected.head_type != head_type:
        raise ValueError(f"{head_dir} holds a {detected.head_type} head, not {head_type} ({detected.layout} layout); "
                         f"load it as {detected.head_type}")
    if detected.layout == "headstart":
        check_target_adapters(head_dir, detected.config, target)
    head, config = load_any_head(head_dir, target.model, identity=target.identity, tokenizer=target.tokenizer,
                                 device=target.device, dtype=target.dtype, detected=detected)
    # drafting runs a few rows at a time, like the target's decode steps; the head is ours
    use_tree_attention(use_decode_layers(head))
    tree = config.get("tree", {})
    proposer = HEAD_PROPOSER_CLASSES[head_type].from_head(head, target, tree, measured_tree_size(tree, head_dir,
                                                                                                   target))
    accuracy = tree.get("acceptance")
    # acc@1 measured in training, what runtime.engine.monitor holds the rolling acceptance to (None: not measured)
    proposer.trained_acceptance = float(accuracy[0]) if accuracy else None
    return proposer


def measured_tree_size(tree: dict, head_dir: str, target) -> int | None:
    """The head config's measured tree size for the target's dtype, else None.

    A tree size is measured in one dtype; another dtype has another cost curve (scripts/bench_verify_pass.py), so
    a dtype without a measured size gets the cost model's. ``tree.sizes`` maps dtype names to sizes; heads saved
    by earlier versions hold one ``size`` (or ``tokens``) measured in ``size_dtype`` (``tokens_dtype``).
    """
    if "sizes" in tree:
        try:
            sizes = {parse_dtype(name): size for name, size in tree["sizes"].items()}
        except ValueError as error:
            raise ValueError(f"{head_dir}/config.json: tree.sizes: {error}") from None
        return sizes.get(target.dtype)
    name = tree.get("size_dtype", tree.get("tokens_dtype", "float32"))
    try:
        measured_dtype = parse_dtype(name)
    except ValueError as error:
        raise ValueError(f"{head_dir}/config.json: tree.size_dtype: {error}") from None
    return tree.get("size", tree.get("tokens")) if measured_dtype == target.dtype else None


def check_target_adapters(head_dir: str, config: dict, target) -> None:
    """Refuse a Medusa-2 head for a target without its LoRA adapters merged in.

    Such a head was trained together with adapters on the target: with the plain target, decoding would give the
    base model's output instead of the fine-tuned one's, and the heads would draft for a model they were not trained
    on. A target written by ``scripts/export.py --merged-target`` records the adapters it holds in its config.
    """
    adapters = target_adapters(head_dir, config)
    if adapters is None:
        return
    merged = getattr(target.config, MERGED_ADAPTERS_KEY, None)
    if merged == adapter_fingerprint(adapters):
        return
    held = " (it holds other adapters)" if merged else ""
    raise ValueError(f"the {config['head_type']} head at {head_dir} was trained with LoRA adapters on its target "
                     f"(Medusa-2: {adapters}), and target {target.identity!r} does not have them merged in{held}. "
                     f"Write the merged target once with `python scripts/export.py {head_dir} EXPORT_DIR "
                     f"--merged-target MERGED_DIR`, then load MERGED_DIR as the target (in the scripts: --target "
                     f"MERGED_DIR --head {head_dir}).")


def default_head(head_type: str, target) -> str:
    """The shipped ``head_type`` head for ``target`` (heads/shipped), or ``NoShippedHead`` (a ValueError)."""
    found = find_shipped(head_type, same_model_identities(target.identity))
    if found is None:
        shipped = ", ".join(f"{t} for {i}" for _, t, i in shipped_heads()) or "none"
        raise NoShippedHead(head_type, target.identity, shipped)
    return str(found)


def build_proposer(spec: ProposerSpec, target, dtype=None) -> Proposer:
    """The proposer ``spec`` describes, for ``target``. ``dtype``: the draft model's dtype (``spec.name ==
    'draft'``; default: the target's)."""
    if not isinstance(spec, ProposerSpec):
        raise TypeError(f"build_proposer takes a ProposerSpec, not {type(spec).__name__} ({spec!r})")
    if spec.lookup_first:
        head = ProposerSpec(spec.name, head=spec.head, lookahead=spec.lookahead)
        return LookupFirstProposer(build_proposer(head, target, dtype), NgramProposer())
    if spec.name == "lookahead":
        return LookaheadProposer.for_target(target, spec.lookahead)
    if spec.name == "none":
        return NoProposer()
    if spec.name == "ngram":
        return NgramProposer()
    if spec.name == "draft":
        draft = load_target(spec.draft_model, dtype=dtype or target.dtype, device=target.device)
        return DraftModelProposer(draft, target)
    return load_head_proposer(spec.name, spec.head or default_head(spec.name, target), target)


__all__ = ["NoProposer", "Proposer", "ProposeInput", "DraftModelProposer", "NgramProposer", "ProposerSpec",
           "HEAD_PROPOSER_CLASSES",
           "LookaheadSettings", "build_proposer", "PROPOSER_NAMES", "HEAD_PROPOSERS", "LOOKUP_PROPOSERS",
           "NoShippedHead", "load_head_proposer", "default_head", "check_target_adapters"]
