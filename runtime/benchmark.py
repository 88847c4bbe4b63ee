"""Side-by-side decoding benchmark: HF generate baselines and our proposers on the same prompts, in one process.

Methods are typed values: ``HFBaseline`` (a ``model.generate`` baseline) or ``DecoderMethod`` (a ``ProposerSpec``
run by ``SpeculativeDecoder``), keyed by the name they are reported under. ``run_benchmark`` runs them interleaved
per prompt (machine drift hits all alike), batch 1, after a warm-up, and reports per method: tokens/s, tau (tokens
emitted per target forward after the prefill, bonus included), speedup over HF greedy, and the fraction of outputs
token-identical to HF greedy; ``divergence_report`` says whether each output that differs from HF greedy first
differs at a near-tie.
scripts/benchmark.py is its command line.

``run_batch_benchmark`` measures throughput at several batch sizes N in one run instead: total tokens/s of HF
``generate`` on left-padded batches of N prompts (greedy) and of our ``BatchedDecoder`` (continuous batching) at N,
and of each method at batch 1, with every row's output compared with HF greedy decoding its prompt alone.

The HF baselines run on the target's own transformers model (``target.model``, a stock model outside
``Target.forward``) when they run in the target's dtype; another dtype loads another copy of the target, once
(``HFModels``).
"""

from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from runtime.assets import write_json_atomically
from runtime.peers import PeerDecoder, PeerMethod
from runtime.proposers.spec import ProposerSpec

HF_METHODS = ("hf-greedy", "hf-pld", "hf-assisted", "hf-early-exit")
BASELINE = "hf-greedy"  # the name of the method every ratio refers to and every output is compared with
PLD_TOKENS = 10  # prompt_lookup_num_tokens of hf-pld


# CPU features that decide the fast bf16 and decode paths (runtime.kernels, runtime.decode_layers)
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def machine_description(device: torch.device) -> dict:
    """What a results file records about the machine: CPU model, its family/model/stepping, clock and cache (the
    model name alone does not tell two generations apart), the flags that choose kernels, torch's CPU capability,
    the cores (and those this process may use), and the GPU when the run used one."""
    from runtime.cost_model import cpu_info, usable_cores
    from runtime.kernels import native_bf16_matmul

    info = cpu_info()  # empty off Linux: the platform string is what there is
    flags = set(info.get("flags", "").split())
    described = {"cpu": info.get("cpu") or platform.processor() or platform.machine(),
                 "cpu_id": {name: info[name] for name in ("family", "model", "stepping", "mhz", "cache")
                            if name in info},
                 "cpu_flags": [flag for flag in CPU_FLAGS if flag in flags],
                 "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
                 "cores_available": usable_cores(),
                 "native_bf16_matmul": native_bf16_matmul()}
    if device.type == "cuda":
        described["gpu"] = torch.cuda.get_device_name(device)
    return described


def dtype_name(dtype: str | torch.dtype) -> str:
    """``float32`` / ``bfloat16`` / ``float16`` for any spelling ``runtime.target.parse_dtype`` accepts."""
    from runtime.target import parse_dtype

    return str(parse_dtype(dtype)).removeprefix("torch.")


@dataclass(frozen=True)
class HFBaseline:
    """A transformers ``generate`` baseline on the target.

    ``method``: ``hf-greedy`` (plain decoding), ``hf-pld`` (prompt lookup decoding), ``hf-assisted`` (assisted
    generation drafting with ``draft_model``, a smaller model with the target's tokenizer) or ``hf-early-exit``
    (assisted generation drafting with the target's first ``early_exit_layers`` layers under its final norm and LM
    head; None: a quarter of them). ``dtype``: the dtype of the target copy it runs on (None: the target's own), e.g.
    ``bfloat16``: on CPUs where one bf16 token is faster than one fp32 token, that is the baseline to beat.
    """

    method: str
    dtype: str | None = None
    early_exit_layers: int | None = None
    draft_model: str | None = None

    def __post_init__(self):
        if self.method not in HF_METHODS:
            raise ValueError(f"HFBaseline.method: unknown HF baseline {self.method!r}; choose one of "
                             f"{', '.join(HF_METHODS)}")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.early_exit_layers is not None:
            if self.method != "hf-early-exit":
                raise ValueError(f"HFBaseline.early_exit_layers is for method='hf-early-exit', not {self.method!r}")
            if self.early_exit_layers < 1:
                raise ValueError(f"HFBaseline.early_exit_layers must be >= 1, got {self.early_exit_layers}")
        if self.method == "hf-assisted" and not self.draft_model:
            raise ValueError("HFBaseline.draft_model is required for method='hf-assisted' (a smaller model with the "
                             "target's tokenizer)")
        if self.draft_model is not None and self.method != "hf-assisted":
            raise ValueError(f"HFBaseline.draft_model is for method='hf-assisted', not {self.method!r}")


