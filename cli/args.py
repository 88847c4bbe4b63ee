"""The commands' shared command-line spellings, parsed into the library's typed values.

Proposers (``--proposer``, and ``--methods`` of the benchmark): ``none``, ``ngram``, ``draft`` (with
``--draft-model``), a head ``medusa`` / ``eagle`` / ``eagle3`` / ``dflash``, ``HEAD+ngram`` (prompt lookup first), and
``HEAD:DIR`` / ``HEAD+ngram:DIR`` for a head directory, ``lookahead`` / ``lookahead+ngram`` (prompt lookup first,
lookahead elsewhere), with ``:W,N,G[,R[,C[,P]]]`` for its sizes and switches -> ``runtime.proposers.ProposerSpec``.

Benchmark methods (``--methods``): a proposer as above, optionally ``@N`` (its verified tree size); the peer
decoders ``economize-eagle3[:DIR]``, ``economize-medusa[:DIR]``, ``flashspec-ngram`` (``bench.peers``; ``@N``:
tokens per target forward); llama.cpp's ``llamacpp``, ``llamacpp-ngram[:TYPE]``, ``llamacpp-eagle3[:DIR][@N]``,
``llamacpp-dflash[:DIR][@N]``, ``llamacpp-gguf[:FILE]`` (``bench.llamacpp``); ``hf-greedy``,
``hf-pld`` (either with ``-bf16`` / ``-fp32``: on a copy of the target in that dtype), ``hf-assisted`` (with
``--draft-model``), ``hf-early-exit[:N]`` -> ``bench.methods.HFBaseline`` / ``DecoderMethod``.

Numbers (``positive_int``, ``non_negative_float``, ``probability``: argparse ``type=`` functions), the output path
(``check_output_path``) and the prompts file (``read_prompts_or_exit``) are checked the same way in every script.

Mistakes are reported as command-line errors naming the flag (SystemExit), before anything is loaded.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from bench.llamacpp import LLAMACPP_METHODS, NGRAM_TYPES, LlamaCppMethod, missing_llamacpp
from bench.methods import DecoderMethod, HFBaseline, Method
from bench.peers import PEER_METHODS, PeerMethod, missing_package
from bench.prompts import PROMPT_LINE_EXAMPLE, read_prompts
from runtime.proposers import NoShippedHead, Proposer, build_proposer
from runtime.proposers.spec import HEAD_PROPOSERS, LOOKUP_PROPOSERS, PROPOSER_NAMES, LookaheadSettings, ProposerSpec
from runtime.target.model import load_target, target_context

LOOKUP_FIRST = "+ngram"  # "eagle3+ngram": prompt lookup where it finds a match, the head elsewhere
PROPOSER_CHOICES = (*PROPOSER_NAMES, *(name + LOOKUP_FIRST for name in LOOKUP_PROPOSERS))
LOOKAHEAD = "lookahead"  # "lookahead:W,N,G[,R[,C[,P]]]": window, n-gram size, candidates, recycled, carry, prior
HF_DTYPE_SUFFIXES = {"-bf16": "bfloat16", "-fp32": "float32"}  # hf-greedy-bf16: HF greedy on a bf16 copy
EARLY_EXIT = "hf-early-exit"
HF_NAMES = ("hf-greedy", "hf-pld", "hf-assisted", EARLY_EXIT)


def usage_error(flag: str, message: str) -> SystemExit:
    return SystemExit(f"error: {flag}: {message}")


def _int_at_least(text: str, low: int, below: str) -> int:
    """``text`` as an integer >= ``low``; ``below`` says what a smaller one is."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a whole number of {low} or more") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} is {below}; give {low} or more")
    return value


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1 (counts and sizes: 0 or less would select or generate nothing)."""
    return _int_at_least(text, 1, "not a positive integer")


def non_negative_int(text: str) -> int:
    """argparse ``type=``: an integer >= 0 (an index)."""
    return _int_at_least(text, 0, "negative")


def check_head_directories(specs, flag: str = "--methods") -> None:
    """Each ProposerSpec's head directory (of ``specs``, or of methods holding them) exists: a typo is named
    before the target loads rather than after."""
    for spec in specs:
        spec = getattr(spec, "proposer", spec)
        directory = getattr(spec, "head", None)
        if directory and not Path(directory).expanduser().is_dir():
            raise usage_error(flag, f"{directory}: no such head directory (a trained head: a run's OUTPUT_DIR/head, "
                                    f"an export, or heads/shipped/NAME)")



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


def device(text: str) -> str:
    """argparse ``type=`` of --device: a device this PyTorch build and machine have (``cuda`` on a CPU-only build
    would fail after the target loaded)."""
    try:
        parsed = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; give cpu, cuda or cuda:N") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: this PyTorch build or machine has no CUDA device "
                                         f"(torch {torch.__version__}); use --device cpu, or install a CUDA build")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def cuda_graphs(args) -> bool:
    """--cuda-graphs, refused off a GPU: the fixed-shape passes it asks for are captured there only (on a CPU they
    would run eagerly, slower than the ordinary passes)."""
    if args.cuda_graphs and torch.device(args.device).type != "cuda":
        raise usage_error("--cuda-graphs", f"CUDA graphs are captured on a GPU, and --device is {args.device}; give "
                                           f"--device cuda, or leave --cuda-graphs out")
    return args.cuda_graphs


def check_new_output(path: str | None, force: bool, flag: str = "--output") -> None:
    """``check_output_path``, and an existing non-empty file is refused unless ``force``: a run replaces it only once
    it has succeeded, and without --force not at all."""
    check_output_path(path, flag)
    if path is not None and not force and Path(path).is_file() and Path(path).stat().st_size:
        raise usage_error(flag, f"{path} exists; write elsewhere, or pass --force to replace it once this run has "
                                f"finished (until then it stays as it is)")


def check_context(target_name: str, max_new_tokens: int, flag: str = "--max-new-tokens") -> None:
    """A --max-new-tokens no prompt could fit with in the target's context, found from its config before the
    weights load (nothing is said where the config cannot be read without loading: the check after loading
    stands)."""
    context = target_context(target_name)
    if context is not None and max_new_tokens >= context:
        raise usage_error(flag, f"{max_new_tokens} new tokens leave no room for a prompt in {target_name}'s context "
                                f"of {context} positions; give fewer than {context}")


def load_target_or_exit(name: str, flag: str = "--target", **settings):
    """``runtime.target.model.load_target``, with a target that cannot be found or read (not cached and the hub out
    of reach, a damaged file, a config that does not match its weights) reported as a command-line error."""
    try:
        return load_target(name, **settings)
    except (OSError, ValueError) as error:
        raise usage_error(flag, str(error)) from None


def read_prompts_or_exit(path: str | None, limit: int | None = None, flag: str = "--prompts") -> list[dict]:
    """``bench.prompts.read_prompts``, with a missing or malformed file reported as a command-line error."""
    try:
        prompts = read_prompts(path, limit)
    except (OSError, ValueError) as error:
        raise usage_error(flag, str(error)) from None
    if not prompts:
        raise usage_error(flag, f"{path} holds no prompt; write one JSON object a line: {PROMPT_LINE_EXAMPLE}")
    return prompts


def parse_lookahead(text: str, *, head: str | None = None, flag: str = "--proposer") -> ProposerSpec:
    """``lookahead``, ``lookahead+ngram``, either with ``:W,N,G``, ``:W,N,G,R``, ``:W,N,G,R,C`` or ``:W,N,G,R,C,P``
    (e.g. ``lookahead+ngram:8,3,8`` or ``lookahead:2,3,2,6``; R, the recycled nodes, is 0 when left out; C is 1 (the
    default) to carry the recycled successors from one generation to the next, 0 to start each generation without
    them; P is 1 (the default) to draw on the target's successor prior, measured on first use, 0 not to; C and P
    matter only with R > 0; without sizes they come from the target's cost curve, with C and P on) as a
    ProposerSpec."""
    name, colon, given = text.partition(":")
    if head is not None:
        raise usage_error(flag, f"{name} drafts without a head; drop --head")
    settings = None
    if colon:
        parts = [part.strip() for part in given.split(",")]
        valid = (len(parts) in (3, 4, 5, 6) and all(part.isdigit() for part in parts)
                 and all(part in ("0", "1") for part in parts[4:]))
        if not valid:
            raise usage_error(flag, f"{text!r}: give lookahead's sizes as {name}:W,N,G, {name}:W,N,G,R, "
                                    f"{name}:W,N,G,R,C or {name}:W,N,G,R,C,P (window, n-gram size, candidates, "
                                    f"recycled nodes: integers; C 1 to carry recycled successors across "
                                    f"generations, 0 not to; P 1 to draw on the target's successor prior, 0 not to), "
                                    f"e.g. {name}:8,3,8")
        sizes = [int(part) for part in parts]
        try:
            settings = LookaheadSettings(*sizes[:4], *(bool(c) for c in sizes[4:]))
        except ValueError as error:
            raise usage_error(flag, f"{text!r}: {error}") from None
    return ProposerSpec(LOOKAHEAD, lookup_first=name.endswith(LOOKUP_FIRST), lookahead=settings)


def parse_proposer(text: str, *, head: str | None = None, draft_model: str | None = None,
                   flag: str = "--proposer") -> ProposerSpec:
    """``eagle3``, ``eagle3+ngram``, ``eagle3:DIR``, ``eagle3+ngram:DIR``, ``ngram``, ``draft``,
    ``lookahead+ngram:W,N,G`` ... as a ProposerSpec; ``head`` is the ``--head`` flag's directory, ``draft_model`` the
    ``--draft-model`` flag's model (used by ``draft`` only)."""
    name, colon, directory = text.partition(":")
    if name in (LOOKAHEAD, LOOKAHEAD + LOOKUP_FIRST):
        return parse_lookahead(text, head=head, flag=flag)
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
        if spec.name not in (*HEAD_PROPOSERS, LOOKAHEAD):
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
    peer = parse_peer(text, flag) or parse_llamacpp(text, flag)
    if peer is not None:
        return peer
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


def parse_peer(text: str, flag: str = "--methods") -> PeerMethod | None:
    """``economize-eagle3``, ``economize-medusa`` (either with ``:DIR`` for a head directory), ``flashspec-ngram``,
    each optionally ``@N`` (tokens per target forward), as a PeerMethod; None for any other method name. A peer whose
    package is missing is an error naming the extra to install."""
    spec, at, size = text.rpartition("@") if "@" in text else (text, "", "")
    name, colon, directory = spec.partition(":")
    if name not in PEER_METHODS:
        return None
    if at and not (size.isdigit() and int(size) >= 2):
        raise usage_error(flag, f"{text}: the tokens per cycle after '@' must be an integer of 2 or more")
    if colon and (not directory or PEER_METHODS[name][1] is None):
        raise usage_error(flag, f"{text}: {name} takes no head directory" if directory else
                                f"{text!r} names no head directory after ':'")
    problem = missing_package(name)
    if problem:
        raise usage_error(flag, problem)
    return PeerMethod(name, head=directory or None, tokens_per_cycle=int(size) if at else None)


def parse_llamacpp(text: str, flag: str = "--methods") -> LlamaCppMethod | None:
    """``llamacpp``, ``llamacpp-ngram[:TYPE]`` (an n-gram type of llama.cpp's), ``llamacpp-eagle3[:DIR][@N]`` and
    ``llamacpp-dflash[:DIR][@N]`` (a head directory, a chain of N drafts), ``llamacpp-gguf[:FILE]`` as a
    LlamaCppMethod; None for any other method name. Where llama.cpp is not built, an error saying how to build it."""
    spec, at, size = text.rpartition("@") if "@" in text else (text, "", "")
    name, colon, given = spec.partition(":")
    if name not in LLAMACPP_METHODS:
        return None
    if at and not (name in ("llamacpp-eagle3", "llamacpp-dflash") and size.isdigit() and int(size) >= 1):
        raise usage_error(flag, f"{text}: '@N' (a chain of N drafts, N >= 1) is for llamacpp-eagle3 and "
                                f"llamacpp-dflash")
    if colon and (not given or name == "llamacpp"):
        raise usage_error(flag, f"{text!r} names nothing after ':'" if not given else f"{text}: llamacpp takes no ':'")
    if name == "llamacpp-gguf" and given and not Path(given).expanduser().is_file():
        raise usage_error(flag, f"{text}: no such GGUF file; llamacpp-gguf:FILE.gguf names the file llama.cpp "
                                f"serves (llamacpp-gguf alone: the one the target was loaded from)")
    if name == "llamacpp-ngram" and colon and given not in NGRAM_TYPES:
        raise usage_error(flag, f"{text}: choose one of llama.cpp's n-gram types {', '.join(NGRAM_TYPES)}")
    problem = missing_llamacpp()
    if problem:
        raise usage_error(flag, problem)
    if name == "llamacpp-ngram":
        return LlamaCppMethod(name, spec_type=given or None)
    if name in ("llamacpp-eagle3", "llamacpp-dflash"):
        return LlamaCppMethod(name, head=given or None, draft_max=int(size) if at else None)
    if name == "llamacpp-gguf":
        return LlamaCppMethod(name, model=str(Path(given).expanduser()) if given else None)
    return LlamaCppMethod(name)


def parse_methods(text: str, *, draft_model: str | None = None, flag: str = "--methods") -> dict[str, Method]:
    """A comma-separated list of benchmark methods: {name as given: method}."""
    names: list[str] = []
    for part in (part.strip() for part in text.split(",")):
        if names and part[:1].isdigit():  # no method starts with a digit: lookahead:W,N,G goes on
            names[-1] += "," + part
        else:
            names.append(part)
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
    if len(parts) != len(fields) or not all(part.strip().isdigit() and int(part) >= 1 for part in parts):
        raise usage_error(flag, f"setting {text!r}: expected {','.join(fields)} (positive integers)")
    return [int(part) for part in parts]
