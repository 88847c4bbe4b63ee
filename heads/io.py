"""Head checkpoints: a directory of ``config.json`` + ``model.safetensors`` (export for serving engines:
heads/export.py; the layouts, and import of published heads: heads/formats.py).

Our format records the head's architecture and the target it was trained for (identity, model type, hidden size,
vocabulary, layer count, tokenizer fingerprint); loading compares all of it with the target at hand and names every
mismatch. Frozen target weights (embedding, shared LM heads) are never saved: they are attached from the target.
Writes are atomic: a temporary sibling directory is filled and then swapped in with ``os.replace``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path
from collections.abc import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from heads.base import DraftHead
from heads.common import frozen_target_weights, target_signature
from heads.layouts import load_into, new_mode, save_tensors
from heads.registry import HEAD_TYPES, build_head, head_class

FORMAT = "headstart-head"
FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# Set on the config of a target exported with a Medusa-2 head's LoRA adapters merged in: the adapters' fingerprint.
# HF configs keep unknown attributes through save_pretrained / from_pretrained, so it travels with the weights.
MERGED_ADAPTERS_KEY = "headstart_merged_adapters"
# EAGLE heads record the style of their draft layers. Heads saved before the key existed used the target's own
# decoder layer, which is the Llama layer (same weights, same computation) only for these families.
DRAFT_LAYER = "llama"
LLAMA_LAYER_FAMILIES = ("llama", "mistral")
# The integer settings of a head config's tree section (all optional), and what each one sets.
TREE_INTEGERS = {"depth": "the draft depth", "top_k": "the branching per tree level", "size": "the verified tree size",
                 "tokens": "the verified tree size, as older versions call it"}


def checked_head(head: nn.Module) -> DraftHead:
    if not isinstance(head, DraftHead):
        raise TypeError(f"not a draft head: {type(head).__name__}")
    return head


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def atomic_directory(directory: str | os.PathLike, fill: Callable[[Path], None]) -> Path:
    """Fill a temporary sibling of ``directory`` with ``fill(tmp)``, then swap it in.

    A process killed while filling leaves only a ``.tmp-*`` sibling; the previous directory stays intact until the
    new one is complete. (Two renames: Linux cannot atomically replace a non-empty directory.)
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        fill(tmp)
        os.chmod(tmp, new_mode(directory=True))  # mkdtemp makes it private; a head directory is an ordinary output
        if directory.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
            os.replace(directory, old / directory.name)
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


def save_head(head: nn.Module, directory: str | os.PathLike, target: dict, *, tree: dict | None = None,
              training: dict | None = None, write_extra: Callable[[Path], None] | None = None) -> Path:
    """Save ``head`` to ``directory`` atomically.

    target: ``heads.common.target_signature(...)`` of the target it was trained for; tree: default tree settings for
    the runtime; training: free-form metadata (step, data, ...); write_extra(tmp_dir): extra files (LoRA adapters).
    """
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "head_type": checked_head(head).head_type,
        "head_config": asdict(head.config),
        **({"draft_layer": DRAFT_LAYER} if head.has_draft_layers else {}),
        "target": target,
        "tree": tree or {},
        "training": training or {},
    }
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in head.state_dict().items()}

    def fill(tmp: Path) -> None:
        save_tensors(state, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        if write_extra is not None:
            write_extra(tmp)
        _write_json(tmp / CONFIG_NAME, config)  # last: a directory with config.json is complete

    return atomic_directory(directory, fill)


def read_head_config(directory: str | os.PathLike) -> dict:
    """The config.json of a head directory, checked: a ValueError names the file and the key of every mistake that
    would otherwise surface later as a KeyError, a TypeError or a head that drafts nothing."""
    directory = Path(directory)
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a head directory (no {CONFIG_NAME}); pass the directory written "
                                f"by training (OUTPUT_DIR/head)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); restore it from the training run's head "
                         f"directory") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        found = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise ValueError(f"{path} is not a headstart head config (format={found!r}); exported serving formats "
                         f"cannot be loaded back")
    if config.get("head_type") not in HEAD_TYPES:
        raise ValueError(f"{path}: unknown head_type {config.get('head_type')!r}; known: {', '.join(HEAD_TYPES)}")
    _check_sections(config, path)
    _check_tree(config.get("tree", {}), path)
    return config


