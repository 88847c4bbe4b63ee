"""Checkpoints of a run: DeepSpeed state under OUTPUT_DIR/checkpoints/<tag>, which ``resume=true`` reads back.

A tag directory is complete once its ``run.json`` (the step and the run's config) is written, after every rank's
shard is on disk; ``latest.json`` then points at it. Both are written atomically. Resuming reads the newest
complete checkpoint that passes three checks, each before DeepSpeed reads anything:

  intact    every file is a whole torch.save archive (a zip whose records pass their CRC): a truncated or corrupt
            checkpoint is skipped with a warning, and the one before it is used (nothing is deleted);
  safe      every file unpickles from tensors, plain containers and the few DeepSpeed data classes a checkpoint
            holds (``weights_only=True``); a file that needs anything else could run code and is refused;
  matching  the head and target settings saved with it are this run's; a difference is named.
"""

from __future__ import annotations

import json
import pickle
import os
import re
import shutil
import warnings
import zipfile
from pathlib import Path

import torch

from training import engine as ds

LATEST = "latest.json"
RUN_RECORD = "run.json"  # in each tag directory: {"step", "config"}; its presence marks the tag complete
RESUME_SECTIONS = ("head", "target")  # what a checkpoint's state is shaped by: a resumed run must keep them
TAG = re.compile(r"step-(\d+)")
OK, DAMAGED, UNSAFE = 0, 1, 2  # a tag's state, ordered so that the ranks agree on the worst (all-reduce max)


class UnsafeCheckpoint(RuntimeError):
    """A checkpoint file needs more than tensors and plain data to load: it is refused, never unpickled."""


class CheckpointError(RuntimeError):
    """resume=true cannot continue: no intact checkpoint, or one saved with other settings."""


# ----- tags

def tag_name(step: int) -> str:
    return f"step-{step:08d}"


def tag_step(tag: str) -> int:
    return int(TAG.fullmatch(tag).group(1))


def saved_tags(root: Path) -> list[str]:
    """Tag directories under ``root``, newest first (complete or not)."""
    if not root.is_dir():
        return []
    tags = [p.name for p in root.iterdir() if p.is_dir() and TAG.fullmatch(p.name)]
    return sorted(tags, key=tag_step, reverse=True)


def holds_run(root: Path) -> bool:
    """Whether ``root`` holds checkpoints of a run (even damaged ones: another run must not write over them)."""
    return (root / LATEST).exists() or bool(saved_tags(root))


def read_latest(root: Path) -> dict | None:
    """The pointer to the last complete checkpoint; None when there is none or it cannot be read (warned)."""
    path = root / LATEST
    if not path.is_file():
        return None
    try:
        latest = json.loads(path.read_text())
        if tag_step(latest["tag"]) != int(latest["step"]):
            raise ValueError(f"tag {latest['tag']} is not step {latest['step']}")
        return latest
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        warnings.warn(f"{path} is unreadable ({error!r}); resume looks for the newest complete checkpoint "
                      f"directory instead", stacklevel=2)
        return None


def resume_candidates(root: Path) -> list[str]:
    """The tags resume may read, in the order it tries them: the one ``latest.json`` names, then the older
    complete ones (newest first). Tags newer than the pointer are unfinished saves and never read."""
    latest = read_latest(root)
    complete = [tag for tag in saved_tags(root) if (root / tag / RUN_RECORD).is_file()]
    if latest is None:
        return complete
    older = [tag for tag in complete if tag_step(tag) < latest["step"]]
    return [latest["tag"], *older]


# ----- saving

def write_json_atomic(path: Path, value: dict) -> None:
    write_text_atomic(path, json.dumps(value, indent=1))


def write_text_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole, or what it held before (a kill mid-write leaves a ``.partial`` sibling)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def save_checkpoint(engine, root: Path, step: int, client_state: dict, config: dict, keep: int,
                    is_main: bool) -> None:
    """Every rank's DeepSpeed shard of step ``step``; then (main) the tag's run record, the pointer, and pruning."""
    tag = tag_name(step)
    if is_main:  # a tag written again (a resumed run reaching it) is incomplete until its new record is written
        (root / tag / RUN_RECORD).unlink(missing_ok=True)
    ds.barrier()
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False,
                           exclude_frozen_parameters=True)
    ds.barrier()  # every rank's shard is on disk before the tag counts as complete
    if is_main:
        write_json_atomic(root / tag / RUN_RECORD, {"step": step, "config": config})
        write_json_atomic(root / LATEST, {"tag": tag, "step": step})
        prune(root, step, keep)
    ds.barrier()


