"""Every head type by name: the one list that training, the runtime, export and config validation read.

A new head type is a ``heads.base.DraftHead`` subclass listed here (plus its training config, conf/head/NAME.yaml).
"""

from __future__ import annotations

from heads.base import DraftHead
from heads.eagle import EagleHead
from heads.eagle3 import Eagle3Head
from heads.medusa import MedusaHeads

HEAD_TYPES: dict[str, type[DraftHead]] = {cls.head_type: cls for cls in (EagleHead, Eagle3Head, MedusaHeads)}


def head_class(head_type: str) -> type[DraftHead]:
    """The class of a head type, or a ValueError listing the known ones."""
    if head_type not in HEAD_TYPES:
        raise ValueError(f"unknown head type {head_type!r}; choose one of {', '.join(HEAD_TYPES)}")
    return HEAD_TYPES[head_type]


def build_head(head_type: str, head_config: dict, target_config) -> DraftHead:
    """An untrained head of ``head_type`` from its saved architecture dict, without target weights attached."""
    cls = head_class(head_type)
    return cls(cls.config_from_dict(head_config), target_config)