def _check_sections(config: dict, path: Path) -> None:
    """The sections loading reads: head_config and target (required), tree and training (optional) as objects."""
    for key in ("head_config", "target"):
        if not isinstance(config.get(key), dict):
            found = "missing" if key not in config else f"a {type(config[key]).__name__}, not an object"
            raise ValueError(f"{path}: {key} is {found}; a head directory written by training has it (restore the "
                             f"file, or save the head again with heads.io.save_head)")
    for key in ("tree", "training"):
        if not isinstance(config.get(key, {}), dict):
            raise ValueError(f"{path}: {key} must be an object, got {type(config[key]).__name__}; fix it in the file "
                             f"or delete it")
    try:  # the architecture, as load_head will build it: unknown keys or values of the wrong type
        head_class(config["head_type"]).config_from_dict(config["head_config"])
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: head_config does not describe a head of type {config['head_type']} ({error}); "
                         f"fix the key in the file, or save the head again") from None
    lora = config.get("training", {}).get("target_lora")
    if lora is not None and not (isinstance(lora, str) and lora):
        raise ValueError(f"{path}: training.target_lora must name the adapter directory inside the head directory "
                         f"(or be null), got {lora!r}")


def _check_tree(tree: dict, path: Path) -> None:
    """The runtime's tree defaults: positive integers, a dtype name, and acceptance rates in [0, 1]."""
    for key, meaning in TREE_INTEGERS.items():
        value = tree.get(key)
        if key in tree and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{path}: tree.{key} must be a positive integer ({meaning}), got {value!r}; fix it in "
                             f"the file, or delete it for the runtime's default")
    for key in ("size_dtype", "tokens_dtype"):
        if key in tree and not isinstance(tree[key], str):
            raise ValueError(f"{path}: tree.{key} must be a dtype name such as 'float32', got {tree[key]!r}")
    sizes = tree.get("sizes")
    if sizes is not None and not (isinstance(sizes, dict) and all(
            isinstance(name, str) and isinstance(size, int) and not isinstance(size, bool) and size >= 1
            for name, size in sizes.items())):
        raise ValueError(f"{path}: tree.sizes must map a target dtype name to the verified tree size measured best in "
                         f"it (e.g. {{\"float32\": 4, \"bfloat16\": 6}}), got {sizes!r}; fix it in the file, or "
                         f"delete it for the runtime's cost model")
    paths = tree.get("rank_paths")
    if paths is not None and not (isinstance(paths, list) and all(
            isinstance(ranks, list) and ranks and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                                                       for r in ranks) for ranks in paths)):
        raise ValueError(f"{path}: tree.rank_paths must be a list of rank paths (lists of ranks >= 0, e.g. [[0], [1], "
                         f"[0, 0]]) as scripts/eval_head.py measures them, got {str(paths)[:80]}; fix it in the file, "
                         f"or delete it for the tree calibrated from tree.acceptance")
    rates = tree.get("acceptance")
    if rates is not None and not (isinstance(rates, list) and all(
            isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 <= rate <= 1 for rate in rates)):
        raise ValueError(f"{path}: tree.acceptance must be a list of acceptance rates in [0, 1] (acc@1, acc@2, ...), "
                         f"got {rates!r}; fix it in the file, or delete it")


def target_adapters(directory: str | os.PathLike, config: dict) -> Path | None:
    """The LoRA adapters a Medusa-2 head was trained with on its target (``training.target_lora``, a directory
    inside the head directory), or None for a head trained on the frozen target."""
    name = config.get("training", {}).get("target_lora")
    if not name:
        return None
    adapters = Path(directory) / name
    if not adapters.is_dir():
        raise FileNotFoundError(f"{Path(directory) / CONFIG_NAME} names target LoRA adapters in {adapters}, which is "
                                f"missing; copy the whole head directory, adapters included")
    return adapters


