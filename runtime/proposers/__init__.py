"""Proposer construction from a typed ``ProposerSpec``, shared by the scripts and tests."""

from __future__ import annotations

from runtime.proposers.base import NoProposer, Proposer, ProposeInput
from runtime.proposers.draft_model import DraftModelProposer
from runtime.proposers.ngram import NgramProposer
from runtime.proposers.spec import HEAD_PROPOSERS, PROPOSER_NAMES, ProposerSpec


class NoShippedHead(ValueError):
    """A head proposer was asked for without a head directory, and no head of its type ships for the target."""

    def __init__(self, head_type: str, identity: str, shipped: str):
        self.head_type, self.identity, self.shipped = head_type, identity, shipped
        super().__init__(f"no {head_type} head ships for target {identity!r} (shipped: {shipped}): pass "
                         f"ProposerSpec.head, a trained {head_type} head directory. Train one with "
                         f"`python training/train.py head={head_type} target.name=...`.")


def load_head_proposer(head_type: str, head_dir: str, target) -> Proposer:
    """A trained head from ``head_dir`` (the OUTPUT_DIR/head of a training run), checked against the target.

    Tree defaults come from the head's config: ``depth`` and ``top_k`` for EAGLE, optionally ``size`` (the verified
    tree size measured best by scripts/tune_tree.py, used for targets in the dtype it was measured in, ``size_dtype``)
    for both head types, and the acceptance measured during training
    (``acceptance``, acc@1..K), which calibrates Medusa's static tree and otherwise sizes the verified tree.
    """
    from heads.io import load_head, read_head_config
    from runtime.decode_layers import use_decode_layers
    from runtime.target import parse_dtype

    head = load_head(head_dir, target.model, identity=target.identity, tokenizer=target.tokenizer,
                     device=target.device, dtype=target.dtype)
    if head.head_type != head_type:
        raise ValueError(f"{head_dir} holds a {head.head_type} head, not {head_type} (head_type); load it as "
                         f"{head.head_type}")
    use_decode_layers(head)  # drafting runs a few rows at a time, like the target's decode steps; the head is ours
    tree = read_head_config(head_dir).get("tree", {})
    accuracy = tree.get("acceptance")
    # A tree size is measured in one dtype; another dtype has another cost curve (scripts/bench_verify_pass.py), so
    # there the cost model sizes the tree. Heads saved by earlier versions call the keys tokens and tokens_dtype.
    measured_dtype = parse_dtype(tree.get("size_dtype", tree.get("tokens_dtype", "float32")))
    tree_size = tree.get("size", tree.get("tokens")) if measured_dtype == target.dtype else None
    if head_type == "medusa":
        from runtime.proposers.medusa import MedusaProposer

        return MedusaProposer(head, head_accuracy=accuracy[: head.num_heads] if accuracy else None,
                              tree_size=tree_size)
    from runtime.proposers.eagle import EagleProposer

    return EagleProposer(head, target, depth=int(tree.get("depth", 6)), top_k=int(tree.get("top_k", 8)),
                         expected_acceptance=accuracy[0] if accuracy else 0.6, tree_size=tree_size)


def default_head(head_type: str, target) -> str:
    """The shipped ``head_type`` head for ``target`` (heads/shipped), or ``NoShippedHead`` (a ValueError)."""
    from heads.shipped import find_shipped, shipped_heads
    from runtime.target import same_model_identities

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
        from runtime.proposers.lookup_first import LookupFirstProposer

        head = ProposerSpec(spec.name, head=spec.head)
        return LookupFirstProposer(build_proposer(head, target, dtype), NgramProposer())
    if spec.name == "none":
        return NoProposer()
    if spec.name == "ngram":
        return NgramProposer()
    if spec.name == "draft":
        from runtime.target import load_target

        draft = load_target(spec.draft_model, dtype=dtype or target.dtype, device=target.device)
        return DraftModelProposer(draft, target)
    return load_head_proposer(spec.name, spec.head or default_head(spec.name, target), target)


__all__ = ["NoProposer", "Proposer", "ProposeInput", "DraftModelProposer", "NgramProposer", "ProposerSpec",
           "build_proposer", "PROPOSER_NAMES", "HEAD_PROPOSERS", "NoShippedHead", "load_head_proposer",
           "default_head"]
