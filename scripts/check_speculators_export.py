"""Check our EAGLE-3 export with vLLM's speculators converter, in an environment of its own.

  python scripts/check_speculators_export.py [--head DIR] [--target NAME] [--venv DIR]

speculators pins an older transformers than this project, so it gets its own virtual environment (created in --venv
on top of this environment's packages, kept for later runs). The script exports the head (the shipped EAGLE-3 head
by default) in the vLLM layout, runs the converter there on it, and compares what it wrote with our export: every
tensor must come through unchanged and the draft layer's rope_theta must be the target's (a converter that falls
back to 10000 makes a head whose hidden states differ). It exits with 0 when they match, 1 when they do not, and 2
with a message when speculators cannot be installed or run here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CONVERT = r"""
import sys
from pathlib import Path
source, output, verifier = sys.argv[1:4]
try:
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
except ImportError as error:
    sys.exit(f"speculators has no Eagle3Converter here ({error})")
Eagle3Converter().convert(Path(source), Path(output), verifier, validate=False)
"""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", default=None, help="EAGLE-3 head directory (default: the one shipped for --target)")
    parser.add_argument("--target", default="smollm2-135m", help="the target the head was trained for")
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "headstart-speculators",
                        help="virtual environment for speculators (created when missing)")
    return parser.parse_args(argv)


def speculators_python(venv: Path) -> Path:
    """The venv's interpreter with speculators installed, or exit 2 saying why it could not be installed."""
    python = venv / "bin" / "python"
    if not python.is_file():
        # The venv sees this environment's packages (torch above all, which speculators accepts) and installs only
        # what speculators pins differently (transformers) or adds, on top.
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    probe = subprocess.run([str(python), "-c", "import speculators"], capture_output=True)
    if probe.returncode != 0:
        install = subprocess.run([str(python), "-m", "pip", "install", "speculators"], capture_output=True, text=True)
        if install.returncode != 0:
            print(install.stderr[-2000:], file=sys.stderr)
            raise SystemExit("speculators could not be installed from the package index here; run this script where "
                             "it can be (pip install speculators), nothing was checked")
    return python


def flat(config: dict) -> dict:
    layer = config.get("transformer_layer_config")
    return {**layer, **{k: v for k, v in config.items() if k != "transformer_layer_config"}} if isinstance(
        layer, dict) else config


def main(argv=None) -> int:
    args = parse_args(argv)
    python = speculators_python(args.venv)

    from safetensors.torch import load_file

    from heads.common import draft_rope_parameters
    from heads.formats import load_any_head
    from heads.export import export_head
    from runtime.proposers import default_head
    from runtime.target.model import load_target

    target = load_target(args.target, quiet=True)
    head_dir = args.head or default_head("eagle3", target)
    head, _ = load_any_head(head_dir, target.model, identity=target.identity, tokenizer=target.tokenizer)
    work = Path(tempfile.mkdtemp(prefix="speculators-check-"))
    ours = export_head(head, work / "ours", fmt="vllm")
    converted = work / "converted"
    result = subprocess.run([str(python), "-c", CONVERT, str(ours), str(converted), str(target.model.name_or_path)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stderr[-3000:], file=sys.stderr)
        raise SystemExit("the speculators converter failed on our export (above); nothing was compared")
    theirs_config = flat(json.loads((converted / "config.json").read_text()))
    theirs = {}
    for path in sorted(converted.glob("*.safetensors")):
        theirs.update(load_file(str(path)))
    problems = []
    theta = float(draft_rope_parameters(target.config)["rope_theta"])
    got = theirs_config.get("rope_theta", (theirs_config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    if float(got) != theta:
        problems.append(f"rope_theta {got}, the target's is {theta}")
    for name, tensor in load_file(str(ours / "model.safetensors")).items():
        if not any(t.shape == tensor.shape and bool((t.to(tensor.dtype) == tensor).all()) for t in theirs.values()):
            problems.append(f"{name} {tuple(tensor.shape)} is not in the converted checkpoint unchanged")
    for problem in problems:
        print(f"MISMATCH: {problem}")
    print(f"speculators converted {ours} to {converted}: " + ("identical tensors and rope_theta" if not problems
                                                             else f"{len(problems)} mismatches"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
