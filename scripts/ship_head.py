"""Copy a trained head into the package (heads/shipped/NAME) as the default for its target.

    python scripts/ship_head.py runs/smollm2-eagle3 smollm2-135m-eagle3 --train-seconds 4500

Weights are stored in bfloat16 (the runtime casts them to the target's dtype on load). The config keeps everything
the training run recorded and adds the command line, the wall time and the final held-out acceptance, which also
becomes the head's default tree calibration (``tree.acceptance``). A Medusa head's static tree measured by
``scripts/eval_head.py --out REPORT`` ships with ``--rank-paths REPORT`` (``tree.rank_paths``). The shipping itself
is ``training.ship``'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.methods import dtype_name
from heads.io import WEIGHTS_NAME
from heads.shipped import SHIPPED_DIR
from training.ship import destination_problem, rank_paths_tree, run_head_config, shipped_config, write_shipped_head


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

    try:
        config = run_head_config(args.run_dir)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    destination = args.into / args.name
    problem = destination_problem(destination, args.run_dir)
    if problem:
        raise SystemExit(f"{problem}; ship to a new NAME or another --into")
    tree = {key: value for key, value in (("depth", args.depth), ("top_k", args.top_k)) if value is not None}
    if args.rank_paths:
        try:
            tree.update(rank_paths_tree(args.rank_paths, config))
        except ValueError as error:
            raise SystemExit(f"--rank-paths {error}") from None
    try:
        config = shipped_config(args.run_dir, config, tree, sizes, args.train_seconds, args.data_command,
                                args.data_seconds)
        out = write_shipped_head(args.run_dir, destination, config, args.dtype)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    final = config["training"]["final_eval"]
    size = (out / WEIGHTS_NAME).stat().st_size / 2**20
    print(f"shipped {config['head_type']} head to {out} ({size:.1f} MiB, tau {final.get('tau', float('nan')):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
