"""Proposer construction by name, shared by the scripts and tests."""

from __future__ import annotations

from runtime.proposers.base import NoProposer, Proposer, ProposeInput
from runtime.proposers.draft_model import DraftModelProposer
from runtime.proposers.ngram import NgramProposer

HEAD_PROPOSERS = ("medusa", "eagle", "eagle3")
LOOKUP_FIRST = "+ngram"  # "eagle3+ngram": prompt lookup where it finds a match, the head elsewhere
PROPOSER_NAMES = ("none", "ngram", "draft", *HEAD_PROPOSERS, *(kind + LOOKUP_FIRST for kind in HEAD_PROPOSERS))


def load_head_proposer(kind: str, head_dir: str, target) -> Proposer:
    """A trained head from ``head_dir`` (the OUTPUT_DIR/head of a training run), checked against the target.

    Tree defaults come from the head's config: ``depth`` and ``top_k`` for EAGLE, optionally ``tokens`` (the verified
    tree size measured best by scripts/tune_tree.py, used for targets in the dtype it was measured in, ``tokens_dtype``)
    for both kinds, and the acceptance measured during training
    (``acceptance``, acc@1..K), which calibrates Medusa's static tree and otherwise sizes the verified tree.
    """
    from heads.common import use_decode_kernels
    from heads.io import load_head, read_head_config
    from runtime.target import parse_dtype

    head = load_head(head_dir, target.model, identity=target.identity, tokenizer=target.tokenizer,
                     device=target.device, dtype=target.dtype)
    if head.head_type != kind:
        raise ValueError(f"{head_dir} holds a {head.head_type} head, not {kind}; use --proposer {head.head_type}")
    use_decode_kernels(head)  # drafting runs a few rows at a time, like the target's decode steps
    tree = read_head_config(head_dir).get("tree", {})
    accuracy = tree.get("acceptance")
    # A tree size is measured in one dtype; another dtype has another cost curve (bf16 verification of 4 tokens costs
    # 2.2x one token on an AVX2 CPU, fp32 1.0x), so there the cost model sizes the tree.
    tree_tokens = tree.get("tokens") if parse_dtype(tree.get("tokens_dtype", "float32")) == target.dtype else None
    if kind == "medusa":
        from runtime.proposers.medusa import MedusaProposer

        return MedusaProposer(head, head_accuracy=accuracy[: head.num_heads] if accuracy else None,
                              tree_tokens=tree_tokens)
    from runtime.proposers.eagle import EagleProposer

    return EagleProposer(head, target, depth=int(tree.get("depth", 6)), top_k=int(tree.get("top_k", 8)),
                         expected_acceptance=accuracy[0] if accuracy else 0.6, tree_tokens=tree_tokens)


def default_head(kind: str, target) -> str:
    """The shipped ``kind`` head for ``target`` (heads/shipped), or a ValueError saying what to pass instead."""
    from heads.shipped import find_shipped, shipped_heads
    from runtime.target import same_model_identities

    found = find_shipped(kind, same_model_identities(target.identity))
    if found is None:
        shipped = ", ".join(f"{t} for {i}" for _, t, i in shipped_heads()) or "none"
        raise ValueError(f"--proposer {kind} needs --head DIR (a trained {kind} head directory): no {kind} head ships "
                         f"for target {target.identity!r} (shipped: {shipped}). Train one with "
                         f"`python training/train.py head={kind} target.name=...`.")
    return str(found)


def build_proposer(name: str, target, draft_model: str | None = None, dtype=None,
                   head: str | None = None) -> Proposer:
    """``none``, ``ngram``, ``draft`` (needs ``draft_model``: an HF id, dir, .gguf or alias), or a head proposer
    ``medusa`` / ``eagle`` / ``eagle3`` (``head``: a head directory; default: the head shipped for the target, see
    heads/shipped), optionally with ``+ngram`` (prompt lookup drafts where it finds a match, the head elsewhere).
    ``kind:DIR`` is accepted too."""
    if ":" in name and head is None:
        name, head = name.split(":", 1)
    if name.endswith(LOOKUP_FIRST) and name[: -len(LOOKUP_FIRST)] in HEAD_PROPOSERS:
        from runtime.proposers.lookup_first import LookupFirstProposer

        return LookupFirstProposer(build_proposer(name[: -len(LOOKUP_FIRST)], target, head=head), NgramProposer())
    if name == "none":
        return NoProposer()
    if name == "ngram":
        return NgramProposer()
    if name == "draft":
        if not draft_model:
            raise ValueError("--proposer draft needs --draft-model (a smaller model with the target's tokenizer)")
        from runtime.target import load_target

        draft = load_target(draft_model, dtype=dtype or target.dtype, device=target.device)
        return DraftModelProposer(draft, target)
    if name in HEAD_PROPOSERS:
        head = head or default_head(name, target)
        return load_head_proposer(name, head, target)
    raise ValueError(f"unknown proposer {name!r}; choose one of {', '.join(PROPOSER_NAMES)}")


__all__ = ["NoProposer", "Proposer", "ProposeInput", "DraftModelProposer", "NgramProposer", "build_proposer",
           "PROPOSER_NAMES", "HEAD_PROPOSERS", "LOOKUP_FIRST", "load_head_proposer", "default_head"]
