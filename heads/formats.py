"""Heads in the layouts other code reads and writes: which readers an export serves, and import of heads in any layout
known here (ours, and the published ones every head type lists: the EAGLE authors', SpecForge's, FasterDecoding's
Medusa, vLLM's, economize's, our own exports).

Export formats: ``sglang`` (the default for EAGLE heads), ``vllm`` (Medusa's default; SGLang has no Medusa) and
``reference`` (the EAGLE authors' code and FasterDecoding's Medusa, which economize reads too). What a head writes
for each reader is its own (``DraftHead.export_files`` in heads/<type>.py, each checked against the reader's source);
whether a reader can carry it at all is ``export_refusal``. Every EAGLE config is a Llama config of the draft layer
(``heads.layouts.draft_layer_json``) with ``rope_theta`` at the top level beside ``rope_parameters``: readers of the
legacy key (speculators' converter, older engines) would otherwise fall back to 10000.

Import (``load_any_head``) detects the layout from the files (``detect_layout``: each head type's ``LAYOUTS``, in
heads/registry.py's order), converts it to our head and checks every shape and setting against the target, naming
what differs. A head directory's config.json is read once, by ``detect_layout``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from heads.base import DraftHead
from heads.common import frozen_target_weights
from heads.io import FORMAT, load_head, read_head_config
from heads.layouts import read_json, save_tensors
from heads.registry import LAYOUTS, head_class

EXPORT_FORMATS = ("sglang", "vllm", "reference")
READERS = {"sglang": "SGLang", "vllm": "vLLM",
           "reference": "the EAGLE authors' / FasterDecoding Medusa code and economize"}
OUR_LAYOUT = "our head directory: config.json with format headstart-head + model.safetensors"


# ----- export

def export_refusal(head_type: str, head_config: dict, target_layers: int | None, fmt: str) -> str | None:
    """Why ``fmt`` cannot carry this head (a message naming the fix), or None. Needs only the head's config, so a
    command line can refuse before loading anything."""
    if fmt not in EXPORT_FORMATS:
        return f"unknown export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}"
    return head_class(head_type).export_refusal(head_config, target_layers, fmt)


def export_files(head: DraftHead, fmt: str = "sglang", *, base_model: str | None = None) -> dict:
    """{file name: config dict (``.json``) or tensors (``.safetensors``, ``.bin``, ``.pt``; a ``.pt`` may hold other
    values beside them)} of ``head`` in ``fmt``.
    ``head`` needs its target weights attached; ``base_model`` names the target in the Medusa reference config."""
    problem = export_refusal(head.head_type, asdict(head.config), int(head.target_config.num_hidden_layers), fmt)
    if problem:
        raise ValueError(problem)
    return head.export_files(fmt, base_model)


def write_files(directory: Path, files: dict, dtype: torch.dtype | None = None) -> None:
    """Write ``export_files`` output into ``directory``, casting floating tensors to ``dtype``."""
    for name, content in files.items():
        path = Path(directory) / name
        if name.endswith(".json"):
            if dtype is not None and "hidden_size" in content:
                content = {**content, "torch_dtype": str(dtype).removeprefix("torch.")}
            path.write_text(json.dumps(content, indent=2) + "\n")
            continue
        tensors = {key: value.to(dtype) if dtype is not None and isinstance(value, torch.Tensor) and
                   value.is_floating_point() else value for key, value in content.items()}
        if name.endswith(".safetensors"):
            # shared storage (a shared LM head written once per Medusa head) must be separate tensors here
            save_tensors({key: value.contiguous().clone() for key, value in tensors.items()}, path,
                         metadata={"format": "pt"})
        else:
            torch.save(tensors, path)


# ----- import

@dataclass(frozen=True)
class DetectedLayout:
    """What ``detect_layout`` found: the layout's name (``headstart`` for our head directories), the head type, and
    the directory's config.json (checked by ``heads.io.read_head_config`` for ours; None where the layout has none)."""

    layout: str
    head_type: str
    config: dict | None


def detect_layout(directory: str | Path) -> DetectedLayout:
    """The layout of a head directory, from its files and config.json (no weights read but a few key names); a
    ValueError lists the layouts looked for and the files found."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory; pass a head directory")
    config_path = directory / "config.json"
    config = read_json(config_path) if config_path.is_file() else None
    if config is not None and config.get("format") == FORMAT:
        config = read_head_config(directory)  # checks the whole config
        return DetectedLayout("headstart", config["head_type"], config)
    for layout in LAYOUTS:
        if layout.detect(directory, config):
            return DetectedLayout(layout.name, layout.head_type, config)
    found = sorted(path.name for path in directory.iterdir())
    looked_for = "; ".join([f"headstart: {OUR_LAYOUT}"] + [f"{layout.name}: {layout.description}"
                                                           for layout in LAYOUTS])
    raise ValueError(f"{directory} is no head layout known here (found: {', '.join(found) or 'nothing'}). Looked "
                     f"for: {looked_for}")


def load_any_head(directory: str | Path, target_model_or_config, *, identity: str | None = None, tokenizer=None,
                  device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                  detected: DetectedLayout | None = None) -> tuple[nn.Module, dict]:
    """(head, config) from a directory in any layout ``detect_layout`` knows (``detected``: its answer, where the
    caller has it already), for a target (a transformers model: frozen weights get attached; or its config: checked
    only).

    Our own head directories load with ``heads.io.load_head`` (their config is the saved one); other layouts are
    converted, checked against the target (shapes, draft-layer settings, vocabulary, layers; the error names what
    differs) and get a config of ours without tree defaults: ``{"format", "layout", "head_type", "head_config",
    "tree": {}, "training": {}}``.
    """
    directory = Path(directory)
    detected = detected or detect_layout(directory)
    if detected.layout == "headstart":
        head = load_head(directory, target_model_or_config, identity=identity, tokenizer=tokenizer, device=device,
                         dtype=dtype, config=detected.config)
        return head, detected.config
    layout = next(layout for layout in LAYOUTS if layout.name == detected.layout)
    target_config = getattr(target_model_or_config, "config", target_model_or_config)
    head = layout.load(directory, detected.config, target_model_or_config)
    bad = [i for i in head.feature_layers if not 0 <= i < int(target_config.num_hidden_layers)]
    if bad:
        raise ValueError(f"the head at {directory} reads target layers {bad}; this target has layers "
                         f"0..{target_config.num_hidden_layers - 1}")
    if isinstance(target_model_or_config, nn.Module):
        head.attach_target_weights(*frozen_target_weights(target_model_or_config))
    if device is not None or dtype is not None:
        head.to(device=device, dtype=dtype)
    saved = {"format": "imported", "layout": layout.name, "head_type": layout.head_type,
             "head_config": asdict(head.config), "tree": {}, "training": {}}
    return head.eval(), saved
