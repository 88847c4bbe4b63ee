"""Plot held-out acceptance (acc@1..K) and tau against training tokens, on a log axis, for one or more runs.

    python scripts/plot_learning_curve.py --output scripts/results/learning_curve_eagle3.png \
        --curve "EAGLE-3 on recorded features=runs/eagle3-recorded/curves.csv@2400000"

Each --curve is LABEL=CURVES_CSV[@TOKENS]: a run's curves.csv (written by training, with its tokens column) and the
tokens its head had trained on before the run (init_from: the earlier stages' budget; default 0). The plotting is
training.tracking.plot_learning_curves.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from training.tracking import plot_learning_curves, read_curves

from cli.args import usage_error


def parse_curve(text: str) -> tuple[str, Path, int]:
    label, separator, rest = text.partition("=")
    if not separator or not label:
        raise usage_error("--curve", f"{text!r} is not LABEL=CURVES_CSV[@TOKENS]")
    path, _, offset = rest.partition("@")
    if not Path(path).is_file():
        raise usage_error("--curve", f"{path}: no such file (a run directory's curves.csv)")
    try:
        tokens = int(float(offset)) if offset else 0
    except ValueError:
        raise usage_error("--curve", f"{offset!r} is not a token count") from None
    return label, Path(path), tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--curve", action="append", required=True, help="LABEL=CURVES_CSV[@TOKENS] (repeatable)")
    parser.add_argument("--output", type=Path, required=True, help="PNG to write")
    parser.add_argument("--depth", type=int, default=3, help="draft steps to plot (acc@1..K)")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    curves = {}
    for text in args.curve:
        label, path, tokens = parse_curve(text)
        history = read_curves(path)
        if not history:
            raise usage_error("--curve", f"{path} has no rows with a token count (written before tokens were kept)")
        curves[label] = (history, tokens)
    print(plot_learning_curves(curves, args.output, args.depth, args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
