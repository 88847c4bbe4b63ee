"""Prepare training data once, ahead of training runs.

  features     dump the target's features (hidden states, EAGLE-3 layer inputs, optional top-k log-probs) for the
               training split to sharded safetensors, exactly where `features.mode=offline` runs look for them:
                 python scripts/prepare_data.py features head=eagle3 data.max_samples=2000 [features.topk=32]
  selfdistill  regenerate the assistant turns with the target itself (greedy, batched, resumable) into a JSONL
               that `data=selfdistill data.path=FILE` selects:
                 python scripts/prepare_data.py selfdistill --out sd.jsonl --max-new-tokens 256 data.max_samples=500

Trailing key=value arguments are the training config's overrides (target, data, head, features, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from training.config import compose_config  # noqa: E402


def dump_features(overrides: list[str]) -> None:
    from training import engine as ds
    from training.data import load_splits
    from training.run import load_target_once, pad_token_id, prepare_offline_store, resolve_feature_layers

    conf = compose_config(overrides + ["features.mode=offline"])
    dist = ds.setup_distributed(conf.trainer.device, conf.trainer.threads)
    target = load_target_once(conf, dist)
    splits = load_splits(conf.data, target.tokenizer, dist.is_main, ds.barrier)
    layers = resolve_feature_layers(conf, target.num_layers)
    store = prepare_offline_store(conf, target, splits["train"], layers, pad_token_id(target.tokenizer), dist)
    if dist.is_main:
        print(f"offline features of {len(splits['train'])} samples in {store}")


def encode_prompts(tokenizer, prompts: list[str], max_length: int):
    """A left-padded batch of chat prompts ([B, T] ``input_ids`` and ``attention_mask``, T <= max_length) for
    ``generate``. A prompt longer than ``max_length`` loses its start, not its end: the end is the generation prompt
    that the reply follows. A tokenizer without a pad token pads with its end-of-sequence token."""
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer(prompts, return_tensors="pt", padding=True, truncation=True, max_length=max_length,
                     add_special_tokens=False)


def self_distill(out: Path, max_new_tokens: int, batch_size: int, max_turns: int, overrides: list[str]) -> None:
    """Replace every assistant turn (up to ``max_turns`` per conversation) by the target's greedy reply to the
    conversation so far (its own earlier replies included). Appends to ``out``; conversations already there are
    skipped, so an interrupted run resumes."""
    from runtime.target import load_target
    from training.data import collect_conversations

    conf = compose_config(overrides)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = conf.target.dtype if conf.target.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    target = load_target(conf.target.name, dtype=dtype, device=device,
                         trust_remote_code=conf.target.trust_remote_code, attn_implementation="sdpa")
    tokenizer = target.tokenizer
    conversations = collect_conversations(conf.data)
    done = set()
    if out.is_file():
        with open(out, encoding="utf-8") as handle:
            done = {json.loads(line)["id"] for line in handle if line.strip()}
    todo = [(index, c) for index, c in enumerate(conversations) if index not in done]
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(conversations), initial=len(conversations) - len(todo), desc="self-distilling", unit="conv")
    eos = sorted(target.eos_token_ids)
    with open(out, "a", encoding="utf-8") as sink:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start: start + batch_size]
            # keep each conversation up to its max_turns-th assistant turn; replies are rebuilt turn by turn
            results = [[] for _ in chunk]
            pending = [[m for m in c] for _, c in chunk]
            for _turn in range(max_turns):
                prompts, rows = [], []
                for row, messages in enumerate(pending):
                    while messages and messages[0]["role"] != "assistant":
                        results[row].append(messages.pop(0))
                    if messages and results[row]:
                        messages.pop(0)  # the original reply, replaced below
                        prompts.append(tokenizer.apply_chat_template(results[row], tokenize=False,
                                                                     add_generation_prompt=True))
                        rows.append(row)
                if not prompts:
                    break
                encoded = encode_prompts(tokenizer, prompts, conf.data.max_length).to(device)
                with torch.no_grad():
                    generated = target.model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False,
                                                      eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
                replies = tokenizer.batch_decode(generated[:, encoded["input_ids"].shape[1]:],
                                                 skip_special_tokens=True)
                for row, reply in zip(rows, replies):
                    results[row].append({"role": "assistant", "content": reply.strip()})
            for (index, _), messages in zip(chunk, results):
                while messages and messages[-1]["role"] != "assistant":
                    messages.pop()  # end on the last regenerated reply
                if messages:
                    sink.write(json.dumps({"id": index, "messages": messages}, ensure_ascii=False) + "\n")
            sink.flush()
            os.fsync(sink.fileno())  # a finished batch survives a kill
            bar.update(len(chunk))
    bar.close()
    print(f"self-distilled conversations in {out}; train on them with data=selfdistill data.path={out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    features = sub.add_parser("features", help="dump target features for features.mode=offline")
    features.add_argument("overrides", nargs="*", help="training config overrides (key=value)")
    distill = sub.add_parser("selfdistill", help="regenerate assistant turns with the target")
    distill.add_argument("--out", type=Path, required=True, help="output JSONL (appended; resumable)")
    distill.add_argument("--max-new-tokens", type=int, default=256)
    distill.add_argument("--batch-size", type=int, default=8)
    distill.add_argument("--max-turns", type=int, default=1, help="assistant turns regenerated per conversation")
    distill.add_argument("overrides", nargs="*", help="training config overrides (key=value): target, data")
    args = parser.parse_args()
    if args.command == "features":
        dump_features(args.overrides)
    else:
        self_distill(args.out, args.max_new_tokens, args.batch_size, args.max_turns, args.overrides)


if __name__ == "__main__":
    main()
