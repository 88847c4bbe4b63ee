"""Side-by-side decoding benchmark: HF generate baselines, our proposers and peer decoders on the same prompts, in
one process (scripts/benchmark.py is its command line).

``run_benchmark`` runs the methods (bench/methods.py) interleaved per prompt (machine drift hits all alike), batch
1, after a warm-up, and reports per method: tokens/s, tau (tokens emitted per target forward after the prefill,
bonus included), speedup over HF greedy, and the fraction of outputs token-identical to HF greedy; outputs that
differ from HF greedy get a divergence report (bench/divergence.py).

``run_batch_benchmark`` measures throughput at several batch sizes N in one run instead: total tokens/s of HF
``generate`` on left-padded batches of N prompts (greedy) and of our ``BatchedDecoder`` (continuous batching) at N,
and of each method at batch 1, with every row's output compared with HF greedy decoding its prompt alone.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.divergence import score_divergences
from bench.hf import HFModels, run_hf, run_hf_batches
from bench.methods import (BASELINE, DecoderMethod, HFBaseline, Method, check_batch_methods, check_batch_sizes,
                           check_greedy_peers, check_methods, dtype_name, method_to_json, with_baseline)
from bench.llamacpp import LlamaCppDecoder, LlamaCppMethod
from bench.peers import PeerDecoder, PeerMethod
from bench.prompts import MTBENCH
from bench.report import MethodStats, output_summary, plot_histograms, summarize, summarize_batch
from bench.timing import run_environment
from runtime.engine.batched import BatchedDecoder
from runtime.engine.decoder import SpeculativeDecoder, check_prompt_length
from runtime.engine.prompts import batch_pad_token_id, encode_prompt
from runtime.proposers import Proposer, build_proposer
from runtime.target.assets import write_json_atomically
from runtime.target.cost_model import BATCH_SIZES, cost_curve, measure_pass_seconds
from runtime.target.machine import synchronized_seconds

WARM_UP_TOKENS = 16  # enough for first-call allocations and lazy initialisation to stay out of the timings


def encoded_prompts(target, prompts: list[dict], max_new_tokens: int) -> list[torch.Tensor]:
    """Every prompt's token ids, each checked against the target's context before the first method runs (a prompt
    found too long when its turn came would end a run after hours of others)."""
    encoded = []
    for prompt in prompts:
        ids = encode_prompt(target.tokenizer, prompt["prompt"])
        check_prompt_length(target, ids.numel(), max_new_tokens, f"prompt {prompt['id']}")
        encoded.append(ids)
    return encoded


def run_ours(decoder, ids, max_new_tokens, temperature, seed):
    """One ``decoder.generate`` call: (new tokens, seconds, target forwards, the GenerationResult)."""
    result = decoder.generate(ids.to(decoder.target.device), max_new_tokens, temperature=temperature, seed=seed)
    return result.tokens, result.seconds, result.target_forwards, result


def run_ours_batch(decoder, rows: list[torch.Tensor], max_new_tokens: int, batch_size: int):
    """``decoder.generate`` (a BatchedDecoder) on ``rows``, ``batch_size`` at a time: (the GenerationResults,
    seconds)."""
    started = time.perf_counter()
    results = decoder.generate(rows, max_new_tokens, batch_size=batch_size)
    return results, synchronized_seconds(decoder.target.device, started)


def build_proposers(methods: dict[str, Method], target) -> dict[str, Proposer]:
    """The proposer of each of our decoder methods, built once: the batch-1 and the batched decoders of a method
    share it."""
    return {name: build_proposer(method.proposer, target) for name, method in methods.items()
            if isinstance(method, DecoderMethod)}


def rotated(names: list[str], start: int) -> list[str]:
    """``names`` from the ``start``-th on (modulo their count), then the rest: who goes first changes from round to
    round, so that drift of the machine hits all methods alike."""
    start %= len(names)
    return names[start:] + names[:start]


class MethodRunner:
    """Every method of a run, ready to decode one prompt: ``run(name, ids, new_tokens)`` gives (new tokens, seconds,
    target forwards, details or None) whichever runs it: HF ``generate`` (``HFBaseline``), a ``PeerDecoder``, or our
    ``SpeculativeDecoder`` with the method's proposer from ``proposers``."""

    def __init__(self, target, target_name: str, methods: dict[str, Method], proposers: dict[str, Proposer], *,
                 tree_size: int | None, temperature: float = 0.0, seed: int = 0):
        self.methods = methods
        self.names = list(methods)
        self.temperature, self.seed = temperature, seed
        self.models = HFModels(target, target_name)
        self.eos = sorted(target.eos_token_ids)
        self.tree_sizes = {name: methods[name].tree_size or tree_size for name in proposers}
        self.decoders = {name: SpeculativeDecoder(target, proposer, tree_size=self.tree_sizes[name])
                         for name, proposer in proposers.items()}
        self.peers = {name: PeerDecoder(method, target, target_name) for name, method in methods.items()
                      if isinstance(method, PeerMethod)}
        self.peers.update({name: LlamaCppDecoder(method, target) for name, method in methods.items()
                           if isinstance(method, LlamaCppMethod)})

    def run(self, name: str, ids: torch.Tensor, new_tokens: int):
        method = self.methods[name]
        if isinstance(method, HFBaseline):
            assistant = self.models.assistant(method.draft_model) if method.draft_model else None
            return run_hf(self.models.model(method.dtype), self.models.counter(method.dtype), ids, method, new_tokens,
                          self.eos, self.temperature, self.seed, assistant)
        if name in self.peers:
            return self.peers[name].generate(ids, new_tokens, self.eos)
        return run_ours(self.decoders[name], ids, new_tokens, self.temperature, self.seed)

    def close(self) -> None:
        """Leaves the target's model as it was (its forward counter removed) and stops llama.cpp's servers."""
        self.models.close()
        for peer in self.peers.values():
            if isinstance(peer, LlamaCppDecoder):
                peer.close()


