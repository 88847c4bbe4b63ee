"""Running the command-line scripts as a user runs them, on a tiny random model that uses the default target's
tokenizer and chat template: shared by the tests of the scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from runtime.target.model import DEFAULT_TARGET, _float_cache_for_gguf, load_target, resolve_target
from tests.conftest import tiny_model

REPO = Path(__file__).resolve().parent.parent


def run_script(script: str, *args, check: bool = True, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``python scripts/SCRIPT ARGS`` from the repository root (``-c CODE ARGS`` runs code); fails the test with
    the script's stderr."""
    command = [sys.executable, *(["-c", args[0], *args[1:]] if script == "-c" else [f"scripts/{script}", *args])]
    # one thread, like the test process: the subprocess must not fight the other core's work
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    result = subprocess.run([str(part) for part in command], cwd=cwd, capture_output=True, text=True, env=env,
                            timeout=900)
    if check and result.returncode != 0:
        raise AssertionError(f"{script} exited with {result.returncode}:\n{result.stderr[-4000:]}")
    return result


def default_tokenizer():
    """The default target's tokenizer (its float checkpoint is converted once into the cache)."""
    _, gguf = resolve_target(DEFAULT_TARGET)
    float_dir = _float_cache_for_gguf(gguf)
    if not (float_dir / "config.json").is_file():
        load_target(DEFAULT_TARGET)  # dequantizes once into the cache
    return AutoTokenizer.from_pretrained(float_dir)


def save_tiny_model(directory: Path) -> Path:
    """A 1-layer random model with SmolLM2's vocabulary and chat template, saved like any HF checkpoint."""
    tokenizer = default_tokenizer()
    model = tiny_model("llama", vocab_size=len(tokenizer), num_hidden_layers=1, hidden_size=16,
                       intermediate_size=32, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# Runs each script's main() on argument lists inside one interpreter, with model loading replaced by a failure: a
# mistake must be reported before anything loads, and a correct command gets as far as loading ("loads").
CHECK_ARGUMENTS = r"""
import contextlib, io, json, sys
import cli.args
from cli import benchmark, export, generate

class Loaded(Exception):
    pass

def load_target(*args, **kwargs):
    raise Loaded()

scripts = {"generate": generate, "benchmark": benchmark, "export": export}
cli.args.load_target = load_target  # what every command loads its target through
out = []
for script, argv in json.loads(sys.argv[1]):
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            scripts[script].main(argv)
        out.append({"outcome": "finished", "message": stderr.getvalue()})
    except Loaded:
        out.append({"outcome": "loads", "message": stderr.getvalue()})
    except SystemExit as error:  # argparse: code 2 after printing; the scripts' own checks: the message as code
        message = "" if isinstance(error.code, int) else str(error.code)
        out.append({"outcome": "error", "message": message + stderr.getvalue()})
print(json.dumps(out))
"""


def check_arguments(cases: list[tuple[str, list]]) -> list[dict]:
    """[{"outcome": "error" | "loads" | "finished", "message"}] for each (script name, argument list)."""
    cases = [(script, [str(arg) for arg in argv]) for script, argv in cases]
    result = run_script("-c", CHECK_ARGUMENTS, json.dumps(cases), cwd=REPO / "scripts")
    return json.loads(result.stdout)
