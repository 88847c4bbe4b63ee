"""Heads shipped with the package for the default target (``heads/shipped/<name>/``, the usual head directory).

Each one was trained by ``scripts/train_default_heads.sh``; its ``config.json`` records the training command, config,
time and measured acceptance. The runtime uses them when a head proposer is asked for without ``--head``.
"""

from __future__ import annotations

import json
from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"


def shipped_heads() -> list[tuple[Path, str, str]]:
    """(directory, head type, target identity) of every shipped head, sorted by directory name."""
    found = []
    for config_path in sorted(SHIPPED_DIR.glob("*/config.json")):
        config = json.loads(config_path.read_text())
        found.append((config_path.parent, config.get("head_type", ""), config.get("target", {}).get("identity", "")))
    return found


def find_shipped(head_type: str, identities: set[str]) -> Path | None:
    """The shipped ``head_type`` head trained for a target known by any of ``identities`` (aliases of one model)."""
    for directory, saved_type, identity in shipped_heads():
        if saved_type == head_type and identity in identities:
            return directory
    return None