def adapter_fingerprint(adapters: str | os.PathLike) -> str:
    """A short hash of an adapter directory's weight files: which adapters a merged target has in it."""
    adapters = Path(adapters)
    digest = hashlib.sha256()
    for path in sorted(p for p in adapters.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".bin")):
        digest.update(path.relative_to(adapters).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def check_target(saved: dict, actual: dict, where: str, head_type: str, feature_layers: list[int] = ()) -> None:
    """Raise ValueError naming every way the target differs from the one the head was trained for."""
    trained_for = saved.get("identity") or "(unnamed)"
    problems = []
    for key, label in (("model_type", "model type"), ("hidden_size", "hidden size"), ("vocab_size", "vocabulary size"),
                       ("num_hidden_layers", "number of layers")):
        if saved.get(key) is not None and actual.get(key) is not None and saved[key] != actual[key]:
            problems.append(f"{label} {saved[key]}, this target has {actual[key]}")
    if saved.get("tokenizer") and actual.get("tokenizer") and saved["tokenizer"] != actual["tokenizer"]:
        problems.append(f"tokenizer fingerprint {saved['tokenizer']}, this target's tokenizer has "
                        f"{actual['tokenizer']}")
    bad_layers = [i for i in feature_layers if not 0 <= i < actual["num_hidden_layers"]]
    if bad_layers:
        problems.append(f"feature layers {bad_layers} outside this target's 0..{actual['num_hidden_layers'] - 1}")
    if problems:
        raise ValueError(f"the {head_type} head at {where} was trained for target {trained_for} with "
                         + "; ".join(problems) + ". Load a head trained for this target, or train one with "
                         f"target.name={actual.get('identity') or '<this target>'}.")
    if saved.get("identity") and actual.get("identity") and saved["identity"] != actual["identity"]:
        warnings.warn(f"head at {where} was trained for {saved['identity']!r}, loading it for {actual['identity']!r} "
                      f"(same shapes and tokenizer)", stacklevel=3)


def check_draft_layer(saved: dict, directory: Path) -> None:
    """Refuse an EAGLE head whose draft layers are the target's own non-Llama layer (saved by an earlier version):
    its weights would load into a Llama-style layer that computes something else, or not load at all."""
    family = saved["target"].get("model_type")
    style = saved.get("draft_layer")
    if not head_class(saved["head_type"]).has_draft_layers or style == DRAFT_LAYER or (
            style is None and family in LLAMA_LAYER_FAMILIES):
        return
    raise ValueError(f"{directory / CONFIG_NAME}: this {saved['head_type']} head was saved by an earlier version with "
                     f"draft layers of the target's own {family} layer class; draft layers are now Llama-style for "
                     f"every target (no q/k/v bias, no q/k norm), as SGLang, vLLM and the published heads build them. "
                     f"Train the head again for this version (python training/train.py head={saved['head_type']} ...)")


def load_head(directory: str | os.PathLike, target_model_or_config, *, identity: str | None = None,
              tokenizer=None, device: str | torch.device | None = None,
              dtype: torch.dtype | None = None, config: dict | None = None) -> nn.Module:
    """Load a head for a target (a transformers model: frozen weights get attached; or a config: checked only).
    ``config``: the directory's ``read_head_config``, where the caller has read it already.

    Raises ValueError when the target differs from the one the head was trained for (hidden size, vocabulary,
    layer count, feature layers, tokenizer fingerprint when ``tokenizer`` is given).
    """
    directory = Path(directory)
    saved = config if config is not None else read_head_config(directory)
    head_type = saved["head_type"]
    head_config = saved["head_config"]
    actual = target_signature(target_model_or_config, identity, tokenizer)
    check_target(saved["target"], actual, str(directory), head_type, head_config.get("feature_layers", []))
    check_draft_layer(saved, directory)
    config = getattr(target_model_or_config, "config", target_model_or_config)
    head = build_head(head_type, head_config, config)
    weights_path = directory / WEIGHTS_NAME
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path} is missing; the head directory is incomplete")
    try:
        state = load_file(str(weights_path))
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{weights_path} cannot be read ({error}); it is truncated or damaged: copy the head "
                         f"directory again, or save the head again") from None
    load_into(head, state, weights_path, head_type, f"does not match its {CONFIG_NAME} (head_config {head_config} "
              f"describes another head than the weights hold, e.g. another draft_vocab_size; save the head again)")
    if isinstance(target_model_or_config, nn.Module):
        embed, lm_head = frozen_target_weights(target_model_or_config)
        head.attach_target_weights(embed, lm_head)
    if device is not None or dtype is not None:
        head.to(device=device, dtype=dtype)
    return head.eval()