def prune(root: Path, step: int, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints up to ``step`` (a tag without its run record, left by a save
    that died, is no fallback and does not count). Newer ones (left by a run that resumed from an older checkpoint
    after a damaged one) are not this run's to delete: it overwrites them when it gets there."""
    reached = [tag for tag in saved_tags(root) if tag_step(tag) <= step]
    kept = [tag for tag in reached if (root / tag / RUN_RECORD).is_file()][:keep]
    for old in reached:
        if old not in kept:
            shutil.rmtree(root / old, ignore_errors=True)


# ----- checking a tag before DeepSpeed reads it

def safe_globals() -> list:
    """The classes a DeepSpeed checkpoint of this trainer pickles besides tensors and plain containers."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def weights_only_load(path, map_location=None):
    """torch.load that builds tensors, plain containers and ``safe_globals()`` only (an unpickled file cannot run
    code); anything else raises ``pickle.UnpicklingError`` naming it, and the file."""
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        refused = re.search(r"GLOBAL (\S+)", str(error))
        what = f"it needs {refused[1]}" if refused else str(error).splitlines()[0]
        raise pickle.UnpicklingError(f"{path}: refused to unpickle ({what}); a checkpoint of this trainer holds "
                                     f"tensors and plain data only, and a file that needs more could run code. "
                                     f"Delete it if you did not write it") from None


class WeightsOnlyLoads:
    """A DeepSpeed checkpoint engine whose loads go through ``weights_only_load``; everything else (saving) is the
    wrapped engine's. DeepSpeed's own engines unpickle with ``weights_only=False``."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def load(self, path, map_location=None):
        return weights_only_load(path, map_location=map_location)


def archive_damage(path: Path) -> str | None:
    """Why ``path`` is not a whole torch.save archive (truncated, corrupt, something else), or None."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad_record = archive.testzip()  # reads every record and checks its CRC
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        return f"{path.name} is truncated or not a torch.save archive ({error})"
    if bad_record is not None:
        return f"{path.name} is corrupt (record {bad_record} fails its CRC check)"
    return None


def unsafe_globals(path: Path) -> list[str]:
    """What unpickling ``path`` would import beyond tensors, plain data and ``safe_globals()`` (read statically from
    the pickle's opcodes; nothing is run)."""
    with torch.serialization.safe_globals(safe_globals()):
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))


def run_record_damage(directory: Path) -> str | None:
    """Why the tag's run record cannot be read, or None (also when there is none: older checkpoints)."""
    record = directory / RUN_RECORD
    if not record.is_file():
        return None
    try:
        if not isinstance(json.loads(record.read_text())["config"], dict):
            raise TypeError("its config is not an object")
    except (ValueError, KeyError, TypeError) as error:
        return f"{RUN_RECORD} is unreadable ({error!r})"
    return None


def inspect_tag(directory: Path, rank: int = 0, world: int = 1) -> tuple[int, str]:
    """(OK | DAMAGED | UNSAFE, why) for the checkpoint files of one tag directory; rank r reads files r, r+world, ...
    (every file is read once across the ranks: optimizer shards can be large)."""
    files = sorted(directory.glob("*.pt")) if directory.is_dir() else []
    if not any("model_states" in path.name for path in files):
        return DAMAGED, "its model state file is missing"
    record_damage = run_record_damage(directory)
    if record_damage:
        return DAMAGED, record_damage
    for path in files[rank::world]:
        damage = archive_damage(path)
        if damage:
            return DAMAGED, damage
        try:
            unsafe = unsafe_globals(path)
        except (ValueError, RuntimeError) as error:  # a zip without a pickle, or a TorchScript archive
            return DAMAGED, f"{path.name} is not a torch.save checkpoint ({error})"
        if unsafe:
            return UNSAFE, (f"refusing to resume from {path}: loading it would import {', '.join(unsafe)}, which no "
                            f"training checkpoint needs (it holds tensors and plain data; this file could run code). "
                            f"Delete {directory} if you did not write it (resume then continues from the checkpoint "
                            f"before it), or train in a new output_dir")
    return OK, ""