def run_config(target, target_name: str, methods: dict[str, Method], prompts: list[dict], *,
               prompts_source: str | None, stride: int, max_new_tokens: int, temperature: float) -> dict:
    """What a results file records about its run: the target, the prompts, the decoding settings, the environment
    and every method (``method_specs``, which ``rescore`` reads back)."""
    return {"target": target_name, "dtype": dtype_name(target.dtype), "prompts": prompts_source or MTBENCH,
            "stride": stride, "n_prompts": len(prompts), "max_new_tokens": max_new_tokens, "temperature": temperature,
            **run_environment(target.device),
            "method_specs": {name: method_to_json(method) for name, method in methods.items()}}


def run_benchmark(target, target_name: str, methods: dict[str, Method], prompts: list[dict], output: str | Path, *,
                  max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0, tree_size: int | None = None,
                  prompts_source: str | None = None, stride: int = 1, plot: str | Path | None = None,
                  progress: bool = True) -> dict:
    """Run ``methods`` on ``prompts`` ([{"id", "prompt"}], e.g. from ``bench.prompts.read_prompts``) and write the
    results to ``output`` (JSON: ``methods`` (the summary), ``config``, ``divergences``, ``records`` (every output)).

    ``target`` is the loaded target (``target_name``: what it was loaded from, to load copies in other dtypes); the
    HF baseline ``hf-greedy`` is added first when ``methods`` lacks it. ``tree_size``: the tree size of decoder
    methods without their own. ``prompts_source``: the prompts file recorded in the results (None: MT-bench).
    The output file holds every finished prompt while the run goes on. After a greedy run, outputs that differ from
    HF greedy get a ``divergence_report``. Per-method accept-length histograms go to ``plot`` (None: beside
    ``output`` as .png). Returns what it wrote.
    """
    methods = with_baseline(methods)
    check_methods(methods, target.num_layers)
    if not prompts:
        raise ValueError("run_benchmark needs at least one prompt")
    check_greedy_peers(methods, temperature)
    output = Path(output)
    runner = MethodRunner(target, target_name, methods, build_proposers(methods, target), tree_size=tree_size,
                          temperature=temperature, seed=seed)
    try:
        encoded = encoded_prompts(target, prompts, max_new_tokens)
        for name in runner.names:
            runner.run(name, encoded[0], WARM_UP_TOKENS)
        config = run_config(target, target_name, methods, prompts, prompts_source=prompts_source, stride=stride,
                            max_new_tokens=max_new_tokens, temperature=temperature)
        stats, records = time_prompts(runner, encoded, prompts, max_new_tokens, output, config, progress)
        summary = summarize(stats, methods, runner.decoders, temperature)
        divergences = {}
        if temperature == 0 and any(row["identical"] < 1 for row in summary.values()):
            divergences = score_divergences(records, encoded, methods, runner.models)
    finally:
        runner.close()
    results = {"methods": summary, "config": config, "divergences": divergences, "records": records}
    write_json_atomically(output, results)
    plot_histograms(stats, Path(plot) if plot else output.with_suffix(".png"))
    return results


