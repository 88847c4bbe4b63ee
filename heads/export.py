"""Export for serving engines: a head in the layout a reader loads (heads/formats.py), written atomically into a
directory that carries a marker file (``headstart_export.json``) listing the files the export wrote.

Exporting replaces only a missing or empty directory or an earlier export unless forced: an output path that names
a run directory must not wipe the run. Over an earlier export only what that export wrote is replaced: files a user
added to it (notes, a README, a tokenizer) are carried into the new one.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from heads.formats import EXPORT_FORMATS, export_files, export_refusal, write_files
from heads.gguf import target_layout, write_gguf
from heads.io import atomic_directory, checked_head
from heads.registry import head_class

EXPORT_MARKER = "headstart_export.json"  # in every export: what may be replaced without force
EXPORT_FORMAT = "headstart-export"
# What an export written before markers listed their files may hold; anything else in it is the user's.
EARLIER_EXPORT_FILES = ("config.json", "model.safetensors", "pytorch_model.bin", "medusa_lm_head.pt",
                        "medusa_lm_head.safetensors", "generation_config.json", "sglang", "vllm", "reference")


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
        written = sorted(path.relative_to(tmp).as_posix() for path in tmp.rglob("*") if path.is_file())
        _write_json(tmp / EXPORT_MARKER, {"format": EXPORT_FORMAT, "kind": kind, **({"layout": layout} if layout
                                                                                      else {}), "files": written})
        carry_user_files(Path(directory), tmp, set(written))

    return atomic_directory(directory, marked)


def user_files(directory: Path) -> list[str]:
    """The files of an earlier export ``directory`` that it did not write itself (relative paths): those its marker
    does not list (an export written before markers listed files: those outside ``EARLIER_EXPORT_FILES``)."""
    marker = directory / EXPORT_MARKER
    if not marker.is_file():
        return []
    try:
        listed = json.loads(marker.read_text()).get("files")
    except (ValueError, AttributeError):
        listed = None
    found = []
    for path in sorted(directory.rglob("*")):
        name = path.relative_to(directory).as_posix()
        if not path.is_file() or name == EXPORT_MARKER:
            continue
        ours = name in listed if isinstance(listed, list) else name.split("/")[0] in EARLIER_EXPORT_FILES
        if not ours:
            found.append(name)
    return found


def carry_user_files(directory: Path, tmp: Path, written: set[str]) -> None:
    """Copy into the new export ``tmp`` the files a user added to the earlier export at ``directory`` (``user_files``)
    that the new export does not write itself."""
    if not directory.is_dir():
        return
    for name in user_files(directory):
        if name not in written:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(directory / name, tmp / name)


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


DRAFT_GGUF, TARGET_GGUF = "draft.gguf", "target.gguf"


def export_gguf(head: nn.Module, out_dir: str | os.PathLike, tokenizer: dict, dtype: str = "bfloat16", *,
                force: bool = False, target_model=None) -> Path:
    """``head`` as a llama.cpp draft (``OUT/draft.gguf``, loaded with ``-md``) with the target's ``tokenizer`` fields
    (``heads.gguf.tokenizer_fields_from_gguf`` / ``tokenizer_fields``), matrices in ``dtype``; with
    ``target_model`` (a llama-family transformers model) also the target itself (``OUT/target.gguf``), so that
    llama.cpp serves the very weights the head was trained on. Refused for a head type llama.cpp does not draft
    with, before anything is written."""
    problem = checked_head(head).gguf_refusal()
    if problem:
        raise ValueError(problem)
    layouts = {DRAFT_GGUF: head.gguf_layout()}
    if target_model is not None:
        layouts[TARGET_GGUF] = target_layout(target_model)

    def fill(tmp: Path) -> None:
        for name, layout in layouts.items():
            write_gguf(layout, tokenizer, tmp / name, dtype)

    return write_export(out_dir, fill, "head", force=force, layout="gguf")
