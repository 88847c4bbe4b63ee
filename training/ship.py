"""Shipping a trained head into the package (heads/shipped/NAME) as the default for its target: what
scripts/ship_head.py does, whose command line turns this module's ValueErrors into its messages.

    config = run_head_config(run_dir)                            # the run's head/, checked
    problem = destination_problem(destination, run_dir)          # None where shipping destroys nothing
    tree = rank_paths_tree(report, config)                       # a Medusa tree measured by scripts/eval_head.py
    config = shipped_config(run_dir, config, tree=tree)          # + the run's record and tree settings
    write_shipped_head(run_dir, destination, config, "bfloat16")

Weights are stored in bfloat16 by default (the runtime casts them to the target's dtype on load). The config keeps
everything the training run recorded and adds the command line, the wall time and the final held-out acceptance,
which also becomes the head's default tree calibration (``tree.acceptance``).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import yaml
from safetensors.torch import load_file

from heads.io import (CONFIG_NAME, FORMAT as HEAD_FORMAT, WEIGHTS_NAME, atomic_directory, read_head_config,
                      save_tensors)
from runtime.proposers.medusa import TOP_K, check_rank_paths
from runtime.target.model import parse_dtype
from training.objectives import objective_class

RECORD_KEYS = ("data_command", "data_seconds", "command", "wall_seconds", "tokens_per_s_median", "final_eval", "note",
               "continued_from")

SHIPPED_FILES = {CONFIG_NAME, WEIGHTS_NAME, "curves.png"}


def run_record(run_dir: Path) -> dict:
    """What a finished training run says of itself: its command line (Hydra's overrides), median training rate and
    final held-out evaluation."""
    summary = json.loads((run_dir / "summary.json").read_text())
    overrides_path = run_dir / ".hydra" / "overrides.yaml"
    overrides = (yaml.safe_load(overrides_path.read_text()) if overrides_path.is_file() else None) or []
    return {"command": "python training/train.py " + " ".join(overrides),
            "tokens_per_s_median": summary.get("tokens_per_s_median"), "final_eval": summary.get("final_eval") or {}}


def start_record(config: dict, seen: frozenset = frozenset()) -> dict | None:
    """How the head a run continued (its ``init_from``) was made, for ``training.continued_from``; None for a run
    from scratch or a start that is gone. A shipped head carries its record; a training run's own head/ does not,
    so it is read from that run's directory, and its own start in turn."""
    init_from = config.get("training", {}).get("config", {}).get("init_from")
    if not init_from:
        return None
    if not (Path(init_from) / CONFIG_NAME).is_file():
        print(f"note: the run continued {init_from}, which is not a head directory from here (a relative path is "
              f"read from the directory training ran in): how it was made is not recorded", file=sys.stderr)
        return None
    head_dir = Path(init_from).resolve()
    if head_dir in seen:  # a run that continued a head it later shipped over: stop where the chain repeats
        return None
    start = read_head_config(head_dir)
    training = start.get("training", {})
    if "command" in training or not (head_dir.parent / "summary.json").is_file():
        return {key: training[key] for key in RECORD_KEYS if key in training}
    record = run_record(head_dir.parent)
    earlier = start_record(start, seen | {head_dir})
    if earlier is not None:
        record["continued_from"] = earlier
    return record


def rank_paths_tree(report_path: Path, config: dict) -> dict:
    """The ``tree`` entries of a static tree measured by scripts/eval_head.py (its --out report) for the head of
    ``config``; a ValueError naming the report and the problem for any other report, or a head type without one."""
    try:
        report = json.loads(report_path.read_text())
        measured = report["tree"]
        paths = [tuple(path) for path in measured["rank_paths"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{report_path}: not a Medusa report of scripts/eval_head.py --out ({error!r}); measure one "
                         f"with `python scripts/eval_head.py --head HEAD --prompts FILE --out REPORT`") from None
    if not objective_class(config["head_type"]).static_tree:
        raise ValueError(f"{report_path}: the head is {config['head_type']}, and only a Medusa head has a static tree")
    try:
        check_rank_paths(paths, config["head_config"]["num_heads"], TOP_K)  # what the runtime loads
    except ValueError as error:
        raise ValueError(f"{report_path}: {error}") from None
    return {"rank_paths": [list(path) for path in paths],
            "rank_path_frequencies": measured.get("rank_path_frequencies"),
            "rank_paths_measured_on": {key: report.get(key) for key in ("scored_on", "prompts", "positions", "head")}}


def destination_problem(destination: Path, run_dir: Path) -> str | None:
    """Why shipping to ``destination`` would destroy something (it is replaced whole), or None: it is missing, empty,
    or a head shipped before (only the files shipping writes, config.json a head's)."""
    if not destination.exists() and not destination.is_symlink():
        return None
    if not destination.is_dir():
        return f"{destination} exists and is not a directory"
    resolved, run = destination.resolve(), run_dir.resolve()
    if resolved == run or resolved in run.parents:
        return f"{destination} holds the training run {run_dir} itself"
    names = {path.name for path in destination.iterdir()}
    if not names:
        return None
    try:
        shipped = (names <= SHIPPED_FILES and CONFIG_NAME in names
                   and json.loads((destination / CONFIG_NAME).read_text()).get("format") == HEAD_FORMAT)
    except (OSError, ValueError):
        shipped = False
    if not shipped:
        return f"{destination} exists and is not a shipped head (it holds {', '.join(sorted(names)[:5])}); shipping " \
               f"there would delete it"
    return None


def run_head_config(run_dir: Path) -> dict:
    """The config of the head a training run saved (``run_dir``/head), or a ValueError saying where it is missing."""
    head_dir = run_dir / "head"
    if not (head_dir / CONFIG_NAME).is_file():
        raise ValueError(f"{head_dir / CONFIG_NAME} is missing: RUN_DIR is a training run's output_dir, which holds "
                         f"head/ once the run has saved a head")
    return read_head_config(head_dir)


def shipped_config(run_dir: Path, config: dict, tree: dict | None = None, sizes: dict[str, int] | None = None,
                   train_seconds: float | None = None, data_command: str | None = None,
                   data_seconds: float | None = None) -> dict:
    """``config`` (the run's head config, completed in place and returned) as it ships: the run's record (command,
    rate, final evaluation, and how a continued run's start was made), the final acceptance as the tree calibration,
    ``tree`` entries (depth, top_k, a measured tree: ``rank_paths_tree``), the verified tree ``sizes`` {dtype name:
    nodes} (replacing the older one-dtype form), the training run's wall time and how its data was made. A
    ValueError for a run that has not finished."""
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise ValueError(f"{summary_path} is missing: ship only a finished run (training writes it at the end)")
    record = run_record(run_dir)
    final = record["final_eval"]
    if final.get("acc"):
        config["tree"]["acceptance"] = final["acc"]
    config["tree"].update(tree or {})
    if sizes:
        for key in ("size", "size_dtype", "tokens", "tokens_dtype"):  # the older one-dtype form
            config["tree"].pop(key, None)
        config["tree"]["sizes"] = sizes
    start = start_record(config)
    if start is not None:  # a continued run: keep how its start was made
        config["training"]["continued_from"] = start
    config["training"].update(record, wall_seconds=train_seconds)
    if data_command:
        config["training"].update(data_command=data_command, data_seconds=data_seconds)
    return config


def write_shipped_head(run_dir: Path, destination: Path, config: dict, dtype: str = "bfloat16") -> Path:
    """The run's head weights in ``dtype`` with ``config`` (``shipped_config``'s) and its curves, written to
    ``destination`` atomically (replacing it whole: check ``destination_problem`` first) -> the directory."""
    weight_dtype = parse_dtype(dtype)
    state = {name: tensor.to(weight_dtype) if tensor.is_floating_point() else tensor
             for name, tensor in load_file(str(run_dir / "head" / WEIGHTS_NAME)).items()}

    def fill(tmp: Path) -> None:
        save_tensors(state, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        curves = run_dir / "curves.png"
        if curves.is_file():
            shutil.copy(curves, tmp / "curves.png")
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")

    return atomic_directory(destination, fill)
