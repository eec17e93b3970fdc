"""hpcrl's import graph, read with `ast` (every import, module-level or inside a function), against
the layering that docs/architecture.md states in its `layers` block: no import cycles; a module
imports only from lower layers (or within its own package, or the bottom layer among itself);
hpcrl/rl imports only what the `rl-may-import` line allows, and nothing outside rl imports it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "hpcrl"


def _block(name: str) -> list[list[str]]:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    m = re.search(rf"```{re.escape(name)}\n(.*?)```", text, re.S)
    assert m, f"docs/architecture.md has no ```{name} block"
    return [line.split() for line in m.group(1).splitlines() if line.strip()]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """hpcrl modules `path` imports (from-imports resolved to the module when it is one)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "hpcrl")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "hpcrl":
                continue
            names = [f"{target}.{a.name}" for a in node.names]
            sub = [n for n in names if _is_module(n)]
            out.update(sub if sub else [target])
    out.discard(me)
    return out


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PKG.rglob("*.py") if "__pycache__" not in p.parts}


def unit(module: str) -> str:
    """The name the layering uses: the top-level module or package under hpcrl ('hpcrl' itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "hpcrl"


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(g.get(node, ())):
            if nxt not in g:
                continue
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node)


def test_imports_follow_the_stated_layers():
    layers = _block("layers")
    rank = {name: i for i, line in enumerate(layers) for name in line}
    bottom = len(layers) - 1
    rl_allowed = set(_block("rl-may-import")[0])
    problems = []
    for mod, deps in sorted(graph().items()):
        src = unit(mod)
        for dep in sorted(deps):
            dst = unit(dep)
            if src == dst:
                continue  # within one package (backends.tpu -> backends.base)
            if src == "rl":
                if dst not in rl_allowed:
                    problems.append(f"{mod} -> {dep}: hpcrl/rl may import only {sorted(rl_allowed)}")
                continue
            if dst == "rl":
                problems.append(f"{mod} -> {dep}: nothing outside hpcrl/rl imports it (the protocol is the way in)")
                continue
            if src not in rank or dst not in rank:
                problems.append(f"{mod} -> {dep}: {src if src not in rank else dst} is in no layer of docs/architecture.md")
                continue
            if rank[dst] <= rank[src] and not (rank[src] == rank[dst] == bottom):
                problems.append(f"{mod} -> {dep}: layer {rank[src]} ({src}) may not import layer {rank[dst]} ({dst})")
    assert not problems, "\n".join(problems)


def test_every_module_is_in_a_layer():
    layers = {name for line in _block("layers") for name in line} | {"rl"}
    units = {unit(m) for m in graph()}
    assert units <= layers, f"modules in no layer: {sorted(units - layers)}"
    assert layers - {"rl"} <= units, f"layers naming no module: {sorted(layers - {'rl'} - units)}"


def test_the_bottom_layer_is_stdlib_only():
    # the leaves are what the trainer and the job's own scripts may import on any interpreter
    import sys

    bottom = set(_block("layers")[-1]) - {"recipes"}
    optional = {"xxhash"}  # ckptstore: faster digests when installed, sha256 otherwise (guarded)
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        mod = module_name(path)
        if unit(mod) not in bottom or "__pycache__" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in optional | {"hpcrl", "__future__"}:
                    problems.append(f"{mod} imports {name}")
    assert not problems, problems


def test_the_checker_sees_a_violation(tmp_path):
    # the reader itself: a lazy import inside a function counts, relative imports resolve
    p = PKG / "backends" / "tpu.py"
    assert "hpcrl.backends.tpu_watch" in imports_of(p) and "hpcrl.backends.base" in imports_of(p)
    assert unit("hpcrl.backends.tpu") == "backends" and unit("hpcrl") == "hpcrl"