def time_prompts(runner: MethodRunner, encoded: list[torch.Tensor], prompts: list[dict], max_new_tokens: int,
                 output: Path, config: dict, progress: bool) -> tuple[dict[str, MethodStats], list[dict]]:
    """Every method on every prompt, who goes first rotating from prompt to prompt: (the stats of each method, a
    record of each prompt's outputs). ``output`` holds every finished prompt while the run goes on."""
    stats = {name: MethodStats() for name in runner.names}
    records = []
    for index, ids in enumerate(tqdm(encoded, desc="benchmark", file=sys.stderr, disable=not progress)):
        outputs = {}
        for name in rotated(runner.names, index):
            tokens, seconds, forwards, details = runner.run(name, ids, max_new_tokens)
            outputs[name] = tokens
            stats[name].add_run(tokens, seconds, forwards, details)
        for name in runner.names:
            stats[name].identical += outputs[name] == outputs[BASELINE]
        records.append({"id": prompts[index]["id"], "outputs": outputs})
        # A long run keeps what it has measured: the file holds every finished prompt until the final write.
        write_json_atomically(output, {"methods": summarize(stats, runner.methods, runner.decoders, runner.temperature),
                                       "config": {**config, "n_prompts_done": index + 1}, "records": records})
    return stats, records


# --- throughput at a batch size ---


class BatchRunner:
    """Every method of a batch benchmark at each batch size of ``sizes``: ``run(name, rows, new_tokens, batch_size)``
    gives ([(tokens, details or None)] per row, seconds) at a batch size above 1 (HF greedy on left-padded batches,
    our ``BatchedDecoder``); ``single`` runs a prompt alone."""

    def __init__(self, target, target_name: str, methods: dict[str, Method], sizes: list[int], *,
                 tree_size: int | None):
        if not target.eos_token_ids:
            raise ValueError("the target has no end-of-sequence token: HF generate needs one to pad finished rows "
                             "with")
        proposers = build_proposers(methods, target)
        self.single = MethodRunner(target, target_name, methods, proposers, tree_size=tree_size)
        self.methods, self.names, self.sizes = methods, self.single.names, sizes
        tokenizer = target.tokenizer
        self.pad = batch_pad_token_id(tokenizer) if tokenizer is not None else self.single.eos[0]
        self.batched = {size: {name: BatchedDecoder(target, proposer, tree_size=self.single.tree_sizes[name])
                               for name, proposer in proposers.items()} for size in sizes[1:]}
        # llama.cpp's server with as many slots as rows, each row a request of its own
        self.servers = {size: {name: LlamaCppDecoder(method, target, slots=size) for name, method in methods.items()
                               if isinstance(method, LlamaCppMethod)} for size in sizes[1:]}

    @property
    def decoders(self) -> dict[int, dict]:
        """{batch size: {method: our decoder at that size}}, batch 1 included."""
        return {1: self.single.decoders, **self.batched}

    def run(self, name: str, rows: list[torch.Tensor], new_tokens: int, batch_size: int):
        if name in self.servers[batch_size]:
            return self.servers[batch_size][name].generate_rows(rows, new_tokens, self.single.eos)
        if name in self.batched[batch_size]:
            results, seconds = run_ours_batch(self.batched[batch_size][name], rows, new_tokens, batch_size)
            return [(result.tokens, result) for result in results], seconds
        model = self.single.models.model(self.methods[name].dtype)
        outputs, seconds = run_hf_batches(model, rows, new_tokens, self.single.eos, self.pad, batch_size)
        return [(tokens, None) for tokens in outputs], seconds

    def close(self) -> None:
        self.single.close()
        for servers in self.servers.values():
            for server in servers.values():
                server.close()


