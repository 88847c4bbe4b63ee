"""The scripts' shared command-line spellings, parsed into the library's typed values.

Proposers (``--proposer``, and ``--methods`` of the benchmark): ``none``, ``ngram``, ``draft`` (with
``--draft-model``), a head ``medusa`` / ``eagle`` / ``eagle3``, ``HEAD+ngram`` (prompt lookup first), and
``HEAD:DIR`` / ``HEAD+ngram:DIR`` for a head directory -> ``runtime.proposers.ProposerSpec``.

Benchmark methods (``--methods``): a proposer as above, optionally ``@N`` (its verified tree size); ``hf-greedy``,
``hf-pld`` (either with ``-bf16`` / ``-fp32``: on a copy of the target in that dtype), ``hf-assisted`` (with
``--draft-model``), ``hf-early-exit[:N]`` -> ``runtime.benchmark.HFBaseline`` / ``DecoderMethod``.

Numbers (``positive_int``, ``non_negative_float``, ``probability``: argparse ``type=`` functions), the output path
(``check_output_path``) and the prompts file (``read_prompts_or_exit``) are checked the same way in every script.

Mistakes are reported as command-line errors naming the flag (SystemExit), before anything is loaded. The scripts
import this module as a sibling (``from cli import ...``): Python puts scripts/ first on sys.path when it runs one.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from runtime.benchmark import DecoderMethod, HFBaseline, Method
from runtime.proposers import NoShippedHead, Proposer, build_proposer
from runtime.proposers.spec import HEAD_PROPOSERS, PROPOSER_NAMES, ProposerSpec

LOOKUP_FIRST = "+ngram"  # "eagle3+ngram": prompt lookup where it finds a match, the head elsewhere
PROPOSER_CHOICES = (*PROPOSER_NAMES, *(name + LOOKUP_FIRST for name in HEAD_PROPOSERS))
HF_DTYPE_SUFFIXES = {"-bf16": "bfloat16", "-fp32": "float32"}  # hf-greedy-bf16: HF greedy on a bf16 copy
EARLY_EXIT = "hf-early-exit"
HF_NAMES = ("hf-greedy", "hf-pld", "hf-assisted", EARLY_EXIT)


def usage_error(flag: str, message: str) -> SystemExit:
    return SystemExit(f"error: {flag}: {message}")


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1 (counts and sizes: 0 or less would select or generate nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a whole number of 1 or more") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer; give 1 or more")
    return value


def positive_int_list(text: str) -> list[int]:
    """argparse ``type=``: comma-separated integers >= 1 (``4,16``)."""
    return [positive_int(part.strip()) for part in text.split(",")]


def non_negative_float(text: str) -> float:
    """argparse ``type=``: a finite number >= 0 (a temperature: nan or inf would fail deep inside sampling)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a number of 0 or more") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a finite number >= 0; give 0 (greedy) or more")
    return value


def probability(text: str) -> float:
    """argparse ``type=``: a number in (0, 1] (top-p: the probability mass to keep)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give one in (0, 1]") from None
    if not 0 < value <= 1:  # also false for nan
        raise argparse.ArgumentTypeError(f"{text} is outside (0, 1]; give a probability mass such as 0.9")
    return value


def check_output_path(path: str | None, flag: str = "--output") -> None:
    """An output file the script can write once it has done its work: its directory exists, it is not a directory."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise usage_error(flag, f"{path} is a directory; give a file name (e.g. {target / 'out.jsonl'})")
    if not target.parent.is_dir():
        raise usage_error(flag, f"the directory of {path} does not exist; create it first (mkdir -p "
                                f"{target.parent}) or write elsewhere")


def read_prompts_or_exit(path: str | None, limit: int | None = None, flag: str = "--prompts") -> list[dict]:
    """``runtime.prompts.read_prompts``, with a missing or malformed file reported as a command-line error."""
    from runtime.prompts import PROMPT_LINE_EXAMPLE, read_prompts

    try:
        prompts = read_prompts(path, limit)
    except (OSError, ValueError) as error:
        raise usage_error(flag, str(error)) from None
    if not prompts:
        raise usage_error(flag, f"{path} holds no prompt; write one JSON object a line: {PROMPT_LINE_EXAMPLE}")
    return prompts


def parse_proposer(text: str, *, head: str | None = None, draft_model: str | None = None,
                   flag: str = "--proposer") -> ProposerSpec:
    """``eagle3``, ``eagle3+ngram``, ``eagle3:DIR``, ``eagle3+ngram:DIR``, ``ngram``, ``draft`` ... as a
    ProposerSpec; ``head`` is the ``--head`` flag's directory, ``draft_model`` the ``--draft-model`` flag's model
    (used by ``draft`` only)."""
    name, colon, directory = text.partition(":")
    if colon and not directory:
        raise usage_error(flag, f"{text!r} names no head directory after ':'")
    if colon and head is not None and directory != head:
        raise usage_error(flag, f"{text!r} names a head directory, and --head names another ({head})")
    lookup_first = name.endswith(LOOKUP_FIRST)
    base = name[: -len(LOOKUP_FIRST)] if lookup_first else name
    if base not in PROPOSER_NAMES or (lookup_first and base not in HEAD_PROPOSERS):
        raise usage_error(flag, f"unknown proposer {name!r}; choose one of {', '.join(PROPOSER_CHOICES)} "
                                "(a head as HEAD:DIR for a head directory)")
    directory = directory or head
    if directory and base not in HEAD_PROPOSERS:
        raise usage_error(flag, f"a head directory is for {', '.join(HEAD_PROPOSERS)}, not {base!r}")
    if base == "draft" and not draft_model:
        raise usage_error(flag, "draft needs --draft-model (a smaller model with the target's tokenizer)")
    return ProposerSpec(base, head=directory or None, lookup_first=lookup_first,
                        draft_model=draft_model if base == "draft" else None)