@dataclass(frozen=True)
class DecoderMethod:
    """Our decoder with the proposer ``proposer``; ``tree_size`` fixes its verified tree size (None: the
    benchmark's ``tree_size``, else the cost model's choice)."""

    proposer: ProposerSpec
    tree_size: int | None = None

    def __post_init__(self):
        if self.tree_size is not None and self.tree_size < 1:
            raise ValueError(f"DecoderMethod.tree_size must be >= 1, got {self.tree_size}")


Method = HFBaseline | DecoderMethod | PeerMethod  # PeerMethod: another decoder (runtime/peers.py)


def method_to_json(method: Method) -> dict:
    if isinstance(method, HFBaseline):
        return {"hf": asdict(method)}
    if isinstance(method, PeerMethod):
        return {"peer": asdict(method)}
    return {"proposer": asdict(method.proposer), "tree_size": method.tree_size}


def method_from_json(data: dict) -> Method:
    if "hf" in data:
        return HFBaseline(**data["hf"])
    if "peer" in data:
        return PeerMethod(**data["peer"])
    return DecoderMethod(ProposerSpec(**data["proposer"]), data.get("tree_size"))


def early_exit_layers(requested: int | None, num_layers: int) -> int:
    """The draft depth of ``hf-early-exit``: ``requested``, checked against the target's layer count, or a quarter of
    the layers."""
    if requested is None:
        return max(1, num_layers // 4)
    if not 1 <= requested < num_layers:
        raise ValueError(f"HFBaseline.early_exit_layers must be a layer count from 1 to {num_layers - 1} (the target "
                         f"has {num_layers} layers), got {requested}")
    return requested


def check_methods(methods: dict[str, Method], num_layers: int) -> None:
    """What can only be checked against the target: early-exit depths, the baseline in the target's dtype."""
    for method in methods.values():
        if isinstance(method, HFBaseline) and method.method == "hf-early-exit":
            early_exit_layers(method.early_exit_layers, num_layers)
    baseline = methods.get(BASELINE)
    if not (isinstance(baseline, HFBaseline) and baseline.method == "hf-greedy"):
        raise ValueError(f"methods[{BASELINE!r}] must be HFBaseline('hf-greedy'), got {baseline!r}")


def default_methods(target_name: str, draft_model: str | None = None) -> dict[str, Method]:
    """HF greedy, HF prompt lookup, our plain decoding and prompt lookup, the heads shipped for this target (each alone
    and with prompt lookup first), and our draft-model decoding and HF assisted generation when a draft model is
    given."""
    from heads.shipped import find_shipped
    from runtime.target import same_model_identities

    identities = same_model_identities(target_name)
    shipped = [kind for kind in ("eagle3", "eagle", "medusa") if find_shipped(kind, identities) is not None]
    specs = [ProposerSpec("none"), ProposerSpec("ngram")] + [ProposerSpec(kind) for kind in shipped] + [
        ProposerSpec(kind, lookup_first=True) for kind in shipped]
    methods: dict[str, Method] = {"hf-greedy": HFBaseline("hf-greedy"), "hf-pld": HFBaseline("hf-pld")}
    methods.update({spec.label: DecoderMethod(spec) for spec in specs})
    if draft_model:
        methods["draft"] = DecoderMethod(ProposerSpec("draft", draft_model=draft_model))
        methods["hf-assisted"] = HFBaseline("hf-assisted", draft_model=draft_model)
    return methods


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
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += module.config.num_hidden_layers == self.layers

    def remove(self) -> None:
        self.handle.remove()


class HFModels:
    """The stock transformers models the HF baselines run on, one per dtype ({dtype: model}): the target's own model
    in the target's dtype, a copy of the target (loaded from ``target_name``) in any other; and the draft models of
    ``hf-assisted``, each loaded once."""

    def __init__(self, target, target_name: str):
        self.target_name = target_name
        self.device = target.device
        self.dtype = target.dtype
        self.models = {target.dtype: target.model}
        self.counters: dict[torch.dtype, ForwardCounter] = {}
        self.assistants: dict[tuple[str, torch.dtype], object] = {}

    def model(self, dtype: str | torch.dtype | None = None):
        from runtime.target import load_target, parse_dtype

        dtype = self.dtype if dtype is None else parse_dtype(dtype)
        if dtype not in self.models:
            self.models[dtype] = load_target(self.target_name, dtype=dtype, device=self.device,
                                             attn_implementation="sdpa", quiet=True).model
        return self.models[dtype]

    def counter(self, dtype: str | torch.dtype | None = None) -> ForwardCounter:
        from runtime.target import parse_dtype

        key = self.dtype if dtype is None else parse_dtype(dtype)
        if key not in self.counters:
            self.counters[key] = ForwardCounter(self.model(key))
        return self.counters[key]

    def assistant(self, name: str, dtype: str | torch.dtype | None = None):
        from runtime.target import load_target, parse_dtype

        key = (name, self.dtype if dtype is None else parse_dtype(dtype))
        if key not in self.assistants:
            self.assistants[key] = load_target(name, dtype=key[1], device=self.device, attn_implementation="sdpa",
                                               quiet=True).model
        return self.assistants[key]

    def close(self) -> None:
        """Removes the forward counters' hooks (the target's own model stays as it was)."""
        for counter in self.counters.values():
            counter.remove()
        self.counters.clear()


# generate() fills every setting a call leaves unset from the model's own generation_config; these would change
# the logits it picks from (a repetition penalty applies even to greedy decoding), so the baselines pin them to
# plain decoding, as this runtime decodes
PLAIN_DECODING = dict(repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0,
                      encoder_no_repeat_ngram_size=0, min_new_tokens=0, suppress_tokens=[],
                      begin_suppress_tokens=[], typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)
# settings with no neutral value to pin: a target whose generation_config holds one is refused
UNPINNABLE = ("bad_words_ids", "forced_bos_token_id", "forced_eos_token_id", "sequence_bias",
              "exponential_decay_length_penalty", "min_p", "guidance_scale", "watermarking_config")


def plain_generation_settings(model) -> dict:
    """``generate`` keyword arguments that make HF decode plainly whatever ``model.generation_config`` holds; a
    setting that cannot be pinned is a clear error before any work."""
    config = getattr(model, "generation_config", None)
    held = [name for name in UNPINNABLE if getattr(config, name, None) not in (None, 1.0)] if config else []
    if held:
        raise ValueError(f"the target's generation_config sets {', '.join(held)}, which HF generate would apply and "
                         f"this runtime does not: its baselines would not be plain decoding; clear them in "
                         f"generation_config.json (the runtime ignores them either way)")
    return dict(PLAIN_DECODING)


def run_hf(model, counter, ids, baseline: HFBaseline, max_new_tokens, eos, temperature=0.0, seed=0, assistant=None):
    """One ``generate`` call of ``baseline`` on ``model``: (new tokens, seconds, full target forwards, None)."""
    extra = plain_generation_settings(model)
    if baseline.method == "hf-pld":
        extra["prompt_lookup_num_tokens"] = PLD_TOKENS
    if baseline.method == "hf-assisted":
        extra["assistant_model"] = assistant
    if baseline.method == "hf-early-exit":
        extra["assistant_early_exit"] = early_exit_layers(baseline.early_exit_layers,
                                                          model.config.num_hidden_layers)
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
    """One ``decoder.generate`` call: (new tokens, seconds, target forwards, the GenerationResult)."""
    result = decoder.generate(ids.to(decoder.target.device), max_new_tokens, temperature=temperature, seed=seed)
    return result.tokens, result.seconds, result.target_forwards, result


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

    Where every run was float32 (two float32 runs differ only in summation order), a float64 copy of ``reference``
    plays float32's part: the rounding error is float32's own against it, the near-tie test compares the float64
    gap with twice that error, and ``fp64_picks_ours`` says which token float64 prefers.
    """
    report = {}
    precise = None  # the float64 copy, made once where needed
    for name, model in models.items():
        cases = []
        for record, ids in zip(records, encoded):
            ours, base = record["outputs"][name], record["outputs"][BASELINE]
            index = first_divergence(ours, base)
            if index is None or index >= min(len(ours), len(base)):
                continue
            prefix = torch.cat([ids, torch.tensor(base[:index], dtype=ids.dtype)])[None]
            high = reference(prefix.to(reference.device)).logits[0, -1].float().cpu()
            runs = [run(prefix.to(run.device)).logits[0, -1].cpu() for run in {id(m): m for m in (model, baseline)}
                    .values() if run is not reference]
            a, b = ours[index], base[index]
            case = {"id": record["id"], "position": index, "ours": a, "hf": b,
                    "fp32_gap": abs(float(high[a] - high[b])), "fp32_picks_ours": bool(high[a] > high[b])}
            if runs:
                error = max(abs(float(run[t].float() - high[t])) for run in runs for t in (a, b))
                low_gaps = [(abs(float(run[a].float() - run[b].float())), rounding_step(run[b])) for run in runs]
                top2 = runs[0].float().topk(2).values
                case.update(rounding_error=error, top2_gap=float(top2[0] - top2[1]),
                            low_precision_gap=min(gap for gap, _ in low_gaps),
                            near_tie=case["fp32_gap"] <= 2 * error or any(gap <= step for gap, step in low_gaps))
            else:
                if precise is None:
                    precise = copy.deepcopy(reference).to(torch.float64)
                exact = precise(prefix.to(reference.device)).logits[0, -1].cpu()
                error = max(abs(float(high[t].double() - exact[t])) for t in (a, b))
                top2 = high.topk(2).values
                case.update(rounding_error=error, top2_gap=float(top2[0] - top2[1]), low_precision_gap=None,
                            fp64_gap=abs(float(exact[a] - exact[b])), fp64_picks_ours=bool(exact[a] > exact[b]),
                            near_tie=abs(float(exact[a] - exact[b])) <= 2 * error)
            cases.append(case)
        if cases:
            report[name] = {"divergent": len(cases), "near_ties": sum(c["near_tie"] for c in cases),
                            "unexplained": sum(not (c["near_tie"] or c.get("fp64_picks_ours", c["fp32_picks_ours"]))
                                               for c in cases),
                            "max_fp32_gap": max(c["fp32_gap"] for c in cases), "cases": cases}
    return report


def describe_divergences(report: dict) -> list[str]:
    """One line per method of a ``divergence_report``."""
    return [f"{name}: {row['divergent']} outputs differ from HF greedy, {row['near_ties']} of them at a near-tie, "
            f"{row['unexplained']} neither a near-tie nor the higher precision's choice (largest float32 logit gap "
            f"{row['max_fp32_gap']:.4f})" for name, row in report.items()]


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


def summarize(stats: dict[str, MethodStats], methods: dict[str, Method], decoders: dict, temperature: float) -> dict:
    """Per-method rates and ratios over the prompts run so far.

    ``speedup`` is over ``hf-greedy``; when HF greedy also ran in another dtype (``HFBaseline('hf-greedy',
    'bfloat16')``), every row also gets ``speedup_vs_fastest_hf_greedy``, over whichever HF greedy run was faster.
    """
    rate = {name: s.tokens / s.seconds for name, s in stats.items()}
    hf = {name for name, method in methods.items() if isinstance(method, HFBaseline)}
    greedy = [name for name in hf if methods[name].method == "hf-greedy"]
    base, fastest = rate[BASELINE], max(rate[name] for name in greedy)
    summary = {}
    for name, s in stats.items():
        tps = rate[name]
        sizing = decoders[name].tree_size_report() if name in decoders else {}
        summary[name] = {
            "tokens_per_s": tps,
            # tokens per pass after the prefill, as the decoders count it: the prefill pass and its token are left
            # out of HF's counts too (in HF's assisted modes that pass also verifies drafts)
            "tau": (s.tokens - s.prompts) / max(s.forwards - s.prompts, 1) if name in hf else
            (statistics.mean(s.accept_lengths) if s.accept_lengths else 1.0),
            "speedup": tps / base,
            **({"speedup_vs_fastest_hf_greedy": tps / fastest} if len(greedy) > 1 else {}),
            "identical": s.identical / s.prompts if temperature == 0 else None,
            "per_prompt_tokens_per_s": {"min": min(s.per_prompt_tps), "median": statistics.median(s.per_prompt_tps),
                                        "max": max(s.per_prompt_tps)},
            "tokens": s.tokens, "seconds": s.seconds, "draft_share": s.draft_seconds / s.seconds,
            "tree_size": sizing.get("reason"), "tree_sizes_used": sizing.get("sizes"),
            "depth_acceptance": [taken / tried for taken, tried in zip(s.depth_accepts, s.depth_attempts)],
            "acceptance_monitor": decoders[name].monitor.report() if name in decoders else None,
        }
    return summary


def median_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn()`` after one warm-up call (a micro-benchmark's timing)."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def score_divergences(records, encoded, methods: dict[str, Method], models: HFModels) -> dict:
    """``divergence_report`` for a run's methods: each scored on the model it ran on (``models``: the run's HF
    models by dtype), against a float32 copy of the target."""
    ran_on = {name: models.model(method.dtype if isinstance(method, HFBaseline) else None)
              for name, method in methods.items() if name != BASELINE}
    return divergence_report(records, encoded, ran_on, models.model("float32"), models.model(methods[BASELINE].dtype))


def run_benchmark(target, target_name: str, methods: dict[str, Method], prompts: list[dict], output: str | Path, *,
                  max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0, tree_size: int | None = None,
                  prompts_source: str | None = None, stride: int = 1, plot: str | Path | None = None,
                  progress: bool = True) -> dict:
    """Run ``methods`` on ``prompts`` ([{"id", "prompt"}], e.g. from ``runtime.prompts.read_prompts``) and write the
    results to ``output`` (JSON: ``methods`` (the summary), ``config``, ``divergences``, ``records`` (every output)).

    ``target`` is the loaded target (``target_name``: what it was loaded from, to load copies in other dtypes); the
    HF baseline ``hf-greedy`` is added first when ``methods`` lacks it. ``tree_size``: the tree size of decoder
    methods without their own. ``prompts_source``: the prompts file recorded in the results (None: MT-bench).
    The output file holds every finished prompt while the run goes on. After a greedy run, outputs that differ from
    HF greedy get a ``divergence_report``. Per-method accept-length histograms go to ``plot`` (None: beside
    ``output`` as .png). Returns what it wrote.
    """
    from tqdm import tqdm

    from runtime.decoder import SpeculativeDecoder
    from runtime.prompts import encode_prompt
    from runtime.proposers import build_proposer

    if BASELINE not in methods:
        methods = {BASELINE: HFBaseline("hf-greedy"), **methods}  # the baseline every ratio refers to
    check_methods(methods, target.num_layers)
    if not prompts:
        raise ValueError("run_benchmark needs at least one prompt")
    output = Path(output)
    models = HFModels(target, target_name)
    eos = sorted(target.eos_token_ids)
    if temperature > 0 and any(isinstance(method, PeerMethod) for method in methods.values()):
        raise ValueError("the peer decoders (economize-*, flashspec-ngram) run greedy only: use temperature 0")
    decoders = {name: SpeculativeDecoder(target, build_proposer(method.proposer, target),
                                         tree_size=method.tree_size or tree_size)
                for name, method in methods.items() if isinstance(method, DecoderMethod)}
    peers = {name: PeerDecoder(method, target, target_name) for name, method in methods.items()
             if isinstance(method, PeerMethod)}

    def run(name, ids, new_tokens):
        method = methods[name]
        if isinstance(method, HFBaseline):
            assistant = models.assistant(method.draft_model) if method.draft_model else None
            return run_hf(models.model(method.dtype), models.counter(method.dtype), ids, method, new_tokens, eos,
                          temperature, seed, assistant)
        if name in peers:
            return peers[name].generate(ids, new_tokens, eos)
        return run_ours(decoders[name], ids, new_tokens, temperature, seed)

    names = list(methods)
    try:
        encoded = [encode_prompt(target.tokenizer, p["prompt"]) for p in prompts]
        for name in names:  # warm-up: first-call allocations and lazy initialisation stay out of the timings
            run(name, encoded[0], 16)
        stats = {name: MethodStats() for name in names}
        records = []
        config = {"target": target_name, "dtype": dtype_name(target.dtype), "prompts": prompts_source or "mt-bench",
                  "stride": stride, "n_prompts": len(prompts), "max_new_tokens": max_new_tokens,
                  "temperature": temperature, "threads": torch.get_num_threads(), "torch": torch.__version__,
                  "machine": machine_description(target.device),
                  "method_specs": {name: method_to_json(method) for name, method in methods.items()}}
        for index, ids in enumerate(tqdm(encoded, desc="benchmark", file=sys.stderr, disable=not progress)):
            order = names[index % len(names):] + names[: index % len(names)]  # rotate who goes first
            outputs = {}
            for name in order:
                tokens, seconds, forwards, details = run(name, ids, max_new_tokens)
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
            for name in names:
                stats[name].identical += outputs[name] == outputs[BASELINE]
            records.append({"id": prompts[index]["id"], "outputs": outputs})
            # A long run keeps what it has measured: the file holds every finished prompt until the final write.
            write_json_atomically(output, {"methods": summarize(stats, methods, decoders, temperature),
                                      "config": {**config, "n_prompts_done": index + 1}, "records": records})

        summary = summarize(stats, methods, decoders, temperature)
        divergences = {}
        if temperature == 0 and any(row["identical"] < 1 for row in summary.values()):
            divergences = score_divergences(records, encoded, methods, models)
    finally:
        models.close()
    results = {"methods": summary, "config": config, "divergences": divergences, "records": records}
    write_json_atomically(output, results)
    plot_histograms(stats, Path(plot) if plot else output.with_suffix(".png"))
    return results


def rescore(path: str | Path, methods: dict[str, Method] | None = None, device: str | torch.device | None = None,
            ) -> dict:
    """Recompute the divergence report of a finished results file in place (no decoding, no timing); returns it.

    ``methods``: what each method in the file was (default: as the file records them in ``config.method_specs``).
    ``device``: where to load the models (default: the first GPU when there is one)."""
    from runtime.prompts import encode_prompt, read_prompts
    from runtime.target import load_target

    path = Path(path)
    results = json.loads(path.read_text())
    config = results["config"]
    if config.get("mode") == "batch":
        raise ValueError(f"{path} holds a batch benchmark (run_batch_benchmark), which has no divergence report")
    if methods is None:
        if "method_specs" not in config:
            raise ValueError(f"{path} does not record its methods (config.method_specs): pass rescore(methods=...)")
        methods = {name: method_from_json(data) for name, data in config["method_specs"].items()}
    missing = set(results["methods"]) - set(methods)
    if missing:
        raise ValueError(f"rescore(methods=...) lacks {', '.join(sorted(missing))}, which {path} holds")
    methods = {name: methods[name] for name in results["methods"]}
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(config["target"], dtype=config["dtype"], device=device, quiet=True)
    prompts = {p["id"]: p["prompt"] for p in read_prompts(None if config["prompts"] == "mt-bench" else
                                                           config["prompts"])}
    encoded = [encode_prompt(target.tokenizer, prompts[record["id"]]) for record in results["records"]]
    models = HFModels(target, config["target"])
    results["divergences"] = score_divergences(results["records"], encoded, methods, models)
    write_json_atomically(path, results)
    return results["divergences"]


# --- throughput at a batch size ---

BATCH_HF_METHODS = ("hf-greedy",)  # transformers' prompt lookup and assisted generation run one prompt at a time


def check_batch_methods(methods: dict[str, Method]) -> None:
    """What ``run_batch_benchmark`` can run: HF greedy (in any dtype) and our decoders."""
    for name, method in methods.items():
        if isinstance(method, PeerMethod):
            raise ValueError(f"{name}: the peer decoders run one prompt at a time; benchmark them without a batch size")
        if isinstance(method, HFBaseline) and method.method not in BATCH_HF_METHODS:
            raise ValueError(f"{name}: {method.method} runs one prompt at a time in transformers; at a batch size "
                             f"the HF baseline is hf-greedy (in any dtype)")


def batch_methods(methods: dict[str, Method]) -> dict[str, Method]:
    """``methods`` without the HF baselines that do not batch (``default_methods`` for ``run_batch_benchmark``)."""
    return {name: method for name, method in methods.items()
            if not (isinstance(method, HFBaseline) and method.method not in BATCH_HF_METHODS)}


def until_stop(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first stop token (what a row of a batched ``generate`` really produced;
    the rest is padding)."""
    for index, token in enumerate(tokens):
        if token in eos:
            return tokens[: index + 1]
    return tokens


