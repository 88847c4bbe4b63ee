"""A peer trainer on our data: an EAGLE-3 head trained by ``economize`` (``pip install -e ".[peers]"``) for the
same target, on the same conversations, batch for batch as ``training/train.py`` would see them, then written in
vLLM's EAGLE-3 layout so ``scripts/eval_head.py`` scores it exactly as it scores ours.

    python scripts/peer_train_economize.py --data FILE --max-samples N --steps S --out DIR
    python scripts/eval_head.py --head DIR/eagle3 --data FILE --max-samples N

Matched to ``python training/train.py head=eagle3 data=selfdistill data.path=FILE data.max_samples=N
head.lr=LR trainer.lr=LR trainer.max_steps=S`` (online features): the train / held-out split, sample order and
collation (our ``build_splits``, ``SampleOrder``, ``collate``); fused layers; the draft vocabulary (ours, from the
training split); 7 unrolled steps with decay 0.8; AdamW betas (0.9, 0.95), no weight decay; gradient clipping on our
loss's scale (economize's loss is ours divided by the sum of the decays); the learning-rate schedule as our DeepSpeed
engine steps it. Not matched: economize draws its own initial weights and optimizes with plain torch AdamW.
Tokens per step (the sum of unpadded sequence lengths, what our run's curves call tokens) go to DIR/tokens.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from heads.export import export_head
from heads.formats import load_any_head

from cli.args import positive_int

class HeadstartOrderSource:
    """economize BatchSource yielding exactly the micro-batches our recipe trains on (SampleOrder + collate), with
    economize's loss_mask (position j counts when token j+1 is an assistant token) and per-step token counts."""

    def __init__(self, split, pad_id: int, micro: int, accum: int, seed: int):
        from training.data import SampleOrder

        self.split, self.pad_id, self.micro, self.accum = split, pad_id, micro, accum
        self.order = SampleOrder(len(split), seed)
        self.consumed = 0
        self.records: list[dict] = []
        self.stamps: list[float] = []

    def micro_samples(self, consumed: int):
        step, index = divmod(consumed, self.accum)
        indices, _ = self.order.micro_batch(step, index, 0, 1, self.micro, self.accum)
        return step, indices

    def next_batch(self):
        from economize.train import Batch
        from training.data import collate
        from training.masks import next_token_mask

        step, indices = self.micro_samples(self.consumed)
        batch = collate([self.split[i] for i in indices], self.pad_id)
        ids, assistant, lengths = batch["input_ids"], batch["assistant_mask"], batch["lengths"]
        attention = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
        loss_mask = next_token_mask(assistant).long()
        self.consumed += 1
        self.stamps.append(time.perf_counter())
        self.records.append({"step": step, "seq_tokens": int(lengths.sum()), "assistant_tokens": int(assistant.sum()),
                             "loss_positions": int(assistant[:, 2:].sum())})
        return Batch(ids, attention if bool((attention == 0).any()) else None, loss_mask)

    def state_dict(self):
        return {"consumed": self.consumed}

    def load_state_dict(self, state):
        self.consumed = int(state["consumed"])


