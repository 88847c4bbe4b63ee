"""Side-by-side decoding benchmark: HF generate baselines and our proposers on the same prompts, in one process.

    python scripts/benchmark.py --limit 10 --max-new-tokens 256 --output results.json

Default prompts: the 80 MT-bench first turns. Methods run interleaved per prompt (machine drift hits all alike),
batch 1, after a warm-up. Per method: tokens/s, tau (tokens emitted per target forward, bonus included), speedup
over HF greedy, and the fraction of outputs token-identical to HF greedy. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from runtime.decoder import SpeculativeDecoder  # noqa: E402
from runtime.prompts import encode_prompt, read_prompts  # noqa: E402
from runtime.proposers import LOOKUP_FIRST, build_proposer  # noqa: E402
from runtime.target import DEFAULT_TARGET, load_target  # noqa: E402

HF_METHODS = ("hf-greedy", "hf-pld", "hf-assisted")  # hf-assisted: HF assisted generation with --draft-model
# hf-early-exit[:N]: HF assisted generation whose draft is the target's own first N layers (default a quarter of
# them) under its final norm and LM head, the one assisted-generation draft every user of the target has.
EARLY_EXIT = "hf-early-exit"
# hf-greedy-bf16 runs HF greedy on a bfloat16 copy of the target: on CPUs where one bf16 token is faster than one
# fp32 token, that is the baseline to beat, so it runs beside the others and gets its own speedup column.
HF_DTYPE_SUFFIXES = {"-bf16": "bfloat16", "-fp32": "float32"}
DEFAULT_METHODS = ("hf-greedy", "hf-pld", "none", "ngram")


def hf_method(name: str, default_dtype: str) -> tuple[str, str] | None:
    """(HF method, dtype) for an HF baseline name such as ``hf-greedy`` or ``hf-pld-bf16``; None for our methods."""
    for suffix, dtype in HF_DTYPE_SUFFIXES.items():
        if name.endswith(suffix) and name[: -len(suffix)] in ("hf-greedy", "hf-pld"):
            return name[: -len(suffix)], dtype
    if name == EARLY_EXIT or name.startswith(EARLY_EXIT + ":"):
        return name, default_dtype
    return (name, default_dtype) if name in HF_METHODS else None


def early_exit_layers(method: str, model) -> int:
    """The draft depth of ``hf-early-exit[:N]``, checked against the target's layer count."""
    layers = model.config.num_hidden_layers
    _, _, given = method.partition(":")
    if not given:
        return max(1, layers // 4)
    if not given.isdigit() or not 1 <= int(given) < layers:
        raise SystemExit(f"{method}: N must be a layer count from 1 to {layers - 1} (the target has {layers} layers)")
    return int(given)


def hf_runs_of(methods, default_dtype: str) -> dict[str, tuple[str, str]]:
    """{name: (HF method, dtype)} for the HF baselines among ``methods``."""
    return {name: run for name in methods if (run := hf_method(name, default_dtype)) is not None}


def load_stock(target: str, dtype: str, device: str):
    """The target as the HF methods run it: the stock transformers model with stock linear layers."""
    return load_target(target, dtype=dtype, device=device, attn_implementation="sdpa", quiet=True,
                       decode_kernels=False).model


@dataclass
class MethodStats:
    tokens: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0
    forwards: int = 0
    identical: int = 0
    prompts: int = 0
    per_prompt_tps: list[float] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    depth_attempts: list[int] = field(default_factory=list)
    depth_accepts: list[int] = field(default_factory=list)

    def add_depths(self, attempts: list[int], accepts: list[int]) -> None:
        for depth, (tried, taken) in enumerate(zip(attempts, accepts)):
            if depth == len(self.depth_attempts):
                self.depth_attempts.append(0)
                self.depth_accepts.append(0)
            self.depth_attempts[depth] += tried
            self.depth_accepts[depth] += taken


class ForwardCounter:
    """Counts full forward calls of an HF model (to get tau for HF's own methods). An early-exit draft runs through
    the same model with ``config.num_hidden_layers`` lowered for the call; those passes are drafts, not counted."""

    def __init__(self, model):
        self.count = 0
        self.layers = model.config.num_hidden_layers
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += module.config.num_hidden_layers == self.layers


def run_hf(model, counter, ids, method, max_new_tokens, eos, temperature=0.0, seed=0, assistant=None):
    extra = {"prompt_lookup_num_tokens": 10} if method == "hf-pld" else {}
    if method == "hf-assisted":
        extra["assistant_model"] = assistant
    if method.startswith(EARLY_EXIT):
        extra["assistant_early_exit"] = early_exit_layers(method, model)
    if temperature > 0:  # plain temperature sampling, as our decoder does (no top-k/top-p from generation_config)
        extra.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        torch.manual_seed(seed)
    else:
        extra.update(do_sample=False)
    before = counter.count
    started = time.perf_counter()
    out = model.generate(ids[None].to(model.device), max_new_tokens=max_new_tokens, eos_token_id=eos,
                         pad_token_id=eos[0], **extra)
    seconds = time.perf_counter() - started
    return out[0, ids.numel():].tolist(), seconds, counter.count - before, None


def run_ours(decoder, ids, max_new_tokens, temperature, seed):
    result = decoder.generate(ids.to(decoder.target.device), max_new_tokens, temperature=temperature, seed=seed)
    return result.tokens, result.seconds, result.target_forwards, result


def default_methods(target_name: str, draft_model: str | None) -> list[str]:
    """The Step 1 methods, the heads shipped for this target (each alone and with prompt lookup first), and
    ``draft`` and ``hf-assisted`` (HF assisted generation) when a draft model is given."""
    from heads.shipped import find_shipped
    from runtime.target import same_model_identities

    identities = same_model_identities(target_name)
    shipped = [kind for kind in ("eagle3", "eagle", "medusa") if find_shipped(kind, identities) is not None]
    methods = list(DEFAULT_METHODS) + shipped + [kind + LOOKUP_FIRST for kind in shipped]
    return methods + (["draft", "hf-assisted"] if draft_model else [])


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two token lists differ (None when equal)."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def rounding_step(value: torch.Tensor) -> float:
    """The spacing of ``value``'s dtype at its magnitude: the smallest change rounding can make to it."""
    magnitude = value.abs()
    return float(torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude)


@torch.inference_mode()
def divergence_report(records, encoded, models: dict, reference, baseline) -> dict:
    """For each output that differs from HF greedy: is the first divergence a near-tie?

    ``models`` maps each method to the model it ran, ``baseline`` is the model HF greedy ran, ``reference`` a float32
    copy. At the first differing position both tokens are scored by one plain forward of each. It is a near-tie
    when rounding alone can reorder the two tokens: their float32 logits differ by at most twice the largest
    low-precision rounding error of those logits, or a low-precision run's own logits for them are at most one
    rounding step apart. ``fp32_picks_ours``: float32 prefers the method's token, so HF's run is the one that
    rounding moved (one plain forward underestimates the error of a run that built its cache token by token).
    """
    report = {}
    for name, model in models.items():
        cases = []
        for record, ids in zip(records, encoded):
            ours, base = record["outputs"][name], record["outputs"]["hf-greedy"]
            index = first_divergence(ours, base)
            if index is None or index >= min(len(ours), len(base)):
                continue
            prefix = torch.cat([ids, torch.tensor(base[:index], dtype=ids.dtype)])[None]
            high = reference(prefix.to(reference.device)).logits[0, -1].float().cpu()
            runs = [run(prefix.to(run.device)).logits[0, -1].cpu() for run in {id(m): m for m in (model, baseline)}
                    .values() if run is not reference]
            a, b = ours[index], base[index]
            error = max([abs(float(run[t].float() - high[t])) for run in runs for t in (a, b)], default=0.0)
            gap32 = abs(float(high[a] - high[b]))
            low_gaps = [(abs(float(run[a].float() - run[b].float())), rounding_step(run[b])) for run in runs]
            top2 = (runs[0] if runs else high).float().topk(2).values
            cases.append({"id": record["id"], "position": index, "ours": a, "hf": b, "fp32_gap": gap32,
                          "rounding_error": error, "top2_gap": float(top2[0] - top2[1]),
                          "low_precision_gap": min((gap for gap, _ in low_gaps), default=None),
                          "near_tie": gap32 <= 2 * error or any(gap <= step for gap, step in low_gaps),
                          "fp32_picks_ours": bool(high[a] > high[b])})
        if cases:
            report[name] = {"divergent": len(cases), "near_ties": sum(c["near_tie"] for c in cases),
                            "unexplained": sum(not (c["near_tie"] or c["fp32_picks_ours"]) for c in cases),
                            "max_fp32_gap": max(c["fp32_gap"] for c in cases), "cases": cases}
    return report


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--methods", help=f"comma-separated (default: {','.join(DEFAULT_METHODS)}, the heads "
                                          "shipped for the target, and draft,hf-assisted when --draft-model is "
                                          "given); heads as medusa:DIR, eagle:DIR, eagle3:DIR (medusa alone: the "
                                          "shipped head); HEAD+ngram: prompt lookup where it finds a match, "
                                          "the head elsewhere; METHOD@N fixes that method's tree size to N nodes; "
                                          "hf-greedy-bf16 and hf-pld-bf16 run HF on a bfloat16 copy of the target; "
                                          "hf-early-exit[:N]: HF assisted generation drafting with the target's first "
                                          "N layers (default: a quarter of them)")
    parser.add_argument("--draft-model")
    parser.add_argument("--prompts", help="JSONL prompts (default: MT-bench first turns)")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--stride", type=int, default=1,
                        help="every Nth prompt (4: 20 MT-bench first turns from every category)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--tree-tokens", type=int, help="fix the tree size (default: from the cost curve)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="results.json")
    parser.add_argument("--rescore", metavar="RESULTS",
                        help="only recompute the divergence report of a finished results file")
    parser.add_argument("--plot", help="PNG of per-method accept-length histograms (default: beside --output)")
    return parser.parse_args(argv)


def markdown_table(summary: dict) -> str:
    fastest = any("speedup_vs_fastest_hf_greedy" in row for row in summary.values())
    lines = ["| method | tokens/s | tau | speedup vs HF generate | " + ("vs fastest HF greedy | " if fastest else "")
             + "identical to HF greedy |", "|---|---:|---:|---:|" + ("---:|" if fastest else "") + "---:|"]
    for name, row in summary.items():
        identical = "n/a" if row["identical"] is None else f"{row['identical']:.0%}"
        versus_fastest = f"{row['speedup_vs_fastest_hf_greedy']:.2f}x | " if fastest else ""
        lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {row['tau']:.2f} | {row['speedup']:.2f}x | "
                     f"{versus_fastest}{identical} |")
    return "\n".join(lines)


