"""Every head type by name, and every published layout import reads: the lists training, the runtime, export and
config validation read.

A new head type is a ``heads.base.DraftHead`` subclass in heads/<type>.py (its module, export layouts and imported
layouts) listed here, plus its parts in the other layers' registries: its objective (training/objectives/), its
proposer (runtime/proposers/) and its training config (conf/head/NAME.yaml).
"""

from __future__ import annotations

from heads import dflash, eagle, eagle3, medusa
from heads.base import DraftHead
from heads.layouts import Layout

HEAD_TYPES: dict[str, type[DraftHead]] = {cls.head_type: cls for cls in (eagle.EagleHead, eagle3.Eagle3Head,
                                                                          medusa.MedusaHeads, dflash.DFlashHead)}
# The published layouts import detects, in the order it tries them (heads/formats.py: detect_layout).
LAYOUTS: tuple[Layout, ...] = tuple(sorted((*eagle.LAYOUTS, *eagle3.LAYOUTS, *medusa.LAYOUTS, *dflash.LAYOUTS),
                                           key=lambda layout: layout.order))


def head_class(head_type: str) -> type[DraftHead]:
    """The class of a head type, or a ValueError listing the known ones."""
    if head_type not in HEAD_TYPES:
        raise ValueError(f"unknown head type {head_type!r}; choose one of {', '.join(HEAD_TYPES)}")
    return HEAD_TYPES[head_type]


def build_head(head_type: str, head_config: dict, target_config) -> DraftHead:
    """An untrained head of ``head_type`` from its saved architecture dict, without target weights attached."""
    cls = head_class(head_type)
    return cls(cls.config_from_dict(head_config), target_config)