def agreed_state(directory: Path, dist: ds.Dist) -> tuple[int, str]:
    """``inspect_tag`` shared out over the ranks -> the worst state any rank found, with its reason, on every rank."""
    return max(ds.all_gather_object(inspect_tag(directory, dist.rank, dist.world)), key=lambda found: found[0])


# ----- the settings a checkpoint was saved with

def flatten(value, prefix: str) -> dict:
    if not isinstance(value, dict):
        return {prefix: value}
    flat = {}
    for key, item in value.items():
        flat.update(flatten(item, f"{prefix}.{key}"))
    return flat


def config_differences(saved: dict, current: dict, sections: tuple[str, ...] = RESUME_SECTIONS) -> list[str]:
    """'key: value in the checkpoint, value in this run' for every setting of ``sections`` that differs."""
    current = json.loads(json.dumps(current))  # compare as the saved copy was written: lists, floats, None
    differences = []
    for section in sections:
        old, new = flatten(saved.get(section, {}), section), flatten(current.get(section, {}), section)
        for key in sorted(old.keys() | new.keys()):
            before, after = old.get(key, "(unset)"), new.get(key, "(unset)")
            if before != after:
                differences.append(f"{key}: {before!r} in the checkpoint, {after!r} in this run")
    return differences


def check_settings(directory: Path, config: dict) -> None:
    """Refuse to resume a checkpoint saved with other head or target settings (DeepSpeed's own error would be a
    shape mismatch deep inside its state loading); checkpoints without a run record are not checked."""
    record = directory / RUN_RECORD
    if not record.is_file():
        return
    differences = config_differences(json.loads(record.read_text())["config"], config)
    if differences:
        raise CheckpointError(f"resume=true: {directory} was saved with other settings:\n  "
                              + "\n  ".join(differences)
                              + "\nresume with the checkpoint's settings, or train the changed head in a new "
                                "output_dir (init_from=<run>/head starts it from the saved head when its "
                                "architecture is unchanged)")


# ----- loading

def choose_checkpoint(root: Path, config: dict, dist: ds.Dist) -> str | None:
    """The tag resume=true continues: the newest complete checkpoint that is intact, safe and saved with this run's
    settings; None when ``root`` holds no complete checkpoint. Reads only the files (no engine needed: a run checks
    this before its slow setup). Damaged ones are skipped with a warning; when every one is damaged, a
    CheckpointError lists them."""
    skipped = []
    for tag in resume_candidates(root):
        state, why = agreed_state(root / tag, dist)
        if state == UNSAFE:
            raise UnsafeCheckpoint(why)
        if state == DAMAGED:
            skipped.append(f"{tag}: {why}")
            continue
        check_settings(root / tag, config)
        if skipped and dist.is_main:
            warnings.warn("resume=true: skipped damaged checkpoints (" + "; ".join(skipped) + f"); resuming from "
                          f"the older {tag}", stacklevel=2)
        return tag
    if skipped:
        raise CheckpointError(f"resume=true: no intact checkpoint in {root}:\n  " + "\n  ".join(skipped)
                              + f"\nrestore one from a backup, or start over in a new output_dir (or delete {root})")
    return None


def load_tag(engine, root: Path, tag: str) -> dict:
    """DeepSpeed's load of a tag ``choose_checkpoint`` chose -> its client state; every file is unpickled with
    ``weights_only=True``."""
    if not isinstance(engine.checkpoint_engine, WeightsOnlyLoads):
        engine.checkpoint_engine = WeightsOnlyLoads(engine.checkpoint_engine)
    path, client_state = engine.load_checkpoint(str(root), tag=tag, load_module_strict=False)
    if path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint in {root / tag}; delete that directory to resume "
                              f"from the one before it")
    return client_state
