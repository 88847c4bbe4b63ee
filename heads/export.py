"""Export for serving engines: a head in the layout a reader loads (heads/formats.py), written atomically into a
directory that carries a marker file (``headstart_export.json``).

Exporting replaces only a missing or empty directory or an earlier export unless forced: an output path that names
a run directory must not wipe the run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from heads.formats import EXPORT_FORMATS, export_files, export_refusal, write_files
from heads.io import atomic_directory, checked_head
from heads.registry import head_class

EXPORT_MARKER = "headstart_export.json"  # in every export: what may be replaced without force
EXPORT_FORMAT = "headstart-export"


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def default_export_format(head_type: str) -> str:
    """The layout an export gets unless one is asked for (the head type's ``default_export_format``): SGLang's for
    EAGLE heads, vLLM's for Medusa (SGLang has no Medusa)."""
    return head_class(head_type).default_export_format


def export_destination_problem(directory: str | os.PathLike) -> str | None:
    """Why exporting to ``directory`` would destroy something (a description), or None: it is missing, an empty
    directory, or an earlier export (it holds ``EXPORT_MARKER``)."""
    directory = Path(directory)
    if not directory.exists() and not directory.is_symlink():
        return None
    if not directory.is_dir():
        return f"{directory} exists and is not a directory"
    if (directory / EXPORT_MARKER).is_file() or not any(directory.iterdir()):
        return None
    return f"{directory} exists and is not an earlier export (no {EXPORT_MARKER}); exporting there would delete it"


def write_export(directory: str | os.PathLike, fill: Callable[[Path], None], kind: str, *,
                 force: bool = False, layout: str | None = None) -> Path:
    """``atomic_directory`` for an export of ``kind`` (``head``, ``merged-target``): refuses to replace what
    ``export_destination_problem`` describes unless ``force``, and marks the new directory as an export."""
    problem = None if force else export_destination_problem(directory)
    if problem:
        raise FileExistsError(f"{problem}. Export to a new or empty directory, or pass force=True to replace it")

    def marked(tmp: Path) -> None:
        fill(tmp)
        _write_json(tmp / EXPORT_MARKER, {"format": EXPORT_FORMAT, "kind": kind, **({"layout": layout} if layout
                                                                                      else {})})

    return atomic_directory(directory, marked)


def export_head(head: nn.Module, out_dir: str | os.PathLike, dtype: torch.dtype | None = None, *,
                force: bool = False, fmt: str | None = None, base_model: str | None = None) -> Path:
    """Write ``head`` for one reader to ``out_dir`` atomically: ``fmt`` is ``sglang``, ``vllm`` or ``reference``
    (``heads.formats``; None: ``default_export_format``). A format that cannot carry the head raises ValueError
    saying which can. ``out_dir`` must be missing, empty or an earlier export, unless ``force`` (``write_export``)."""
    fmt = fmt or default_export_format(checked_head(head).head_type)
    files = export_files(head, fmt, base_model=base_model)
    return write_export(out_dir, lambda tmp: write_files(tmp, files, dtype), "head", force=force, layout=fmt)


def export_all(head: nn.Module, out_dir: str | os.PathLike, dtype: torch.dtype | None = None, *,
               force: bool = False, base_model: str | None = None) -> dict[str, str]:
    """One export per format that can carry ``head``, in ``out_dir/<format>`` (itself an export: replaced only when
    missing, empty or an earlier export, unless ``force``). Returns {format: directory, or why it was skipped}."""
    done, files = {}, {}
    for fmt in EXPORT_FORMATS:
        problem = export_refusal(head.head_type, asdict(head.config), int(head.target_config.num_hidden_layers), fmt)
        if problem:
            done[fmt] = f"skipped: {problem}"
        else:
            files[fmt] = export_files(head, fmt, base_model=base_model)
            done[fmt] = str(Path(out_dir) / fmt)

    def fill(tmp: Path) -> None:
        for fmt, content in files.items():
            (tmp / fmt).mkdir()
            write_files(tmp / fmt, content, dtype)
            _write_json(tmp / fmt / EXPORT_MARKER, {"format": EXPORT_FORMAT, "kind": "head", "layout": fmt})

    write_export(out_dir, fill, "head-formats", force=force)
    return done