def run_hf_batch(model, rows: list[torch.Tensor], max_new_tokens: int, eos: list[int], pad: int
                 ) -> tuple[list[list[int]], float]:
    """HF greedy ``generate`` on ``rows`` (token ids, each [P]) as one left-padded batch: (each row's new tokens up
    to its first stop token, seconds)."""
    from runtime.cost_model import synchronized_seconds
    from runtime.prompts import left_padded

    input_ids, attention_mask = left_padded(rows, pad)
    started = time.perf_counter()
    out = model.generate(input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad,
                         **plain_generation_settings(model))
    seconds = synchronized_seconds(model.device, started)
    stops = set(eos)
    return [until_stop(row, stops) for row in out[:, input_ids.shape[1]:].tolist()], seconds


def run_ours_batch(decoder, rows: list[torch.Tensor], max_new_tokens: int, batch_size: int):
    """``decoder.generate`` (a BatchedDecoder) on ``rows``, ``batch_size`` at a time: (the GenerationResults,
    seconds)."""
    from runtime.cost_model import synchronized_seconds

    started = time.perf_counter()
    results = decoder.generate(rows, max_new_tokens, batch_size=batch_size)
    return results, synchronized_seconds(decoder.target.device, started)


def summarize_batch(stats: dict[int, dict[str, MethodStats]], methods: dict[str, Method],
                    decoders: dict[int, dict]) -> dict:
    """{batch size (str): {method: row}} for every batch size run, batch 1 first. A row: total tokens/s
    (``tokens_per_s``), the speedup over HF greedy at the same batch size (``speedup``), what the batch gains over the
    method's own batch-1 run (``batch_gain``), tau, the fraction of rows token-identical to HF greedy decoding each
    prompt alone (``identical``), the share of time spent drafting, the tree size and why, the acceptance per depth
    and the acceptance monitor's report. With HF greedy in several dtypes, ``speedup_vs_fastest_hf_greedy`` is over
    the fastest of them at that batch size."""
    greedy = [name for name, method in methods.items() if isinstance(method, HFBaseline)]
    summary = {}
    rate1 = {name: s.tokens / s.seconds for name, s in stats[1].items()}
    for size, by_method in stats.items():
        rate = {name: s.tokens / s.seconds for name, s in by_method.items()}
        fastest = max(rate[name] for name in greedy)
        rows = {}
        for name in methods:
            s, decoder = by_method[name], decoders[size].get(name)
            rows[name] = {
                "tokens_per_s": rate[name], "speedup": rate[name] / rate[BASELINE],
                **({"speedup_vs_fastest_hf_greedy": rate[name] / fastest} if len(greedy) > 1 else {}),
                "batch_gain": rate[name] / rate1[name],
                "tau": statistics.mean(s.accept_lengths) if s.accept_lengths else 1.0,
                "identical": s.identical / s.prompts, "tokens": s.tokens, "seconds": s.seconds,
                "draft_share": s.draft_seconds / s.seconds,
                "tree_size": decoder.tree_size_report()["reason"] if decoder is not None else None,
                "depth_acceptance": [taken / tried for taken, tried in zip(s.depth_accepts, s.depth_attempts)],
                "acceptance_monitor": decoder.monitor.report() if decoder is not None else None,
            }
        summary[str(size)] = rows
    return summary


