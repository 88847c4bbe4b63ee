"""Speculative generation from the command line.

    python scripts/generate.py --proposer ngram --prompt "Write a haiku about rain." --max-new-tokens 64
    python scripts/generate.py --proposer eagle --head runs/eagle/head --prompts prompts.jsonl
    python scripts/generate.py --prompts prompts.jsonl --temperature 1 --seed 7 --samples 4 --stop "###"
    python scripts/generate.py --prompts prompts.jsonl --batch-size 8

Writes one JSON line per generation to --output (and prints the text): {"id", "prompt", "output_ids", "text",
"accept_lengths", "target_forwards", "seconds"}, plus "sample" (0, 1, ...) with --samples above 1. Each sample of
each prompt draws from its own random stream, derived from --seed, the prompt's position and the sample's number
(runtime.engine.prompts.prompt_seed): a prompt repeated in the file gives independent samples, and a rerun gives the
same. Generation stops at the target's EOS, at the chat template's end-of-turn tokens and once the text contains a
--stop string. The proposer spellings are parsed by cli/args.py into a runtime.proposers.ProposerSpec.

--batch-size N decodes N generations together (runtime.engine.batched.BatchedDecoder: continuous batching, each output
the same as decoded alone, the same seeds); "seconds" is each generation's own time from its prefill to its last
token, overlapping the others'.

Nothing is lost: each generation is written as it finishes to OUTPUT.partial (flushed), and once every one is done
OUTPUT gets them all in input order; a run that dies leaves OUTPUT as it was and the finished ones in OUTPUT.partial.
An existing OUTPUT is replaced only with --force. Every prompt is checked against the context before the first
generation starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from tqdm import tqdm

from runtime.engine.batched import BatchedDecoder
from runtime.engine.decoder import SpeculativeDecoder, check_prompt_length
from runtime.engine.prompts import TextStream, encode_prompt, end_of_turn_token_ids, prompt_seed
from runtime.target.model import DEFAULT_TARGET

from cli.args import (load_target_or_exit, PROPOSER_CHOICES, build_proposer_or_exit, check_context,
                      check_head_directories, check_new_output, cuda_graphs, device, non_negative_float, parse_proposer,
                      positive_int, probability, read_prompts_or_exit, usage_error)


def stop_text(text: str) -> str:
    """argparse ``type=`` of --stop: a non-empty string (an empty one would stop before the first token)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty stop string would end every output at once; give some text")
    return text


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, help="HF id, local dir, .gguf file or alias")
    parser.add_argument("--proposer", default="ngram", metavar="{" + ",".join(PROPOSER_CHOICES) + "}",
                        help="none, ngram, draft (--draft-model), or a head: medusa, eagle, eagle3, dflash (--head, or "
                             "HEAD:DIR); HEAD+ngram drafts by prompt lookup where it finds a match, by the head "
                             "elsewhere; lookahead (lookahead decoding: n-grams from the target's own Jacobi "
                             "guesses), lookahead+ngram (prompt lookup first, lookahead elsewhere), either as "
                             "lookahead:W,N,G[,R[,C[,P]]] for a window of W, n-grams of N tokens, at most G "
                             "candidates, R recycled nodes, C=0 to keep recycled successors per generation, not across "
                             "greedy generations, and P=0 to draft without the target's successor prior "
                             "(default: sizes chosen from this machine's cost curve, C=1, P=1)")
    parser.add_argument("--draft-model", help="draft model for --proposer draft")
    parser.add_argument("--head", help="trained head directory for --proposer medusa/eagle/eagle3/dflash")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="one prompt (a user turn)")
    source.add_argument("--prompts", help="JSONL with a 'prompt' field or MT-bench 'turns'")
    parser.add_argument("--limit", type=positive_int, help="use only the first N prompts")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--temperature", type=non_negative_float, default=0.0)
    parser.add_argument("--top-k", type=positive_int)
    parser.add_argument("--top-p", type=probability)
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the run; each sample of each prompt gets its own stream derived from it")
    parser.add_argument("--samples", type=positive_int, default=1,
                        help="samples per prompt (needs --temperature above 0); records get a 'sample' field")
    parser.add_argument("--stop", action="append", type=stop_text, metavar="TEXT",
                        help="end an output once its text contains TEXT (repeatable; the tokens up to the one that "
                             "completes TEXT are kept)")
    parser.add_argument("--tree-size", type=positive_int,
                        help="verification tree size (default: from the cost curve)")
    parser.add_argument("--attention", default="auto", choices=("auto", "sdpa", "flex", "cascade"),
                        help="tree-attention backend (auto: flash-attn cascade on CUDA when installed, else SDPA)")
    parser.add_argument("--acceptance", default="exact", choices=("exact", "typical"),
                        help="exact (lossless, default) or typical (Medusa's typical acceptance: LOSSY, faster)")
    parser.add_argument("--batch-size", type=positive_int, default=1,
                        help="generations decoded together (continuous batching; outputs as decoded one at a time)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cpu", type=device)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="verify at fixed shapes, each captured once as a CUDA graph and replayed (--device cuda)")
    parser.add_argument("--output", help="JSONL output file (written once every generation is done; as they finish "
                                         "to OUTPUT.partial)")
    parser.add_argument("--force", action="store_true", help="replace an existing --output once the run succeeds")
    return parser.parse_args(argv)


