"""Why an output differs from HF greedy: for each such output, is its first divergence a near-tie that rounding
alone can flip, or a difference rounding does not explain?

``divergence_report`` scores the first differing position of every such output with plain forwards in float32 (or
float64 where every run was float32); ``rescore`` recomputes it for a finished results file, without decoding.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from bench.hf import HFModels
from bench.methods import BASELINE, HFBaseline, Method, method_from_json
from bench.prompts import read_recorded_prompts
from runtime.engine.prompts import encode_prompt
from runtime.target.assets import write_json_atomically
from runtime.target.model import load_target


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
                case.update(low_precision_case(runs, high, a, b, case["fp32_gap"]))
            else:
                if precise is None:
                    precise = copy.deepcopy(reference).to(torch.float64)
                exact = precise(prefix.to(reference.device)).logits[0, -1].cpu()
                case.update(float32_case(high, exact, a, b))
            cases.append(case)
        if cases:
            report[name] = {"divergent": len(cases), "near_ties": sum(c["near_tie"] for c in cases),
                            "unexplained": sum(not (c["near_tie"] or c.get("fp64_picks_ours", c["fp32_picks_ours"]))
                                               for c in cases),
                            "max_fp32_gap": max(c["fp32_gap"] for c in cases), "cases": cases}
    return report


def low_precision_case(runs: list[torch.Tensor], high: torch.Tensor, a: int, b: int, fp32_gap: float) -> dict:
    """A divergence where a run was in low precision: ``runs`` are the low-precision runs' logits, ``high`` float32's;
    a near-tie when float32's gap is within twice their rounding error, or a run's own gap within one rounding
    step."""
    error = max(abs(float(run[t].float() - high[t])) for run in runs for t in (a, b))
    low_gaps = [(abs(float(run[a].float() - run[b].float())), rounding_step(run[b])) for run in runs]
    top2 = runs[0].float().topk(2).values
    return dict(rounding_error=error, top2_gap=float(top2[0] - top2[1]),
                low_precision_gap=min(gap for gap, _ in low_gaps),
                near_tie=fp32_gap <= 2 * error or any(gap <= step for gap, step in low_gaps))


def float32_case(high: torch.Tensor, exact: torch.Tensor, a: int, b: int) -> dict:
    """A divergence between float32 runs: ``exact`` (float64's logits) judges, against float32's own error."""
    error = max(abs(float(high[t].double() - exact[t])) for t in (a, b))
    top2 = high.topk(2).values
    return dict(rounding_error=error, top2_gap=float(top2[0] - top2[1]), low_precision_gap=None,
                fp64_gap=abs(float(exact[a] - exact[b])), fp64_picks_ours=bool(exact[a] > exact[b]),
                near_tie=abs(float(exact[a] - exact[b])) <= 2 * error)


def describe_divergences(report: dict) -> list[str]:
    """One line per method of a ``divergence_report``."""
    return [f"{name}: {row['divergent']} outputs differ from HF greedy, {row['near_ties']} of them at a near-tie, "
            f"{row['unexplained']} neither a near-tie nor the higher precision's choice (largest float32 logit gap "
            f"{row['max_fp32_gap']:.4f})" for name, row in report.items()]


def score_divergences(records, encoded, methods: dict[str, Method], models: HFModels) -> dict:
    """``divergence_report`` for a run's methods: each scored on the model it ran on (``models``: the run's HF
    models by dtype), against a float32 copy of the target."""
    ran_on = {name: models.model(method.dtype if isinstance(method, HFBaseline) else None)
              for name, method in methods.items() if name != BASELINE}
    return divergence_report(records, encoded, ran_on, models.model("float32"), models.model(methods[BASELINE].dtype))


def rescore(path: str | Path, methods: dict[str, Method] | None = None, device: str | torch.device | None = None,
            ) -> dict:
    """Recompute the divergence report of a finished results file in place (no decoding, no timing); returns it.

    ``methods``: what each method in the file was (default: as the file records them in ``config.method_specs``).
    ``device``: where to load the models (default: the first GPU when there is one)."""
    path = Path(path)
    results = json.loads(path.read_text())
    config = results["config"]
    if config.get("mode") == "batch":
        raise ValueError(f"{path} holds a batch benchmark (run_batch_benchmark), which has no divergence report")
    methods = recorded_methods(path, results, methods)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(config["target"], dtype=config["dtype"], device=device, quiet=True)
    prompts = {p["id"]: p["prompt"] for p in read_recorded_prompts(config["prompts"])}
    encoded = [encode_prompt(target.tokenizer, prompts[record["id"]]) for record in results["records"]]
    models = HFModels(target, config["target"])
    results["divergences"] = score_divergences(results["records"], encoded, methods, models)
    write_json_atomically(path, results)
    return results["divergences"]


def recorded_methods(path: Path, results: dict, methods: dict[str, Method] | None) -> dict[str, Method]:
    """The methods of results file ``path``, in its order: ``methods`` where given (it must name all of them), else
    as the file records them."""
    if methods is None:
        if "method_specs" not in results["config"]:
            raise ValueError(f"{path} does not record its methods (config.method_specs): pass rescore(methods=...)")
        methods = {name: method_from_json(data) for name, data in results["config"]["method_specs"].items()}
    missing = set(results["methods"]) - set(methods)
    if missing:
        raise ValueError(f"rescore(methods=...) lacks {', '.join(sorted(missing))}, which {path} holds")
    return {name: methods[name] for name in results["methods"]}