def headstart_schedule(run_steps: int, schedule_steps: int, warmup: int, min_ratio: float):
    """economize schedule function reproducing our engine's DeepSpeed WarmupCosineLR (training/engine.py) as
    DeepSpeed steps it: optimizer step s runs at the ratio of scheduler iteration s - 1 (iteration -1: 0)."""
    total = max(schedule_steps, 2)
    warm = max(2, max(1, min(warmup, schedule_steps - 1)))  # engine clamps, WarmupCosineLR raises to >= 2

    def ratio(iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < warm:
            return iteration / warm
        progress = min(1.0, (iteration - warm + 1) / max(1, total - warm))
        return max(0.0, min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def factor(progress: float, _min_lr_ratio: float) -> float:
        step = round(progress * max(run_steps, 1))  # economize passes step / run_steps
        return ratio(step - 1)

    return factor


def export_economize_eagle3(checkpoint: Path, out: Path, target) -> Path:
    """economize's checkpoint (read by ``heads.formats.load_any_head``, its ``economize`` layout) written in vLLM's
    EAGLE-3 layout, which ``scripts/eval_head.py`` and the other engines load."""
    head, _ = load_any_head(checkpoint, target.model, identity=target.identity, tokenizer=target.tokenizer)
    return export_head(head, out, fmt="vllm")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="JSONL of conversations (data=selfdistill)")
    parser.add_argument("--max-samples", type=positive_int, help="data.max_samples")
    parser.add_argument("--val-samples", type=positive_int, default=32, help="data.val_samples")
    parser.add_argument("--max-length", type=positive_int, default=512, help="data.max_length")
    parser.add_argument("--data-seed", type=int, default=0, help="data.seed")
    parser.add_argument("--steps", type=positive_int, required=True, help="optimizer steps (trainer.max_steps)")
    parser.add_argument("--micro-batch", type=positive_int, default=4, help="trainer.micro_batch_size")
    parser.add_argument("--seed", type=int, default=0, help="trainer.seed")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=20, help="trainer.warmup_steps")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="trainer.min_lr_ratio")
    parser.add_argument("--grad-clip", type=float, default=0.5, help="head.grad_clip (on our loss's scale)")
    parser.add_argument("--draft-vocab", type=positive_int, default=8192, help="head.draft_vocab_size")
    parser.add_argument("--ttt-steps", type=positive_int, default=7, help="head.ttt_steps")
    parser.add_argument("--decay", type=float, default=0.8, help="head.loss_decay")
    parser.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, required=True, help="run directory (the head lands in OUT/eagle3)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import economize
    from economize.techniques.eagle3 import Eagle3Config, Eagle3TTT, default_aux_layers
    from economize.train import fit
    from economize.train.schedule import SCHEDULES

    from runtime.target.model import DEFAULT_TARGET, load_target
    from training.config import DataConf
    from training.data import build_splits, pad_token_id
    from training.draft_vocab import build_draft_vocab, count_tokens, draft_to_target_ids

    target = load_target(DEFAULT_TARGET, dtype="float32")
    data_conf = DataConf(source="json", path=str(args.data), max_samples=args.max_samples,
                         val_samples=args.val_samples, max_length=args.max_length, seed=args.data_seed, cache=False)
    train_split = build_splits(data_conf, target.tokenizer)["train"]
    layers = tuple(default_aux_layers(int(target.config.num_hidden_layers)))  # ours too: 2, L // 2, L - 3
    counts = count_tokens(train_split["input_ids"], train_split["assistant_mask"], int(target.vocab_size))
    d2t, _ = build_draft_vocab(counts, args.draft_vocab)
    torch.manual_seed(args.seed)
    model = economize.apply(target.model, Eagle3Config(aux_layers=layers, head="own", draft_vocab=args.draft_vocab,
                                                       train_steps=args.ttt_steps))
    technique = model.techniques["eagle3"]
    technique.set_draft_vocab(draft_to_target_ids(d2t), copy_head=True)  # LM head rows from the target, as ours

    source = HeadstartOrderSource(train_split, pad_token_id(target.tokenizer), args.micro_batch, 1, args.seed)
    SCHEDULES.register("headstart_ds_cosine", headstart_schedule(args.steps, args.steps, args.warmup,
                                                                 args.min_lr_ratio), override=True)
    clip = args.grad_clip / sum(args.decay ** i for i in range(args.ttt_steps))
    started = time.perf_counter()
    result = fit(model, source, Eagle3TTT(steps=args.ttt_steps, step_decay=args.decay, divergence="kl"),
                 steps=args.steps, seed=args.seed, log_every=10, output_dir=args.out / "economize_run",
                 lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95), grad_clip=clip, schedule="headstart_ds_cosine",
                 warmup_steps=0, min_lr_ratio=args.min_lr_ratio)
    seconds = time.perf_counter() - started

    tokens, total = [], 0
    for record in source.records:
        total += record["seq_tokens"]
        tokens.append({"step": record["step"] + 1, "tokens": total})
    (args.out / "tokens.jsonl").write_text("".join(json.dumps(row) + "\n" for row in tokens))
    rates = [record["seq_tokens"] / (b - a) for record, a, b in zip(source.records, source.stamps,
                                                                    source.stamps[1:]) if b > a]
    head_dir = export_economize_eagle3(Path(result.final_path), args.out / "eagle3", target)
    summary = {"economize": economize.__version__, "target": target.identity, "steps": result.steps,
               "tokens": total, "seconds": seconds, "tokens_per_s_median": statistics.median(rates) if rates else None,
               "loss_first_last": [result.losses[0], result.losses[-1]] if result.losses else None,
               "head": str(head_dir), "threads": args.threads}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