def check_args(args, spec) -> None:
    """Mistakes that involve several flags or the file system, found before anything loads (``spec``: the parsed
    --proposer)."""
    if args.samples > 1 and args.temperature == 0:
        raise usage_error("--samples", f"{args.samples} samples at --temperature 0 would be one greedy output "
                                       f"{args.samples} times; sample with --temperature above 0 (e.g. 1)")
    if args.draft_model and spec.name != "draft":
        raise usage_error("--draft-model", f"is for --proposer draft, not {args.proposer!r}; drop it, or use "
                                           "--proposer draft")
    check_new_output(args.output, args.force)
    check_context(args.target, args.max_new_tokens)


def read_inputs(args) -> list[dict]:
    """[{"id", "prompt"}]: the --prompt, or the --prompts file (MT-bench without either)."""
    if args.prompt is not None:
        return [{"id": 0, "prompt": args.prompt}]
    return read_prompts_or_exit(args.prompts, args.limit)


def print_streamed(chunks, tokenizer):
    """Print a generation's text as its tokens are accepted; returns its GenerationResult (the iterator's value)."""
    text = TextStream(tokenizer)
    while True:
        try:
            chunk = next(chunks)
        except StopIteration as finished:
            print(text.finish(), flush=True)
            return finished.value
        print(text.push(chunk), end="", flush=True)


