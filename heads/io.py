"""Head checkpoints (a directory: ``config.json`` + ``model.safetensors``) and export for serving engines.

Our format records the head's architecture and the target it was trained for (identity, model type, hidden size,
vocabulary, layer count, tokenizer fingerprint); loading compares all of it with the target at hand and names every
mismatch. Frozen target weights (embedding, shared LM heads) are never saved: they are attached from the target.
Writes are atomic: a temporary sibling directory is filled and then swapped in with ``os.replace``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path
from collections.abc import Callable

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from heads.base import DraftHead
from heads.common import frozen_target_weights, target_signature
from heads.registry import HEAD_TYPES, build_head

FORMAT = "headstart-head"
FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def _check_head(head: nn.Module) -> DraftHead:
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
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a head directory is an ordinary output
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
        "head_type": _check_head(head).head_type,
        "head_config": asdict(head.config),
        "target": target,
        "tree": tree or {},
        "training": training or {},
    }
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in head.state_dict().items()}

    def fill(tmp: Path) -> None:
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        if write_extra is not None:
            write_extra(tmp)
        _write_json(tmp / CONFIG_NAME, config)  # last: a directory with config.json is complete

    return atomic_directory(directory, fill)


def read_head_config(directory: str | os.PathLike) -> dict:
    directory = Path(directory)
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a head directory (no {CONFIG_NAME}); pass the directory written "
                                f"by training (OUTPUT_DIR/head)")
    config = json.loads(path.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{path} is not a headstart head config (format={config.get('format')!r}); exported "
                         f"serving formats cannot be loaded back")
    if config.get("head_type") not in HEAD_TYPES:
        raise ValueError(f"{path}: unknown head_type {config.get('head_type')!r}; known: {', '.join(HEAD_TYPES)}")
    return config


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


def load_head(directory: str | os.PathLike, target_model_or_config, *, identity: str | None = None,
              tokenizer=None, device: str | torch.device | None = None,
              dtype: torch.dtype | None = None) -> nn.Module:
    """Load a head for a target (a transformers model: frozen weights get attached; or a config: checked only).

    Raises ValueError when the target differs from the one the head was trained for (hidden size, vocabulary,
    layer count, feature layers, tokenizer fingerprint when ``tokenizer`` is given).
    """
    directory = Path(directory)
    saved = read_head_config(directory)
    head_type = saved["head_type"]
    head_config = saved["head_config"]
    actual = target_signature(target_model_or_config, identity, tokenizer)
    check_target(saved["target"], actual, str(directory), head_type, head_config.get("feature_layers", []))
    config = getattr(target_model_or_config, "config", target_model_or_config)
    head = build_head(head_type, head_config, config)
    weights_path = directory / WEIGHTS_NAME
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path} is missing; the head directory is incomplete")
    state = load_file(str(weights_path))
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{weights_path} does not match a {head_type} head with config {head_config}: "
                         f"missing {missing}, unexpected {unexpected}")
    if isinstance(target_model_or_config, nn.Module):
        embed, lm_head = frozen_target_weights(target_model_or_config)
        head.attach_target_weights(embed, lm_head)
    if device is not None or dtype is not None:
        head.to(device=device, dtype=dtype)
    return head.eval()


# ----- export for serving engines

def _llama_style_config(target_config, **overrides) -> dict:
    data = target_config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "auto_map"):
        data.pop(key, None)
    data.update(overrides)
    return data


def serving_export(head: nn.Module) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors) as SGLang/vLLM load them. ``head`` must have its target weights attached."""
    target_config = head.target_config
    head_type = _check_head(head).head_type
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in head.state_dict().items()}
    if head_type == "eagle3":
        # Serving engines name captured layers by the layer whose *output* they take: input of layer i = output of
        # layer i-1 (SGLang adds 1 back when it sets the layers to capture).
        config = _llama_style_config(
            target_config, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
            draft_vocab_size=head.draft_vocab_size, tie_word_embeddings=False,
            eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in head.feature_layers],
                          "use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True})
        return config, state
    if head_type == "eagle":
        config = _llama_style_config(target_config, architectures=["LlamaForCausalLMEagle"],
                                     num_hidden_layers=head.config.num_layers)
        return config, state
    num_layers = head.config.num_layers
    tensors = {name: tensor for name, tensor in state.items() if name.startswith("blocks.")}
    for index in range(head.num_heads):
        if head.config.shared_lm_head:  # vLLM expects one LM head per Medusa head: write the shared one out
            if head.target_lm_head_weight.numel() == 0:
                raise RuntimeError("exporting a shared-LM-head Medusa needs the target attached (load_head with "
                                   "the target model)")
            tensors[f"lm_heads.{index}.weight"] = head.target_lm_head_weight.detach().contiguous().cpu().clone()
        else:
            tensors[f"lm_heads.{index}.weight"] = state[f"lm_heads.{index}.weight"]
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": head.hidden_size,
              "vocab_size": head.vocab_size, "truncated_vocab_size": head.vocab_size, "num_heads": head.num_heads,
              "num_hidden_layers": num_layers, "medusa_num_heads": head.num_heads,
              "medusa_num_layers": num_layers}
    return config, tensors


def export_head(head: nn.Module, out_dir: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write ``head`` in the serving format (SGLang and vLLM read the same layout) to ``out_dir`` atomically."""
    config, tensors = serving_export(head)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        config["torch_dtype"] = str(dtype).removeprefix("torch.")

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        _write_json(tmp / CONFIG_NAME, config)

    return atomic_directory(out_dir, fill)
