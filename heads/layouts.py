"""What every head layout shares: reading configs and weights safely, checking a published head's settings against the
target, copying weights into a head with every difference named, and the draft layer's config as readers expect it.

A head type's own layouts (what it exports for each reader, and which published layouts it imports) live in its
module (heads/eagle.py, heads/eagle3.py, heads/medusa.py) as ``Layout`` values and export methods; heads/formats.py
dispatches to them through heads/registry.py. Pickles load with ``weights_only=True`` only.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from heads.common import draft_layer_config, draft_rope_parameters, output_vocab_size

SAFETENSORS = "model.safetensors"
PICKLE = "pytorch_model.bin"
# Draft-layer weights of a target-style (non-Llama) layer: Qwen2 q/k/v biases, Qwen3 q/k norms.
TARGET_STYLE_KEYS = re.compile(r"self_attn\.(q_proj|k_proj|v_proj)\.bias$|self_attn\.(q_norm|k_norm)\.")


@dataclass(frozen=True)
class Layout:
    """A published head layout import reads: ``detect(directory, config)`` says whether a directory holds it
    (``config``: its config.json, or None where there is none; no weights read but a few key names), ``load(directory,
    config, target_model_or_config)`` converts it to our head, checked against the target. ``order``: where detection
    tries it (lower first: a layout whose files another layout's would also match must come first)."""

    name: str
    head_type: str
    description: str
    order: int
    detect: Callable[[Path, dict | None], bool]
    load: Callable[[Path, dict, object], nn.Module]


def new_mode(directory: bool = False) -> int:
    """The permissions a new file (or directory) gets from this process's umask, as ``open`` (``mkdir``) gives them:
    0o644 (0o755) under the usual 022."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


def save_tensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file``, with the file's permissions following the umask as any other written file's:
    safetensors creates its files readable by their owner alone, so a server running as another user could not read
    an exported head."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, new_mode())


def safetensors_damage(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a whole safetensors file (cut short by a kill or a copy, not safetensors at all), or
    None. Reads only its header."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        start = handle.read(8)
        if len(start) < 8:
            return f"{path} is cut short ({size} bytes: not even a safetensors header)"
        length = int.from_bytes(start, "little")
        if 8 + length > size:
            return f"{path} is cut short ({size} bytes; its header alone takes {8 + length})"
        try:
            header = json.loads(handle.read(length))
            end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"),
                      default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            return f"{path} is not a safetensors file (its header does not read)"
    if 8 + length + end > size:
        return f"{path} is cut short ({size} bytes of the {8 + length + end} its tensors take)"
    return None


def weight_keys(path: Path) -> set[str]:
    """The tensor names of a weights file (safetensors: from its header alone)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as handle:
            return set(handle.keys())
    return set(load_weights(path))


def state_of(head: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().contiguous().cpu() for name, tensor in head.state_dict().items()}


def draft_layer_json(head, **overrides) -> dict:
    """The draft layer's Llama config as config.json data, with the legacy rope keys beside ``rope_parameters``."""
    target = head.target_config
    data = draft_layer_config(target, head.cache_layers).to_dict()
    for key in ("_name_or_path", "transformers_version", "output_attentions", "output_hidden_states", "return_dict",
                "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "dtype",
                "pretraining_tp", "use_cache"):  # transformers' generic fields: no reader's business
        data.pop(key, None)
    rope = draft_rope_parameters(target)
    data["rope_theta"] = float(rope["rope_theta"])
    scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
    data["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        data[key] = getattr(target, key, None)
    data.update(model_type="llama", vocab_size=output_vocab_size(target), **overrides)
    return data


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a config object")
    return data


def first_file(directory: Path, names) -> Path | None:
    return next((directory / name for name in names if (directory / name).is_file()), None)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file, or a pickled state dict read with ``weights_only=True`` (tensors only, no code)."""
    if path.suffix == ".safetensors":
        return load_file(str(path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # an unpickling error names the global it refused
        raise ValueError(f"{path} does not load as a plain state dict with weights_only=True ({error}); only "
                         "tensors are read from pickles") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} is not a state dict of tensors")
    return dict(state)


def mismatches(pairs) -> list[str]:
    """'name: head X, target Y' for each (name, head value, target value) that differs (None: not recorded)."""
    problems = []
    for name, theirs, ours in pairs:
        if theirs is None:
            continue
        same = abs(float(theirs) - float(ours)) <= 1e-9 * max(1.0, abs(float(ours))) if isinstance(
            ours, float) else theirs == ours
        if not same:
            problems.append(f"{name} {theirs} (this target: {ours})")
    return problems


def check_layer_settings(config: dict, target_config, where: Path, kind: str) -> None:
    """The draft layer's settings in a published config against those this target gives our draft layer."""
    ours = draft_layer_config(target_config)
    params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    theta = config.get("rope_theta", params.get("rope_theta"))
    scaling = config.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    our_rope = draft_rope_parameters(target_config)
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (int(config["hidden_size"]) // int(heads) if heads and config.get(
        "hidden_size") else None)
    problems = mismatches([
        ("hidden_size", config.get("hidden_size"), ours.hidden_size),
        ("num_attention_heads", heads, ours.num_attention_heads),
        ("num_key_value_heads", config.get("num_key_value_heads", heads), ours.num_key_value_heads),
        ("head_dim", head_dim, ours.head_dim),
        ("intermediate_size", config.get("intermediate_size"), ours.intermediate_size),
        ("rms_norm_eps", config.get("rms_norm_eps"), float(ours.rms_norm_eps)),
        # the reference code uses 10000 where a config has no rope_theta
        ("rope_theta", 10000.0 if theta is None else float(theta), float(our_rope["rope_theta"])),
        ("rope type", rope_type, our_rope.get("rope_type", "default")),
        ("hidden_act", config.get("hidden_act"), "silu"),
    ])
    if config.get("attention_bias") or config.get("mlp_bias"):
        problems.append("biases on the draft layer's attention or MLP (attention_bias / mlp_bias)")
    if problems:
        raise ValueError(f"the {kind} head at {where} does not fit this target: " + "; ".join(problems)
                         + ". Load a head trained for this target")


def load_into(head: nn.Module, state: dict[str, torch.Tensor], where: Path, kind: str,
              mismatch: str = "does not fit this target") -> None:
    """Copy ``state`` into ``head`` (strict), naming missing and unexpected keys and every shape that differs (the
    error says the head ``mismatch``)."""
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{name} {tuple(state[name].shape)} (expected {tuple(expected[name].shape)})"
              for name in sorted(set(state) & set(expected)) if state[name].shape != expected[name].shape]
    if missing or unexpected or shapes:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unexpected {unexpected}"] if unexpected else []) + (
            [f"shapes differ: {'; '.join(shapes)}"] if shapes else [])
        raise ValueError(f"the {kind} head at {where} {mismatch}: " + ", ".join(parts))
    head.load_state_dict({name: tensor.to(expected[name].dtype) for name, tensor in state.items()})


def drop_embedding(state: dict, target_config, where: Path) -> None:
    """Published EAGLE heads may carry a copy of the target's embedding; the head uses the target's own."""
    embed = state.pop("embed_tokens.weight", None)
    if embed is not None and embed.shape[1] != int(target_config.hidden_size):
        raise ValueError(f"{where}: embed_tokens.weight has width {embed.shape[1]}, this target has hidden size "
                         f"{target_config.hidden_size}")


def refuse_target_style(state: dict, where: Path) -> None:
    odd = sorted(key for key in state if TARGET_STYLE_KEYS.search(key))
    if odd:
        raise ValueError(f"{where}: the draft layer has weights of a non-Llama layer ({', '.join(odd[:3])}); the "
                         "engines and this runtime draft with a Llama-style layer (no q/k/v bias, no q/k norm)")