def missing_head(error: NoShippedHead, flag: str = "--proposer", how: str = "--head DIR") -> SystemExit:
    """The command-line wording of ``NoShippedHead``: which flag gives the head directory."""
    return usage_error(flag, f"{error.head_type} needs {how} (a trained {error.head_type} head directory): no "
                             f"{error.head_type} head ships for target {error.identity!r} (shipped: {error.shipped}). "
                             f"Train one with `python training/train.py head={error.head_type} target.name=...`.")


def build_proposer_or_exit(spec: ProposerSpec, target, flag: str = "--proposer", how: str = "--head DIR") -> Proposer:
    """``build_proposer``, with a missing head, and a head that does not load for this target (another target's, a
    broken config, Medusa-2 adapters not merged in), reported as command-line errors."""
    try:
        return build_proposer(spec, target)
    except NoShippedHead as error:
        raise missing_head(error, flag, how) from None
    except (OSError, ValueError) as error:
        if spec.name not in HEAD_PROPOSERS:
            raise
        raise usage_error(flag, str(error)) from None


def parse_method(text: str, *, draft_model: str | None = None, flag: str = "--methods") -> Method:
    """One benchmark method (see the module's docstring) as an HFBaseline or a DecoderMethod."""
    for suffix, dtype in HF_DTYPE_SUFFIXES.items():
        if text.endswith(suffix) and text[: -len(suffix)] in ("hf-greedy", "hf-pld"):
            return HFBaseline(text[: -len(suffix)], dtype=dtype)
    if text == EARLY_EXIT or text.startswith(EARLY_EXIT + ":"):
        _, _, given = text.partition(":")
        if given and not (given.isdigit() and int(given) >= 1):
            raise usage_error(flag, f"{text}: N must be a layer count (a positive integer)")
        return HFBaseline(EARLY_EXIT, early_exit_layers=int(given) if given else None)
    if text == "hf-assisted":
        if not draft_model:
            raise usage_error(flag, "hf-assisted needs --draft-model (a smaller model with the target's tokenizer)")
        return HFBaseline("hf-assisted", draft_model=draft_model)
    if text in HF_NAMES:
        return HFBaseline(text)
    if text.startswith("hf-"):
        raise usage_error(flag, f"unknown HF baseline {text!r}; choose one of hf-greedy, hf-pld (either with -bf16 or "
                                "-fp32), hf-assisted, hf-early-exit[:N]")
    proposer, at, size = text.rpartition("@")
    if not at or (":" in proposer and not size.isdigit()):  # no tree size, or an '@' inside a head directory
        proposer, size = text, ""
    elif not (size.isdigit() and int(size) >= 1):
        raise usage_error(flag, f"{text}: the tree size after '@' must be a positive integer")
    spec = parse_proposer(proposer, draft_model=draft_model, flag=flag)
    return DecoderMethod(spec, tree_size=int(size) if size else None)


def parse_methods(text: str, *, draft_model: str | None = None, flag: str = "--methods") -> dict[str, Method]:
    """A comma-separated list of benchmark methods: {name as given: method}."""
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise usage_error(flag, f"{text!r} has an empty method name")
    if len(set(names)) != len(names):
        raise usage_error(flag, f"{text!r} names a method twice")
    return {name: parse_method(name, draft_model=draft_model, flag=flag) for name in names}


def check_early_exit(methods: dict[str, Method], num_layers: int, flag: str = "--methods") -> None:
    """The ``hf-early-exit:N`` depths against the loaded target's layer count."""
    for name, method in methods.items():
        n = method.early_exit_layers if isinstance(method, HFBaseline) else None
        if n is not None and not 1 <= n < num_layers:
            raise usage_error(flag, f"{name}: N must be a layer count from 1 to {num_layers - 1} (the target has "
                                    f"{num_layers} layers)")


def parse_grid_setting(text: str, fields: tuple[str, ...], flag: str = "--grid") -> list[int]:
    """``2,8,4`` -> [2, 8, 4]: one integer per name in ``fields``."""
    parts = text.split(",")
    if len(parts) != len(fields) or not all(part.strip().isdigit() for part in parts):
        raise usage_error(flag, f"setting {text!r}: expected {','.join(fields)} (integers)")
    return [int(part) for part in parts]
