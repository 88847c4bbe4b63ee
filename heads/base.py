"""The base every head type builds on: what the registry, checkpoints, training and the runtime read of a head."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import nn


class DraftHead(nn.Module):
    """A draft head for one target. Subclasses set ``head_type`` (the name in checkpoints, configs and the CLI) and
    ``config_class`` (a dataclass of the architecture, saved as ``head_config``), and take ``(config, target_config)``.

    Frozen target weights (embedding, LM head) are never part of the head's state: ``attach_target_weights`` points
    the head at the target's tensors after it is built or loaded.
    """

    head_type: ClassVar[str]
    config_class: ClassVar[type]
    # Keys that heads saved by earlier versions recorded in head_config and that this head type ignores.
    legacy_config_keys: ClassVar[tuple[str, ...]] = ()
    # The reader an export is for unless one is asked for (heads.formats.EXPORT_FORMATS).
    default_export_format: ClassVar[str] = "sglang"
    # Whether the head drafts with decoder layers whose style checkpoints record (heads.io.DRAFT_LAYER): EAGLE's.
    has_draft_layers: ClassVar[bool] = False

    def __init__(self, config, target_config):
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(f"a {self.head_type} head takes a {self.config_class.__name__}, got "
                            f"{type(config).__name__}")
        self.config = config
        self.target_config = target_config
        self.hidden_size = int(target_config.hidden_size)
        self.target_vocab_size = int(target_config.vocab_size)
        self.softcap = getattr(target_config, "final_logit_softcapping", None)

    @classmethod
    def config_from_dict(cls, values: dict):
        """The architecture dataclass from a saved ``head_config``; unknown keys name the head type and the fields."""
        names = {f.name for f in dataclasses.fields(cls.config_class)}
        if values.get("kind", cls.head_type) != cls.head_type:
            raise ValueError(f"head_config says kind={values['kind']!r}, not {cls.head_type!r}")
        values = {k: v for k, v in values.items() if k not in ("kind", *cls.legacy_config_keys)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown {cls.head_type} head config keys {unknown}; a {cls.config_class.__name__} has "
                             f"{sorted(names)}")
        return cls.config_class(**values)

    @property
    def feature_layers(self) -> list[int]:
        """Indices i of the target's hidden_states[i] (inputs of decoder layer i) the head reads; [] for heads that
        read only the last hidden state."""
        return []

    def attach_target_weights(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        raise NotImplementedError

    # ----- export (heads/formats.py dispatches here)

    @classmethod
    def export_refusal(cls, head_config: dict, target_layers: int | None, fmt: str) -> str | None:
        """Why the known export format ``fmt`` cannot carry a head of this type with ``head_config`` (its saved
        architecture dict) on a target of ``target_layers`` layers (None: unknown), as a message naming the fix; None
        where it can. Needs only the config, so a command line can refuse before loading anything."""
        return None

    @classmethod
    def gguf_refusal(cls) -> str | None:
        """Why llama.cpp cannot draft with a head of this type (None where ``gguf_layout`` writes one)."""
        return (f"llama.cpp drafts with EAGLE-3 heads (and DFlash), not {cls.head_type} heads; export this head for "
                f"vLLM or SGLang instead")

    def gguf_layout(self):
        """This head as a llama.cpp draft (``heads.gguf.GGUFLayout``), for a head type that ``gguf_refusal`` allows."""
        raise NotImplementedError(self.gguf_refusal())

    def gguf_draft_max(self) -> int:
        """The chain length llama.cpp drafts with this head (``--spec-draft-n-max``): llama.cpp's default."""
        return 3

    def export_files(self, fmt: str, base_model: str | None = None) -> dict:
        """{file name: config dict (``.json``) or tensors (``.safetensors``, ``.bin``, ``.pt``)} of this head in the
        layout reader ``fmt`` loads (``export_refusal`` has passed); ``base_model`` names the target where a layout
        records it. The head needs its target weights attached."""
        raise NotImplementedError(f"a {self.head_type} head has no export layout")