def plot_histograms(stats: dict[str, MethodStats], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = {name: s for name, s in stats.items() if s.accept_lengths}
    if not shown:
        return
    fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 3), squeeze=False)
    for axis, (name, s) in zip(axes[0], shown.items()):
        top = max(s.accept_lengths)
        axis.hist(s.accept_lengths, bins=range(1, top + 2), align="left", rwidth=0.8)
        axis.set_title(f"{name} (tau {statistics.mean(s.accept_lengths):.2f})")
        axis.set_xlabel("tokens per target forward")
        axis.set_ylabel("passes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(stats: dict[str, MethodStats], decoders: dict, temperature: float) -> dict:
    """Per-method rates and ratios over the prompts run so far.

    ``speedup`` is over ``hf-greedy``; when HF greedy also ran in another dtype (``hf-greedy-bf16``), every row also
    gets ``speedup_vs_fastest_hf_greedy``, over whichever HF greedy run was faster.
    """
    rate = {name: s.tokens / s.seconds for name, s in stats.items()}
    hf_runs = hf_runs_of(stats, "")
    greedy = [name for name, (method, _) in hf_runs.items() if method == "hf-greedy"]
    base, fastest = rate["hf-greedy"], max(rate[name] for name in greedy)
    summary = {}
    for name, s in stats.items():
        tps = rate[name]
        summary[name] = {
            "tokens_per_s": tps,
            "tau": s.tokens / max(s.forwards, 1) if name in hf_runs else
            (statistics.mean(s.accept_lengths) if s.accept_lengths else 1.0),
            "speedup": tps / base,
            **({"speedup_vs_fastest_hf_greedy": tps / fastest} if len(greedy) > 1 else {}),
            "identical": s.identical / s.prompts if temperature == 0 else None,
            "per_prompt_tokens_per_s": {"min": min(s.per_prompt_tps), "median": statistics.median(s.per_prompt_tps),
                                        "max": max(s.per_prompt_tps)},
            "tokens": s.tokens, "seconds": s.seconds, "draft_share": s.draft_seconds / s.seconds,
            "tree_tokens": decoders[name].tree_tokens if name in decoders else None,
            "depth_acceptance": [taken / tried for taken, tried in zip(s.depth_accepts, s.depth_attempts)],
        }
    return summary


def write_atomically(path: Path, results: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(results, indent=1))
    partial.replace(path)


def score_divergences(records, encoded, methods, hf_runs, models: dict, args) -> dict:
    """``divergence_report`` for a run's methods; models: dtype -> the stock HF model in that dtype."""
    for dtype in ("float32", args.dtype, *(dtype for _, dtype in hf_runs.values())):
        if dtype not in models:
            models[dtype] = load_stock(args.target, dtype, args.device)
    ran_on = {name: models[hf_runs[name][1] if name in hf_runs else args.dtype] for name in methods
              if name != "hf-greedy"}
    divergences = divergence_report(records, encoded, ran_on, models["float32"], models[args.dtype])
    for name, row in divergences.items():
        print(f"{name}: {row['divergent']} outputs differ from HF greedy, {row['near_ties']} of them at a near-tie, "
              f"{row['unexplained']} neither a near-tie nor float32's choice (largest float32 logit gap "
              f"{row['max_fp32_gap']:.4f})", file=sys.stderr)
    return divergences


def rescore(path: Path, device: str) -> int:
    """Recompute the divergence report of a finished results file in place (no decoding, no timing)."""
    results = json.loads(path.read_text())
    config = results["config"]
    methods = list(results["methods"])
    args = argparse.Namespace(target=config["target"], dtype=config["dtype"], device=device)
    hf_runs = hf_runs_of(methods, args.dtype)
    tokenizer = load_target(args.target, dtype=args.dtype, device=device, quiet=True).tokenizer
    prompts = {p["id"]: p["prompt"] for p in read_prompts(None if config["prompts"] == "mt-bench" else
                                                           config["prompts"])}
    encoded = [encode_prompt(tokenizer, prompts[record["id"]]) for record in results["records"]]
    results["divergences"] = score_divergences(results["records"], encoded, methods, hf_runs, {}, args)
    write_atomically(path, results)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rescore:
        return rescore(Path(args.rescore), args.device)
    methods = args.methods.split(",") if args.methods else default_methods(args.target, args.draft_model)
    if "hf-greedy" not in methods:
        methods.insert(0, "hf-greedy")  # the baseline every ratio refers to
    prompts = read_prompts(args.prompts)[:: args.stride][: args.limit]
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    hf_runs = hf_runs_of(methods, args.dtype)
    stock = {}  # dtype -> (stock HF model, its forward counter): one copy per dtype the HF methods run in
    for dtype in dict.fromkeys([args.dtype] + [dtype for _, dtype in hf_runs.values()]):
        model = load_stock(args.target, dtype, args.device)
        stock[dtype] = (model, ForwardCounter(model))
    assistant = None
    if "hf-assisted" in methods:
        if not args.draft_model:
            raise SystemExit("hf-assisted needs --draft-model (a smaller model with the target's tokenizer)")
        assistant = load_stock(args.draft_model, args.dtype, args.device)
    eos = sorted(target.eos_token_ids)
    decoders = {}
    for name in methods:
        if name not in hf_runs:
            spec, _, tree_tokens = name.partition("@")  # eagle3@8: this method verifies trees of 8 nodes
            proposer = build_proposer(spec, target, args.draft_model)
            decoders[name] = SpeculativeDecoder(target, proposer,
                                                tree_tokens=int(tree_tokens) if tree_tokens else args.tree_tokens)

    def run(name, ids, max_new_tokens):
        if name in hf_runs:
            method, dtype = hf_runs[name]
            model, counter = stock[dtype]
            return run_hf(model, counter, ids, method, max_new_tokens, eos, args.temperature, args.seed, assistant)
        return run_ours(decoders[name], ids, max_new_tokens, args.temperature, args.seed)

    encoded = [encode_prompt(target.tokenizer, p["prompt"]) for p in prompts]
    for name in methods:  # warm-up: first-call allocations and lazy initialisation stay out of the timings
        run(name, encoded[0], 16)
    stats = {name: MethodStats() for name in methods}
    records = []
    config = {"target": args.target, "dtype": args.dtype, "prompts": args.prompts or "mt-bench", "stride": args.stride,
              "n_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.processor() or
              platform.machine()}
    output = Path(args.output)
    for index, ids in enumerate(tqdm(encoded, desc="benchmark", file=sys.stderr)):
        order = methods[index % len(methods):] + methods[: index % len(methods)]  # rotate who goes first
        outputs = {}
        for name in order:
            tokens, seconds, forwards, details = run(name, ids, args.max_new_tokens)
            outputs[name] = tokens
            s = stats[name]
            s.tokens += len(tokens)
            s.seconds += seconds
            s.forwards += forwards
            s.prompts += 1
            s.per_prompt_tps.append(len(tokens) / seconds)
            if details is not None:
                s.draft_seconds += details.draft_seconds
                s.accept_lengths.extend(details.accept_lengths)
                s.add_depths(details.depth_attempts, details.depth_accepts)
        for name in methods:
            stats[name].identical += outputs[name] == outputs["hf-greedy"]
        records.append({"id": prompts[index]["id"], "outputs": outputs})
        # A long run keeps what it has measured: the file holds every finished prompt until the final write.
        write_atomically(output, {"methods": summarize(stats, decoders, args.temperature),
                                  "config": {**config, "n_prompts_done": index + 1}, "records": records})

    summary = summarize(stats, decoders, args.temperature)
    divergences = {}
    if args.temperature == 0 and any(row["identical"] < 1 for row in summary.values()):
        divergences = score_divergences(records, encoded, methods, hf_runs, {d: m for d, (m, _) in stock.items()},
                                        args)
    write_atomically(output, {"methods": summary, "config": config, "divergences": divergences, "records": records})
    plot_histograms(stats, Path(args.plot) if args.plot else output.with_suffix(".png"))
    print(markdown_table(summary))
    print(f"\n{len(prompts)} prompts, {args.max_new_tokens} new tokens, temperature {args.temperature}, "
          f"{args.dtype}; results in {output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
