"""Each training lever on one fixed budget: the same recorded store, steps, seed and held-out conversations, one
training run per lever, one table.

    python scripts/levers.py --store runs/sd/store --steps 60 --out runs/levers \
        --results scripts/results/levers_cpu.json

Every run starts from scratch (no init_from) with ``features.mode=recorded`` on ``--store`` (written by
``scripts/prepare_data.py selfdistill --features``), so a lever's row differs from its group's base in that lever
alone. The data-mix lever trains on the ShareGPT replies of the same conversations instead (online features: the
target runs in training), and its head is then scored on the store's held-out self-distilled replies like every
other row, through a one-step run whose evaluation at start is the head's (``eval.at_start``). Runs go one after
another (on a CPU two at once halve each other's speed) and resume: a run whose summary.json exists is not redone.
Acceptance (acc@k, tau) comes from training's held-out evaluation; tokens/s is the run's median.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from runtime.target.assets import write_json_atomically
from runtime.target.machine import machine_description
from training.recorded import RecordedStore

from cli.args import positive_int, usage_error

ROOT = Path(__file__).resolve().parent.parent

# group: (base overrides, {lever: overrides on top of the base}); "{steps}" and "{store}" are filled in
GROUPS = {
    "eagle3": (["head=eagle3", "head.ttt_steps=4", "head.lr=3e-4", "trainer.lr=3e-4"], {
        "base (TTT 4, draft vocab 8192, cosine, soft targets, no noise, self-distilled, fp32)": [],
        "TTT 2": ["head.ttt_steps=2"],
        "TTT 7": ["head.ttt_steps=7"],
        "draft vocab 2048": ["head.draft_vocab_size=2048"],
        "draft vocab 32768": ["head.draft_vocab_size=32768"],
        "constant lr after warm-up": ["trainer.min_lr_ratio=1.0"],
        "hard targets": ["head.targets=hard"],
        "feature noise 0.1": ["head.noise_std=0.1"],
        "bf16 compute": ["trainer.precision=bf16"],
        "ShareGPT replies": ["features.mode=online", "data=sharegpt", "data.max_samples={samples}"],
        "TTT 2 + draft vocab 2048 + bf16": ["head.ttt_steps=2", "head.draft_vocab_size=2048",
                                            "trainer.precision=bf16"],
    }),
    "medusa": (["head=medusa"], {
        "base (shared target LM head)": [],
        "own LM heads": ["head.shared_lm_head=false"],
    }),
}
COMMON = ["trainer.threads={threads}", "trainer.max_steps={steps}", "trainer.warmup_steps=10", "trainer.seed=0",
          "features.mode=recorded", "features.dir={store}", "data.val_samples={val}", "eval.at_start=false",
          "eval.every={steps}", "eval.max_samples={eval_samples}", "eval.depth={eval_depth}", "checkpoint.every=20",
          "resume=true", "tracker=disabled"]
EVAL_DEPTH = 3  # acc@1..3 and tau of a 3-step chain: deeper steps of heads this young accept next to nothing


def slug(name: str) -> str:
    """A lever's run-directory and --only name: "TTT 2 + bf16" -> "ttt-2-bf16"."""
    return re.sub(r"[^a-z0-9]+", "-", name.split(" (")[0].lower()).strip("-")


def train(overrides: list[str], output_dir: Path, log: Path) -> float:
    """Run training/train.py with ``overrides`` into ``output_dir``; its wall seconds."""
    start = time.perf_counter()
    command = [sys.executable, str(ROOT / "training" / "train.py"), *overrides, f"output_dir={output_dir}"]
    with open(log, "a", encoding="utf-8") as handle:
        done = subprocess.run(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"training failed ({done.returncode}); see {log}\n  {' '.join(command)}")
    return time.perf_counter() - start


