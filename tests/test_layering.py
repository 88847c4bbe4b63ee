"""The import rule of the design: runtime never imports training; heads imports neither; only training (and
scripts) import deepspeed, wandb or hydra; the pure tensor modules import only torch."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PURE = ["runtime/tree.py", "runtime/acceptance.py", "runtime/kv_cache.py", "runtime/sampling.py"]
HEAVY = {"deepspeed", "wandb", "hydra", "omegaconf"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_runtime_and_heads_respect_the_layering():
    for package, forbidden in (("runtime", {"training"} | HEAVY), ("heads", {"training", "runtime"} | HEAVY)):
        for path in (ROOT / package).rglob("*.py"):
            bad = imported_roots(path) & forbidden
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_pure_tensor_modules_import_only_torch():
    allowed = {"torch", "math", "__future__", "dataclasses", "typing", "runtime"}
    for name in PURE:
        roots = imported_roots(ROOT / name)
        assert roots <= allowed, f"{name} imports {sorted(roots - allowed)}"
        for node in ast.walk(ast.parse((ROOT / name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("runtime."):
                assert node.module[len("runtime."):] in {m[len("runtime/"):-3] for m in PURE}, name