def round_size(chunk_size: int | None, largest: int) -> int:
    """Prompts per interleaved round: ``chunk_size`` rounded up to a multiple of the largest batch size (None: the
    largest batch size)."""
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (prompts), got {chunk_size}")
    return -(-(chunk_size or largest) // largest) * largest


def warm_up_batches(runner: BatchRunner, target, encoded: list[torch.Tensor], chunks: list[list[int]]) -> None:
    """Every method once at every batch size and alone. A batched decoder sizes its tree from the cost curve at its
    width, measured once on first use: the widths a short last chunk decodes at are measured here too, rather than
    inside a timing."""
    if any(runner.batched.values()):
        for width in sorted({min(size, len(chunk)) for size in runner.sizes[1:] for chunk in chunks} - {1}):
            cost_curve(target, width)
    for name in runner.names:
        for size in runner.sizes[1:]:
            runner.run(name, encoded[:size], WARM_UP_TOKENS, size)
        runner.single.run(name, encoded[0], WARM_UP_TOKENS)


def pass_seconds(target, sizes: list[int]) -> dict[str, dict[str, float]]:
    """{rows: {tree size: seconds of one target pass}} for each batch size run and each tree size of
    ``runtime.target.cost_model.BATCH_SIZES`` (str keys, as JSON keeps them)."""
    return {str(rows): {str(nodes): seconds for nodes, seconds in
                        measure_pass_seconds(target, sizes=BATCH_SIZES, batch_size=rows).items()}
            for rows in sizes}


def run_batch_benchmark(target, target_name: str, methods: dict[str, Method], prompts: list[dict],
                        output: str | Path, *, batch_sizes, max_new_tokens: int = 256,
                        tree_size: int | None = None, chunk_size: int | None = None,
                        prompts_source: str | None = None, stride: int = 1, progress: bool = True,
                        pass_costs: bool = False) -> dict:
    """Total tokens/s at each of ``batch_sizes`` (batch 1 always included), greedy, per method, in one run; writes
    the results to ``output`` (JSON: ``methods`` (``summarize_batch``), ``config``, ``records`` (every row's output
    at every batch size)) and returns them.

    HF greedy (``HFBaseline('hf-greedy')``, any dtype; added first when ``methods`` lacks it) runs ``generate`` on
    left-padded batches of N prompts (padded with the tokenizer's pad token, else EOS), each row counted up to its
    first stop token, and on each prompt alone. Our methods (``DecoderMethod``) decode every prompt with a
    ``BatchedDecoder`` of N rows (continuous batching: a finished row's place goes to the next prompt) and with a
    ``SpeculativeDecoder`` at batch 1. Rates are total new tokens over total wall seconds. Every output row, at every
    batch size, is compared with HF greedy (in the target's dtype) decoding its prompt alone: ``identical`` is the
    fraction of rows equal to it (HF's own batched rows can differ, as left padding changes its numerics).

    Timings follow a warm-up of every method at every batch size (the cost curves of every row count a chunk will
    decode at are measured there, not inside a timing). The prompts go in chunks of ``chunk_size`` (rounded up to a
    multiple of the largest batch size; None: the largest batch size): per chunk, each batch size above 1 runs
    every method over it, in an order rotated from chunk to chunk, then every prompt of it runs at batch 1, methods
    interleaved per prompt, so drift of the machine hits all methods alike. ``tree_size``: as in ``run_benchmark``.
    ``pass_costs``: also measure the seconds of one target pass for every batch size and tree size of
    ``runtime.target.cost_model.BATCH_SIZES`` (``config["pass_seconds"]``), what decides where drafting stops paying.
    """
    sizes = check_batch_sizes(batch_sizes)
    step = round_size(chunk_size, sizes[-1])
    methods = with_baseline(methods)
    check_methods(methods, target.num_layers)
    check_batch_methods(methods)
    if not prompts:
        raise ValueError("run_batch_benchmark needs at least one prompt")
    output = Path(output)
    runner = BatchRunner(target, target_name, methods, sizes, tree_size=tree_size)
    try:
        encoded = encoded_prompts(target, prompts, max_new_tokens)
        chunks = [list(range(start, min(start + step, len(prompts)))) for start in range(0, len(prompts), step)]
        warm_up_batches(runner, target, encoded, chunks)
        config = {"mode": "batch", "batch_sizes": sizes, "chunk_size": step,
                  **run_config(target, target_name, methods, prompts, prompts_source=prompts_source, stride=stride,
                               max_new_tokens=max_new_tokens, temperature=0.0), "pad_token_id": runner.pad}
        if pass_costs:
            config["pass_seconds"] = pass_seconds(target, sizes)
        stats, records = time_batches(runner, encoded, prompts, chunks, max_new_tokens, output, config, progress)
        summary = summarize_batch(stats, methods, runner.decoders)
    finally:
        runner.close()
    results = {"methods": summary, "config": config, "records": records}
    write_json_atomically(output, results)
    return results


def time_batches(runner: BatchRunner, encoded: list[torch.Tensor], prompts: list[dict], chunks: list[list[int]],
                 max_new_tokens: int, output: Path, config: dict, progress: bool) -> tuple[dict, list[dict]]:
    """Every chunk of prompts at every batch size, then alone: ({batch size: {method: MethodStats}}, a record of
    each prompt's output summaries). ``output`` holds every finished chunk while the run goes on."""
    stats = {size: {name: MethodStats() for name in runner.names} for size in runner.sizes}
    records = [{"id": p["id"], "outputs": {str(size): {} for size in runner.sizes}} for p in prompts]
    done = 0
    for number, chunk in enumerate(tqdm(chunks, desc="batch benchmark", file=sys.stderr,
                                        disable=not progress or len(chunks) == 1)):
        time_chunk_batched(runner, chunk, number, encoded, max_new_tokens, stats, records)
        for index in chunk:
            for name in rotated(runner.names, index):
                tokens, seconds, forwards, details = runner.single.run(name, encoded[index], max_new_tokens)
                records[index]["outputs"]["1"][name] = tokens
                stats[1][name].add_run(tokens, seconds, forwards, details)
            keep_output_summaries(records[index], stats)
        done += len(chunk)
        write_json_atomically(output, {"methods": summarize_batch(stats, runner.methods, runner.decoders),
                                       "config": {**config, "n_prompts_done": done}, "records": records[:done]})
    return stats, records


def time_chunk_batched(runner: BatchRunner, chunk: list[int], number: int, encoded: list[torch.Tensor],
                       max_new_tokens: int, stats: dict, records: list[dict]) -> None:
    """Every method over the prompts of ``chunk`` (the ``number``-th) at each batch size above 1, who goes first
    rotating from chunk to chunk; each row's tokens go to its prompt's record."""
    rows = [encoded[index] for index in chunk]
    for size in runner.sizes[1:]:
        for name in rotated(runner.names, number):
            outputs, seconds = runner.run(name, rows, max_new_tokens, size)
            stats[size][name].seconds += seconds
            for index, (tokens, details) in zip(chunk, outputs):
                records[index]["outputs"][str(size)][name] = tokens
                stats[size][name].add_output(tokens, details)


def keep_output_summaries(record: dict, stats: dict[int, dict[str, MethodStats]]) -> None:
    """Replace each output of a prompt's ``record`` by its ``output_summary`` against HF greedy decoding the prompt
    alone (the file keeps a summary of each output, not its tokens), counting the identical ones."""
    reference = record["outputs"]["1"][BASELINE]
    for size, outputs in record["outputs"].items():
        for name in outputs:
            outputs[name] = output_summary(outputs[name], reference)
            stats[int(size)][name].identical += outputs[name]["identical"]
