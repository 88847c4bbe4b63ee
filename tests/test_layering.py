"""The import rules of the design, layer by layer:

- heads/ holds head modules and their checkpoint formats: it imports none of the other packages;
- runtime/ (serving: the engine, the target and its backends, proposers) imports only heads;
- bench/ (the benchmark lab) and training/ import the runtime and heads, never each other;
- cli/ (the command-line layer) may import everything; nothing imports cli but the scripts;
- only training (and cli) import deepspeed, wandb or hydra;
- the pure tensor modules import only torch;
- no circle between our modules, counting imports inside functions as well as at module top;
- scripts are thin wrappers: nothing imports scripts, and nothing edits sys.path.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("heads", "runtime", "training", "bench", "cli")
PURE = ["runtime/engine/tree.py", "runtime/engine/acceptance.py", "runtime/engine/kv_cache.py",
        "runtime/engine/sampling.py", "runtime/engine/ragged.py"]
HEAVY = {"deepspeed", "wandb", "hydra", "omegaconf"}
# package -> the packages of ours (and heavy dependencies) it must never import
FORBIDDEN = {
    "heads": {"runtime", "training", "bench", "cli", "scripts"} | HEAVY,
    "runtime": {"training", "bench", "cli", "scripts"} | HEAVY,
    "bench": {"training", "cli", "scripts"} | HEAVY,
    "training": {"bench", "cli", "scripts"},
    "cli": {"scripts"},
}


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (``from a.b import c`` counts as a.b and a.b.c)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def imported_roots(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_modules(path)}


def python_files(*folders: str):
    for folder in folders:
        yield from (ROOT / folder).rglob("*.py")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports. A package's face (its ``__init__``) is skipped: importing a.b.c
    runs a/b/__init__ first, but a face only hands names on from modules of its own package."""
    files = {module_name(path): path for path in python_files(*PACKAGES)}
    graph = {}
    for name, path in files.items():
        if path.name == "__init__.py":
            continue
        graph[name] = {module for module in imported_modules(path)
                       if module in files and module != name and files[module].name != "__init__.py"}
    return graph


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every import circle."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_packages_respect_the_layering():
    for package, forbidden in FORBIDDEN.items():
        for path in python_files(package):
            bad = imported_roots(path) & forbidden
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_no_import_circle_between_our_modules():
    circles = find_circles(import_graph())
    assert not circles, "import circles (imports inside functions count too): " + "; ".join(
        " <-> ".join(circle) for circle in circles)


def test_the_circle_finder_finds_a_circle_through_an_import_inside_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_circles(graph) == [["a", "b", "c"]]
    assert find_circles({"a": {"b"}, "b": set()}) == []


def test_the_layering_check_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "module.py"
    source.write_text("def late():\n    from bench.harness import run_benchmark\n    import training.recipe\n")
    assert imported_roots(source) == {"bench", "training"}


def test_heads_hold_head_modules_and_their_format_only():
    """Decode machinery (kernels, decode layers) serves the runtime and lives with the target's backends."""
    assert not list((ROOT / "heads").rglob("*.cpp"))
    assert (ROOT / "runtime" / "target" / "kernels").is_dir()
    assert (ROOT / "runtime" / "target" / "decode_layers.py").is_file()


def test_tests_import_the_packages_not_the_scripts():
    for path in python_files("tests"):
        assert "scripts" not in imported_roots(path), f"{path.relative_to(ROOT)} imports scripts"


def test_nothing_edits_sys_path():
    for path in python_files(*PACKAGES, "scripts", "tests"):
        for node in ast.walk(ast.parse(path.read_text())):
            edits = (isinstance(node, ast.Attribute) and node.attr in ("insert", "append")
                     and isinstance(node.value, ast.Attribute) and node.value.attr == "path"
                     and isinstance(node.value.value, ast.Name) and node.value.value.id == "sys")
            assert not edits, f"{path.relative_to(ROOT)} edits sys.path"


def test_pure_tensor_modules_import_only_torch():
    allowed = {"torch", "math", "__future__", "collections", "contextlib", "dataclasses", "typing", "runtime"}
    pure = {name[:-3].replace("/", ".") for name in PURE}
    for name in PURE:
        roots = imported_roots(ROOT / name)
        assert roots <= allowed, f"{name} imports {sorted(roots - allowed)}"
        for node in ast.walk(ast.parse((ROOT / name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("runtime."):
                assert node.module in pure, f"{name} imports {node.module}"


def test_no_runtime_function_runs_over_80_lines():
    """The runtime reads as named steps: a function that outgrows a screen is split, not scrolled."""
    for path in python_files("runtime"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 80, f"{path.relative_to(ROOT)}:{node.lineno} {node.name} is {length} lines"


def test_no_head_type_branch_outside_the_head_types_own_modules():
    """A head type owns its parts through the registry: code asks the head, never compares its type with a name
    (``head_type == "dflash"``); comparing two heads' types to refuse a mismatch is fine."""
    for path in python_files("runtime", "training", "bench", "cli", "heads"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                     for op in node.ops):
                sides = (node.left, *node.comparators)
                names = [n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", None) for n in sides]
                literal = any(isinstance(n, ast.Constant) and isinstance(n.value, str)
                              or isinstance(n, (ast.Tuple, ast.List, ast.Set)) for n in sides)
                assert not ("head_type" in names and literal), \
                    f"{path.relative_to(ROOT)}:{node.lineno} branches on head_type"
