"""Time the target-distribution table of an EAGLE-3 training step: the fp32 product over the whole vocabulary
against the draft-vocabulary product plus the bf16-screened greedy token (training.vocab_argmax), in one process.

    python scripts/bench_target_logits.py --positions 1200 --draft-vocab 8192 2048

The hidden states are the target's own (its final-norm outputs over MT-bench prompt text), so the screen's
candidates hold the fp32 winner about as often as in training; the draft vocabulary is a random draw of the given
size (which tokens it holds does not change the cost). Reports the median of --repeats runs, the ratio
(above 1: the screen is faster) and the fraction of positions where both find the same greedy token. The training
objective uses the screen only where ``training.vocab_argmax.bf16_screening_pays``. Run it with nothing else on
the machine.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.prompts import read_prompts
from bench.timing import median_ms, run_environment
from runtime.engine.prompts import encode_prompt
from runtime.target.model import load_target
from training.objectives import TargetDistribution, VocabScreen
from training.vocab_argmax import bf16_screening_pays


@torch.inference_mode()
def target_hidden(target, positions: int) -> torch.Tensor:
    """[positions, H]: the target's final hidden states over consecutive MT-bench prompts."""
    ids = torch.cat([encode_prompt(target.tokenizer, record["prompt"]).reshape(-1) for record in read_prompts()])
    ids = ids[:positions][None]
    return target.model.get_decoder()(input_ids=ids).last_hidden_state[0].float()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--positions", type=int, default=1200, help="positions per step (default: about what a "
                                                                     "4-sample batch holds)")
    parser.add_argument("--draft-vocab", type=int, nargs="+", default=[8192, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", help="JSON results file")
    args = parser.parse_args(argv)
    target = load_target(args.target, dtype="float32")
    hidden = target_hidden(target, args.positions)
    weight = target.lm_head.weight.detach().float()
    count = hidden.shape[0]
    batch = {"hidden": hidden[None]}
    positions = torch.ones(1, count, dtype=torch.bool)
    softcap = target.softcap
    rows = []
    print(f"{count} positions; bf16 screening pays here: {bf16_screening_pays(hidden.device)}")
    print("| draft vocab | full fp32 ms | screened ms | ratio | same greedy token |\n|---:|---:|---:|---:|---:|")
    for vocab in args.draft_vocab:
        draft_ids = torch.randperm(weight.shape[0], generator=torch.Generator().manual_seed(0))[:vocab].sort().values
        screen = VocabScreen.of(weight, draft_ids)
        full = median_ms(lambda: TargetDistribution(batch, positions, weight, softcap, draft_ids), args.repeats)
        fast = median_ms(lambda: TargetDistribution(batch, positions, weight, softcap, draft_ids, screen=screen),
                         args.repeats)
        exact = TargetDistribution(batch, positions, weight, softcap, draft_ids).greedy_table
        screened = TargetDistribution(batch, positions, weight, softcap, draft_ids, screen=screen).greedy_table
        same = float((exact == screened).float().mean())
        rows.append({"draft_vocab": vocab, "full_ms": full, "screened_ms": fast, "ratio": full / fast,
                     "same_greedy": same})
        print(f"| {vocab} | {full:.0f} | {fast:.0f} | {full / fast:.2f} | {same:.4f} |")
    if args.output:
        results = {**run_environment(hidden.device), "positions": count, "target": args.target, "rows": rows}
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