def first_eval(curves: Path) -> dict:
    """The first row of a run's curves.csv: the evaluation at start, i.e. of its init_from head."""
    with open(curves, encoding="utf-8") as handle:
        row = next(csv.DictReader(handle))
    acc = [float(row[key]) for key in row if key.startswith("acc")]
    return {"tau": float(row["tau"]), "acc": acc}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path, required=True, help="recorded store (prepare_data.py --features)")
    parser.add_argument("--steps", type=positive_int, default=60, help="optimizer steps of every run (the budget)")
    parser.add_argument("--val", type=positive_int, default=32, help="held-out conversations, the same for every run")
    parser.add_argument("--eval-samples", type=positive_int, default=16,
                        help="held-out conversations evaluated at the end of each run (the first of --val)")
    parser.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated of {', '.join(GROUPS)}")
    parser.add_argument("--only", default="", help="comma-separated lever slugs to run (default: all)")
    parser.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path("runs/levers"), help="run directories")
    parser.add_argument("--results", type=Path, required=True, help="JSON to write (the table's data)")
    args = parser.parse_args(argv)
    groups = [name for name in args.groups.split(",") if name]
    for name in groups:
        if name not in GROUPS:
            raise usage_error("--groups", f"{name!r}: choose from {', '.join(GROUPS)}")
    only = {name for name in args.only.split(",") if name}
    known = {slug(lever) for group in groups for lever in GROUPS[group][1]}
    if only - known:
        raise usage_error("--only", f"{', '.join(sorted(only - known))}: choose from {', '.join(sorted(known))}")
    try:
        samples = len(RecordedStore(args.store, max_length=512).keys)
    except (OSError, ValueError) as error:
        raise usage_error("--store", str(error)) from None
    fill = {"steps": args.steps, "store": args.store.resolve(), "val": args.val, "threads": args.threads,
            "samples": samples, "eval_samples": args.eval_samples, "eval_depth": EVAL_DEPTH}
    config = {"store": str(args.store), "store_samples": samples, "steps": args.steps, "val_samples": args.val,
              "eval_samples": args.eval_samples, "eval_depth": EVAL_DEPTH, "threads": args.threads,
              "torch": torch.__version__, "machine": machine_description(torch.device("cpu")), "common": COMMON,
              "bases": {name: GROUPS[name][0] for name in groups}}
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for group in groups:
        for lever in GROUPS[group][1]:
            if not only or slug(lever) in only:
                print(f"{group}: {lever}", flush=True)
                rows.append(run_lever(group, lever, fill, args.out))
                write_json_atomically(args.results, {"rows": rows, "config": config})
    print(markdown_table(rows))
    return 0


def run_lever(group: str, lever: str, fill: dict, out: Path) -> dict:
    """Train (unless done) and score one lever's run; its row of the table."""
    base, levers = GROUPS[group]
    extra = [text.format(**fill) for text in levers[lever]]
    common = [text.format(**fill) for text in [*base, *COMMON]]
    online = "features.mode=online" in extra  # the data-mix lever: online features in place of the store's
    overrides = [o for o in common if not (online and o.startswith(("features.mode=", "features.dir=")))] + extra
    run = out / f"{group}-{slug(lever)}"
    if not (run / "summary.json").is_file():
        seconds = train(overrides, run, out / f"{run.name}.log")
        (run / "wall_seconds").write_text(f"{seconds:.1f}\n")
    summary = json.loads((run / "summary.json").read_text())
    final = summary["final_eval"]
    scored = {"tau": final["tau"], "acc": final["acc"]}
    if online:  # scored on the store's held-out self-distilled replies, like every other row
        scoring = out / f"{run.name}-scored"
        if not (scoring / "summary.json").is_file():
            score = [o for o in common if not o.startswith(("trainer.max_steps=", "eval.at_start="))]
            train([*score, "trainer.max_steps=1", "eval.at_start=true", f"init_from={run / 'head'}"], scoring,
                  out / f"{scoring.name}.log")
        scored = first_eval(scoring / "curves.csv")
    return {"group": group, "lever": lever, "overrides": extra, "steps": summary["steps"],
            "tokens": final.get("tokens"), "tokens_per_s": summary["tokens_per_s_median"],
            "wall_seconds": float((run / "wall_seconds").read_text()), "acc": scored["acc"], "tau": scored["tau"]}


def markdown_table(rows: list[dict]) -> str:
    lines = ["| head | lever | tokens | tokens/s | acc@1 | acc@2 | acc@3 | tau |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        acc = (row["acc"] + [float("nan")] * 3)[:3]
        lines.append(f"| {row['group']} | {row['lever']} | {row['tokens']} | {row['tokens_per_s']:.0f} | "
                     + " | ".join(f"{a:.3f}" for a in acc) + f" | {row['tau']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
