"""Copy a trained head into the package (heads/shipped/NAME) as the default for its target.

    python scripts/ship_head.py runs/smollm2-eagle3 smollm2-135m-eagle3 --train-seconds 4500

Weights are stored in bfloat16 (the runtime casts them to the target's dtype on load). The config keeps everything
the training run recorded and adds the command line, the wall time and the final held-out acceptance, which also
becomes the head's default tree calibration (``tree.acceptance``). A Medusa head's static tree measured by
``scripts/eval_head.py --out REPORT`` ships with ``--rank-paths REPORT`` (``tree.rank_paths``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import yaml
from safetensors.torch import load_file, save_file

from heads.io import CONFIG_NAME, FORMAT as HEAD_FORMAT, WEIGHTS_NAME, atomic_directory, read_head_config
from heads.shipped import SHIPPED_DIR
from runtime.benchmark import dtype_name
from runtime.target import parse_dtype


def tree_sizes(parser, values: list[str], default_dtype: str) -> dict[str, int]:
    """``--tree-size`` values (``N`` or ``DTYPE=N``) as the config's ``tree.sizes``: {dtype name: size}."""
    sizes = {}
    for value in values:
        name, _, size = value.rpartition("=")
        try:
            dtype = dtype_name(name or default_dtype)
            sizes[dtype] = int(size)
        except ValueError as error:
            parser.error(f"argument --tree-size: {value!r}: {error} (give N or DTYPE=N, e.g. bfloat16=6)")
        if sizes[dtype] < 1:
            parser.error(f"argument --tree-size: {value!r}: a tree has at least 1 node")
    return sizes


RECORD_KEYS = ("data_command", "data_seconds", "command", "wall_seconds", "tokens_per_s_median", "final_eval", "note",
               "continued_from")


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
    """The ``tree`` entries of a Medusa tree measured by scripts/eval_head.py (its --out report) for the head of
    ``config``; a SystemExit naming the problem for any other report."""
    from runtime.proposers.medusa import TOP_K, check_rank_paths

    try:
        report = json.loads(report_path.read_text())
        measured = report["tree"]
        paths = [tuple(path) for path in measured["rank_paths"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"--rank-paths {report_path}: not a Medusa report of scripts/eval_head.py --out ({error!r}); "
                         f"measure one with `python scripts/eval_head.py --head HEAD --prompts FILE --out REPORT`") \
            from None
    if config["head_type"] != "medusa":
        raise SystemExit(f"--rank-paths: the head is {config['head_type']}, and only a Medusa head has a static tree")
    try:
        check_rank_paths(paths, config["head_config"]["num_heads"], TOP_K)  # what the runtime loads
    except ValueError as error:
        raise SystemExit(f"--rank-paths {report_path}: {error}") from None
    return {"rank_paths": [list(path) for path in paths],
            "rank_path_frequencies": measured.get("rank_path_frequencies"),
            "rank_paths_measured_on": {key: report.get(key) for key in ("scored_on", "prompts", "positions", "head")}}


SHIPPED_FILES = {CONFIG_NAME, WEIGHTS_NAME, "curves.png"}


def destination_problem(destination: Path, run_dir: Path) -> str | None:
    """Why shipping to ``destination`` would destroy something (it is replaced whole), or None: it is missing, empty,
    or a head shipped before (only the files this script writes, config.json a head's)."""
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="OUTPUT_DIR of a finished training run (holds head/)")
    parser.add_argument("name", help="directory name under heads/shipped, e.g. smollm2-135m-eagle3")
    parser.add_argument("--dtype", default="bfloat16", help="storage dtype of the weights")
    parser.add_argument("--into", type=Path, default=SHIPPED_DIR, help="parent directory (default: heads/shipped)")
    parser.add_argument("--depth", type=int, help="EAGLE: default draft depth of the runtime's tree")
    parser.add_argument("--top-k", type=int, help="EAGLE: default top-k per tree level")
    parser.add_argument("--tree-size", action="append", default=[], metavar="[DTYPE=]N",
                        help="default verified tree size (nodes, root included) in a target dtype, as measured best "
                             "by scripts/tune_tree.py --dtype DTYPE (repeatable: float32=4 --tree-size bfloat16=6; "
                             "plain N: measured in --tree-dtype); a dtype without one gets the cost model's size")
    parser.add_argument("--tree-dtype", default="float32", help="the target dtype of a plain --tree-size N")
    parser.add_argument("--rank-paths", type=Path, metavar="REPORT",
                        help="Medusa: the static tree measured by scripts/eval_head.py --out REPORT for this head")
    parser.add_argument("--train-seconds", type=float, help="wall time of the training run, recorded in the config")
    parser.add_argument("--data-command", help="the command that made the run's training data, recorded in the config "
                                               "(e.g. scripts/prepare_data.py selfdistill ...)")
    parser.add_argument("--data-seconds", type=float, help="wall time of --data-command, recorded in the config")
    args = parser.parse_args(argv)
    sizes = tree_sizes(parser, args.tree_size, args.tree_dtype)

    head_dir = args.run_dir / "head"
    if not (head_dir / CONFIG_NAME).is_file():
        raise SystemExit(f"{head_dir / CONFIG_NAME} is missing: RUN_DIR is a training run's output_dir, which holds "
                         f"head/ once the run has saved a head")
    problem = destination_problem(args.into / args.name, args.run_dir)
    if problem:
        raise SystemExit(f"{problem}; ship to a new NAME or another --into")
    config = read_head_config(head_dir)
    measured_tree = rank_paths_tree(args.rank_paths, config) if args.rank_paths else {}
    summary_path = args.run_dir / "summary.json"
    if not summary_path.is_file():
        raise SystemExit(f"{summary_path} is missing: ship only a finished run (training writes it at the end)")
    record = run_record(args.run_dir)
    final = record["final_eval"]
    if final.get("acc"):
        config["tree"]["acceptance"] = final["acc"]
    for key, value in (("depth", args.depth), ("top_k", args.top_k)):
        if value is not None:
            config["tree"][key] = value
    config["tree"].update(measured_tree)
    if sizes:
        for key in ("size", "size_dtype", "tokens", "tokens_dtype"):  # the older one-dtype form
            config["tree"].pop(key, None)
        config["tree"]["sizes"] = sizes
    start = start_record(config)
    if start is not None:  # a continued run: keep how its start was made
        config["training"]["continued_from"] = start
    config["training"].update(record, wall_seconds=args.train_seconds)
    if args.data_command:
        config["training"].update(data_command=args.data_command, data_seconds=args.data_seconds)
    dtype = parse_dtype(args.dtype)
    state = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
             for name, tensor in load_file(str(head_dir / WEIGHTS_NAME)).items()}

    def fill(tmp: Path) -> None:
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        curves = args.run_dir / "curves.png"
        if curves.is_file():
            shutil.copy(curves, tmp / "curves.png")
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")

    out = atomic_directory(args.into / args.name, fill)
    size = (out / WEIGHTS_NAME).stat().st_size / 2**20
    print(f"shipped {config['head_type']} head to {out} ({size:.1f} MiB, tau {final.get('tau', float('nan')):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