def batch_markdown_table(summary: dict) -> str:
    """The batch benchmark's summary (``summarize_batch``) as a markdown table, a line per method and batch size."""
    lines = ["| method | batch | tokens/s | vs HF greedy | vs own batch 1 | tau | identical |", "|---|" + "---:|" * 6]
    for size, rows in summary.items():
        for name, row in rows.items():
            lines.append(f"| {name} | {size} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | "
                         f"{row['batch_gain']:.2f}x | {row['tau']:.2f} | {row['identical']:.0%} |")
    return "\n".join(lines)


def output_summary(tokens: list[int], reference: list[int]) -> dict:
    """What a results file keeps of an output: its length, whether it equals ``reference`` (HF greedy decoding the
    prompt alone) and where it first differs (None: it does not)."""
    return {"tokens": len(tokens), "identical": tokens == reference,
            "first_difference": first_divergence(tokens, reference)}


def check_batch_sizes(batch_sizes) -> list[int]:
    """The batch sizes to run, ascending, batch 1 always among them (every row's reference and every method's own
    batch-1 run); a ValueError for a size below 1."""
    sizes = sorted(set(batch_sizes) | {1})
    if sizes[0] < 1:
        raise ValueError(f"batch sizes must be >= 1, got {sorted(set(batch_sizes))}")
    return sizes


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
    ``runtime.cost_model.BATCH_SIZES`` (``config["pass_seconds"]``), what decides where drafting stops paying.
    """
    from tqdm import tqdm

    from runtime.batched import BatchedDecoder
    from runtime.cost_model import cost_curve
    from runtime.decoder import SpeculativeDecoder
    from runtime.prompts import batch_pad_token_id, encode_prompt
    from runtime.proposers import build_proposer

    sizes = check_batch_sizes(batch_sizes)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (prompts), got {chunk_size}")
    if BASELINE not in methods:
        methods = {BASELINE: HFBaseline("hf-greedy"), **methods}
    check_methods(methods, target.num_layers)
    check_batch_methods(methods)
    if not prompts:
        raise ValueError("run_batch_benchmark needs at least one prompt")
    output = Path(output)
    models = HFModels(target, target_name)
    eos = sorted(target.eos_token_ids)
    if not eos:
        raise ValueError("the target has no end-of-sequence token: HF generate needs one to pad finished rows with")
    tokenizer = target.tokenizer
    pad = batch_pad_token_id(tokenizer) if tokenizer is not None else eos[0]
    decoders: dict[int, dict] = {size: {} for size in sizes}
    for name, method in methods.items():
        if isinstance(method, DecoderMethod):
            proposer = build_proposer(method.proposer, target)
            size = method.tree_size or tree_size
            decoders[1][name] = SpeculativeDecoder(target, proposer, tree_size=size)
            for rows in sizes[1:]:
                decoders[rows][name] = BatchedDecoder(target, proposer, tree_size=size)
    counters = {name: models.counter(method.dtype) for name, method in methods.items()
                if isinstance(method, HFBaseline)}

    def run_batched(name, rows, new_tokens, batch_size):
        """[(tokens, GenerationResult or None)] for ``rows`` at ``batch_size``, and the seconds they took."""
        if name in decoders[batch_size]:
            results, seconds = run_ours_batch(decoders[batch_size][name], rows, new_tokens, batch_size)
            return [(result.tokens, result) for result in results], seconds
        outputs, seconds = [], 0.0
        model = models.model(methods[name].dtype)
        for start in range(0, len(rows), batch_size):
            tokens, took = run_hf_batch(model, rows[start:start + batch_size], new_tokens, eos, pad)
            outputs.extend((row, None) for row in tokens)
            seconds += took
        return outputs, seconds

    def run_single(name, ids, new_tokens):
        if name in decoders[1]:
            return run_ours(decoders[1][name], ids, new_tokens, 0.0, 0)
        method = methods[name]
        return run_hf(models.model(method.dtype), counters[name], ids, method, new_tokens, eos)

    def add(s: MethodStats, tokens: list[int], details) -> None:
        s.tokens += len(tokens)
        s.prompts += 1
        if details is not None:
            s.draft_seconds += details.draft_seconds
            s.accept_lengths.extend(details.accept_lengths)
            s.add_depths(details.depth_attempts, details.depth_accepts)

    names = list(methods)
    try:
        encoded = [encode_prompt(tokenizer, p["prompt"]) for p in prompts]
        step = -(-(chunk_size or sizes[-1]) // sizes[-1]) * sizes[-1]
        chunks = [list(range(start, min(start + step, len(prompts)))) for start in range(0, len(prompts), step)]
        # a batched decoder sizes its tree from the cost curve at its width, measured once on first use: a short
        # last chunk decodes at fewer rows, whose curve is measured here rather than inside its timing
        widths = {min(size, len(chunk)) for size in sizes[1:] for chunk in chunks} - {1}
        if any(decoders[size] for size in sizes[1:]):
            for width in sorted(widths):
                cost_curve(target, width)
        for name in names:  # warm-up at every batch size (a batched decoder sizes its tree for its width here)
            for size in sizes[1:]:
                run_batched(name, encoded[:size], 16, size)
            run_single(name, encoded[0], 16)
        stats = {size: {name: MethodStats() for name in names} for size in sizes}
        records = [{"id": p["id"], "outputs": {str(size): {} for size in sizes}} for p in prompts]
        config = {"mode": "batch", "batch_sizes": sizes, "chunk_size": step, "target": target_name,
                  "dtype": dtype_name(target.dtype), "prompts": prompts_source or "mt-bench", "stride": stride,
                  "n_prompts": len(prompts), "max_new_tokens": max_new_tokens, "temperature": 0.0, "pad_token_id": pad,
                  "threads": torch.get_num_threads(), "torch": torch.__version__,
                  "machine": machine_description(target.device),
                  "method_specs": {name: method_to_json(method) for name, method in methods.items()}}
        if pass_costs:
            from runtime.cost_model import BATCH_SIZES, measure_pass_seconds

            config["pass_seconds"] = {str(rows): {str(nodes): seconds for nodes, seconds in
                                                  measure_pass_seconds(target, sizes=BATCH_SIZES,
                                                                       batch_size=rows).items()}
                                      for rows in sizes}
        done = 0
        for number, chunk in enumerate(tqdm(chunks, desc="batch benchmark", file=sys.stderr,
                                            disable=not progress or len(chunks) == 1)):
            rows = [encoded[index] for index in chunk]
            for size in sizes[1:]:
                for name in names[number % len(names):] + names[: number % len(names)]:
                    outputs, seconds = run_batched(name, rows, max_new_tokens, size)
                    stats[size][name].seconds += seconds
                    for index, (tokens, details) in zip(chunk, outputs):
                        records[index]["outputs"][str(size)][name] = tokens
                        add(stats[size][name], tokens, details)
            for index in chunk:
                for name in names[index % len(names):] + names[: index % len(names)]:
                    tokens, seconds, _, details = run_single(name, encoded[index], max_new_tokens)
                    records[index]["outputs"]["1"][name] = tokens
                    stats[1][name].seconds += seconds
                    stats[1][name].per_prompt_tps.append(len(tokens) / seconds)
                    add(stats[1][name], tokens, details)
                reference = records[index]["outputs"]["1"][BASELINE]
                for size in sizes:
                    outputs = records[index]["outputs"][str(size)]
                    for name in names:
                        # the file keeps a summary of each output, not its tokens
                        outputs[name] = output_summary(outputs[name], reference)
                        stats[size][name].identical += outputs[name]["identical"]
            done += len(chunk)
            write_json_atomically(output, {"methods": summarize_batch(stats, methods, decoders),
                                      "config": {**config, "n_prompts_done": done}, "records": records[:done]})
        summary = summarize_batch(stats, methods, decoders)
    finally:
        models.close()
    results = {"methods": summary, "config": config, "records": records}
    write_json_atomically(output, results)
    return results
