"""The import rules of the design, layer by layer:

- heads/ holds head modules and their checkpoint format: it imports neither runtime nor training;
- runtime/ (serving: target, decoder, proposers, decode layers and kernels) never imports training;
- only training (and scripts) import deepspeed, wandb or hydra;
- the pure tensor modules import only torch;
- scripts parse arguments and call the packages: nothing imports scripts, and nothing edits sys.path.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PURE = ["runtime/tree.py", "runtime/acceptance.py", "runtime/kv_cache.py", "runtime/sampling.py", "runtime/ragged.py"]
HEAVY = {"deepspeed", "wandb", "hydra", "omegaconf"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def python_files(*folders: str):
    for folder in folders:
        yield from (ROOT / folder).rglob("*.py")


def test_runtime_and_heads_respect_the_layering():
    for package, forbidden in (("runtime", {"training", "scripts"} | HEAVY),
                               ("heads", {"training", "runtime", "scripts"} | HEAVY),
                               ("training", {"scripts"})):
        for path in python_files(package):
            bad = imported_roots(path) & forbidden
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_heads_hold_head_modules_and_their_format_only():
    """Decode machinery (kernels, decode layers) serves the runtime and lives there."""
    assert not list((ROOT / "heads").rglob("*.cpp"))
    assert (ROOT / "runtime" / "kernels").is_dir() and (ROOT / "runtime" / "decode_layers.py").is_file()


def test_tests_import_the_packages_not_the_scripts():
    for path in python_files("tests"):
        assert "scripts" not in imported_roots(path), f"{path.relative_to(ROOT)} imports scripts"


def test_nothing_edits_sys_path():
    for path in python_files("heads", "runtime", "training", "scripts", "tests"):
        for node in ast.walk(ast.parse(path.read_text())):
            edits = (isinstance(node, ast.Attribute) and node.attr in ("insert", "append")
                     and isinstance(node.value, ast.Attribute) and node.value.attr == "path"
                     and isinstance(node.value.value, ast.Name) and node.value.value.id == "sys")
            assert not edits, f"{path.relative_to(ROOT)} edits sys.path"


def test_pure_tensor_modules_import_only_torch():
    allowed = {"torch", "math", "__future__", "collections", "contextlib", "dataclasses", "typing", "runtime"}
    for name in PURE:
        roots = imported_roots(ROOT / name)
        assert roots <= allowed, f"{name} imports {sorted(roots - allowed)}"
        for node in ast.walk(ast.parse((ROOT / name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("runtime."):
                assert node.module[len("runtime."):] in {m[len("runtime/"):-3] for m in PURE}, name
