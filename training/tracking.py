"""Experiment tracking: W&B (offline by default, files in the run directory) plus curves.csv and curves.png.

Only the main process tracks. The acceptance history is the list of evaluations, each
{"step", "tokens" (trained on so far), "tau", "val_loss", "acc": [acc@1..K], "decoding_tau"} ("decoding_tau": the
chain's tokens per pass as greedy decoding gets it, ``training.metrics.decoding_tau``; absent from histories written
before it was measured); it travels in the checkpoint so a resumed run keeps its curves.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path


def write_curves(history: list[dict], run_dir: Path) -> tuple[Path, Path]:
    """Write curves.csv (one row per evaluation) and curves.png (acceptance per draft step; tau over steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depth = max(len(entry["acc"]) for entry in history)
    csv_path, png_path = run_dir / "curves.csv", run_dir / "curves.png"
    partial = csv_path.with_name(csv_path.name + ".partial")
    with open(partial, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", "tau", "val_loss"] + [f"acc@{k}" for k in range(1, depth + 1)]
                        + ["tokens", "decoding_tau"])
        for entry in history:
            acc = [f"{value:.4f}" for value in entry["acc"]] + [""] * (depth - len(entry["acc"]))
            decoding = f"{entry['decoding_tau']:.4f}" if "decoding_tau" in entry else ""
            writer.writerow([entry["step"], f"{entry['tau']:.4f}", f"{entry['val_loss']:.5f}"] + acc
                            + [entry.get("tokens", ""), decoding])
    os.replace(partial, csv_path)

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    colors = plt.cm.viridis([i / max(len(history) - 1, 1) for i in range(len(history))])
    for entry, color in zip(history, colors):
        left.plot(range(1, len(entry["acc"]) + 1), entry["acc"], marker="o", color=color,
                  label=f"step {entry['step']}")
    left.set(xlabel="draft step k", ylabel="acc@k (given the accepted prefix)", ylim=(0, 1),
             title="acceptance per draft step")
    left.legend(fontsize=7, loc="upper right")
    right.plot([e["step"] for e in history], [e["tau"] for e in history], marker="o", label="every position")
    decoded = [e for e in history if "decoding_tau" in e]
    if decoded:
        right.plot([e["step"] for e in decoded], [e["decoding_tau"] for e in decoded], marker="s", linestyle="--",
                   label="as decoding gets it")
        right.legend(fontsize=7)
    right.set(xlabel="training step", ylabel="expected accepted length tau", title="tau (greedy chain)")
    figure.tight_layout()
    partial_png = png_path.with_name("curves.partial.png")
    figure.savefig(partial_png, dpi=100)
    plt.close(figure)
    os.replace(partial_png, png_path)
    return csv_path, png_path


class Tracker:
    def __init__(self, conf, run_dir: Path, config: dict, enabled: bool, run_id: str | None = None):
        self.run_dir = run_dir
        self.enabled = enabled
        self.run = None
        if not enabled or conf.kind == "disabled":
            return
        wandb_dir = run_dir / "wandb"
        for name, sub in (("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"), ("WANDB_DATA_DIR", "data"),
                          ("WANDB_ARTIFACT_DIR", "artifacts")):
            (wandb_dir / sub).mkdir(parents=True, exist_ok=True)
            os.environ[name] = str(wandb_dir / sub)
        os.environ["WANDB_DIR"] = str(run_dir)
        os.environ["WANDB_MODE"] = conf.mode
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self.run = wandb.init(project=conf.project, name=conf.name, dir=str(run_dir), config=config,
                              mode=conf.mode, id=run_id, resume="allow")

    @property
    def run_id(self) -> str | None:
        return None if self.run is None else self.run.id

    def log(self, metrics: dict, step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def log_evaluation(self, history: list[dict], step: int) -> None:
        if not self.enabled:
            return
        _, png_path = write_curves(history, self.run_dir)
        if self.run is None:
            return
        import wandb

        latest = history[-1]
        metrics = {f"eval/acc@{k}": value for k, value in enumerate(latest["acc"], 1)}
        metrics.update({"eval/tau": latest["tau"], "eval/val_loss": latest["val_loss"],
                        "eval/acceptance_curve": wandb.Image(str(png_path))})
        if "decoding_tau" in latest:
            metrics["eval/decoding_tau"] = latest["decoding_tau"]
        table = wandb.Table(columns=["draft_step", "acc"], data=[[k, v] for k, v in enumerate(latest["acc"], 1)])
        metrics["eval/acceptance_table"] = wandb.plot.line(table, "draft_step", "acc",
                                                           title=f"acceptance per draft step (step {step})")
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def read_curves(path: Path) -> list[dict]:
    """curves.csv (``write_curves``) back as history entries; rows without a token count are skipped."""
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    entries = []
    for row in rows:
        if not row.get("tokens"):
            continue
        acc = [float(row[key]) for key in row if key.startswith("acc@") and row[key]]
        entries.append({"step": int(row["step"]), "tokens": int(row["tokens"]), "tau": float(row["tau"]),
                        "val_loss": float(row["val_loss"]), "acc": acc})
        if row.get("decoding_tau"):
            entries[-1]["decoding_tau"] = float(row["decoding_tau"])
    return entries


def plot_learning_curves(curves: dict[str, tuple[list[dict], int]], path: Path, depth: int = 3,
                         title: str = "") -> Path:
    """Held-out acc@1..``depth`` and tau against training tokens (log axis): one panel per figure, one colour per run.

    curves: {label: (history entries, tokens the head had trained on before the run)}: a run continuing a trained
    head starts at its earlier budget, so its first point is the head it started from. Where a run's entries have
    ``decoding_tau`` it is drawn dashed beside the chain's tau."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 2
    rows = (depth + 1 + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(10, 3.4 * rows), squeeze=False)
    panels = list(axes.flat)
    for index, (label, (history, offset)) in enumerate(curves.items()):
        if offset == 0:  # a head trained from scratch: its untrained start has no place on a log axis
            history = [entry for entry in history if entry["tokens"] > 0]
        tokens = [offset + entry["tokens"] for entry in history]
        if not tokens or min(tokens) <= 0:
            raise ValueError(f"{label}: a log axis needs positive token counts; give the head's earlier budget")
        color = plt.cm.tab10(index % 10)
        for k in range(depth):
            panels[k].plot(tokens, [entry["acc"][k] if len(entry["acc"]) > k else float("nan") for entry in history],
                           marker="o", markersize=3, color=color, label=label)
        walked = any("decoding_tau" in entry for entry in history)
        panels[depth].plot(tokens, [entry["tau"] for entry in history], marker="o", markersize=3, color=color,
                           label=f"{label}: chain" if walked else label)
        if walked:
            panels[depth].plot(tokens, [entry.get("decoding_tau", float("nan")) for entry in history], "--",
                               marker="o", markersize=3, color=color, label=f"{label}: as decoding gets it")
    for k in range(depth):
        panels[k].set(xscale="log", xlabel="training tokens", ylabel=f"held-out acc@{k + 1}",
                      title=f"draft step {k + 1} accepted, given {'step 1' if k == 1 else f'steps 1-{k}'}" if k
                      else "draft step 1 accepted")
    panels[depth].set(xscale="log", xlabel="training tokens", ylabel="tau (greedy chain)",
                      title="tokens per target pass")
    for panel in panels[depth + 1:]:
        panel.axis("off")
    for panel in panels[:depth + 1]:
        panel.grid(alpha=0.3)
        panel.legend(fontsize=7)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    partial = path.with_name(path.stem + ".partial" + path.suffix)
    figure.savefig(partial, dpi=100)
    plt.close(figure)
    os.replace(partial, path)
    return path