class Output:
    """The --output file, written without losing anything: records go to ``PATH.partial`` as generations finish
    (each flushed to disk), and ``PATH`` is replaced by all of them in input order only once every one is done."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.records: dict[tuple[int, int], dict] = {}
        self.sink = None
        if self.path is not None:
            self.partial = self.path.with_name(self.path.name + ".partial")
            self.sink = open(self.partial, "w", encoding="utf-8")

    def add(self, position: tuple[int, int], record: dict) -> None:
        self.records[position] = record
        if self.sink is not None:
            self.sink.write(json.dumps(record) + "\n")
            self.sink.flush()
            os.fsync(self.sink.fileno())

    def finish(self) -> None:
        """All generations done: ``PATH`` holds them in input order (replaced atomically); the partial file goes."""
        if self.sink is None:
            return
        self.sink.close()
        done = self.path.with_name(self.path.name + ".done")
        done.write_text("".join(json.dumps(self.records[key]) + "\n" for key in sorted(self.records)))
        os.replace(done, self.path)
        self.partial.unlink()
        print(f"wrote {self.path.resolve()}", file=sys.stderr)

    def abandon(self) -> None:
        """The run died: ``PATH`` is untouched, and what finished is in the partial file."""
        if self.sink is None:
            return
        self.sink.close()
        if self.records:
            print(f"[headstart] the run stopped; the {len(self.records)} generations that finished are in "
                  f"{self.partial} ({self.path} is as it was)", file=sys.stderr)
        else:
            self.partial.unlink()


def encoded_runs(args, prompts: list[dict], tokenizer, target) -> list[tuple[int, dict, int, torch.Tensor]]:
    """(prompt index, prompt record, sample number, token ids) of every generation, each prompt checked against
    the context before the first generation starts (a prompt found too long after others ran would lose them)."""
    runs = []
    for index, item in enumerate(prompts):
        ids = encode_prompt(tokenizer, item["prompt"])
        try:
            check_prompt_length(target, ids.numel(), args.max_new_tokens, f"prompt {item['id']}")
        except ValueError as error:
            raise usage_error("--prompts" if args.prompts else "--prompt", str(error)) from None
        runs += [(index, item, sample, ids) for sample in range(args.samples)]
    return runs


def record_of(args, item: dict, sample: int, result, tokenizer) -> dict:
    record = {"id": item["id"], "prompt": item["prompt"], "output_ids": result.tokens,
              "text": tokenizer.decode(result.tokens, skip_special_tokens=True),
              "accept_lengths": result.accept_lengths, "target_forwards": result.target_forwards,
              "seconds": round(result.seconds, 4)}
    if args.samples > 1:
        record["sample"] = sample
    return record


def report(args, result) -> None:
    print(f"[{args.proposer}] {len(result.tokens)} tokens in {result.seconds:.2f} s "
          f"({len(result.tokens) / max(result.seconds, 1e-9):.1f} tok/s), tau {result.tau:.2f}, "
          f"{result.target_forwards} target forwards", file=sys.stderr)


def generate_all(decoder, runs, args, tokenizer, stop_token_ids, output: Output) -> None:
    """Every run, each recorded as it finishes: one at a time (the lone one streamed to the terminal), or
    ``args.batch_size`` together (each with the seed it gets decoded alone)."""
    settings = dict(stop_token_ids=stop_token_ids, stop_strings=args.stop, tokenizer=tokenizer)
    if isinstance(decoder, BatchedDecoder):
        seeds = [prompt_seed(args.seed, index, sample) for index, _, sample, _ in runs]
        finished = decoder.results([ids for *_, ids in runs], args.max_new_tokens, args.temperature, args.top_k,
                                   args.top_p, seeds=seeds, batch_size=args.batch_size, **settings)
        for position, result in tqdm(finished, total=len(runs), desc="generate", file=sys.stderr):
            index, item, sample, _ = runs[position]
            output.add((index, sample), record_of(args, item, sample, result, tokenizer))
            report(args, result)
        return
    for index, item, sample, ids in tqdm(runs, desc="generate", disable=len(runs) == 1, file=sys.stderr):
        step = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=prompt_seed(args.seed, index, sample), **settings)
        if len(runs) == 1:  # stream the one answer to the terminal as it is accepted
            result = print_streamed(decoder.stream_tokens(ids, **step), tokenizer)
        else:
            result = decoder.generate(ids, **step)
        output.add((index, sample), record_of(args, item, sample, result, tokenizer))
        report(args, result)


def main(argv=None) -> int:
    args = parse_args(argv)
    spec = parse_proposer(args.proposer, head=args.head, draft_model=args.draft_model)
    check_head_directories([spec], "--head" if args.head else "--proposer")
    check_args(args, spec)
    prompts = read_inputs(args)
    target = load_target_or_exit(args.target, dtype=args.dtype, device=args.device,
                                 fixed_shapes=cuda_graphs(args))
    tokenizer = target.tokenizer
    runs = encoded_runs(args, prompts, tokenizer, target)
    proposer = build_proposer_or_exit(spec, target)
    batched = args.batch_size > 1 and len(runs) > 1
    decoder = (BatchedDecoder if batched else SpeculativeDecoder)(
        target, proposer, tree_size=args.tree_size, attention=args.attention, acceptance=args.acceptance)
    if args.acceptance == "typical":
        print("[headstart] typical acceptance is lossy: output may differ from the target's own", file=sys.stderr)
    print(f"[headstart] tree size: {decoder.tree_size_reason}", file=sys.stderr)
    # a chat model ends its reply with the template's end-of-turn token, which need not be its EOS
    stop_token_ids = sorted(target.eos_token_ids | end_of_turn_token_ids(tokenizer))
    output = Output(args.output)
    try:
        generate_all(decoder, runs, args, tokenizer, stop_token_ids, output)
    except BaseException:
        output.abandon()
        raise
    output.finish()
    if batched:
        print(f"[headstart] batches of {args.batch_size}: {decoder.stats.as_dict()}", file=sys.stderr)
    for name, drafter in decoder.tree_size_report().get("drafters", {}).items():
        print(f"[headstart] {name}: tree sizes used (size: passes) {drafter['sizes']}, acceptance by depth "
              f"{drafter['acceptance_by_depth']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
