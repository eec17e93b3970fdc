"""hpcrl's import graph, read with `ast` (every import, module-level or inside a function), against
the layering that docs/architecture.md states in its `layers` block: no import cycles; a module
imports only from lower layers (or within its own unit, or the bottom layer among itself); the
trainer side (the `trainer-side` block: hpcrl/rl and hpcrl/checkpoints/trainer, where torch loads)
imports only what its `trainer-side-may-import` line allows, and nothing outside it imports it.

A unit is a top-level module or package under hpcrl, or a dotted name the blocks give
(`checkpoints.store`): a package whose parts stand on different layers. Such a package's own
__init__.py (its face) imports nothing."""

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


def unit(module: str, named=()) -> str:
    """The name the layering uses: the longest of `named` (the blocks' dotted names) that is the
    module or a package above it, else the top-level module or package under hpcrl ('hpcrl' itself)."""
    parts = module.split(".")
    for n in range(len(parts) - 1, 1, -1):
        if ".".join(parts[1:n + 1]) in named:
            return ".".join(parts[1:n + 1])
    return parts[1] if len(parts) > 1 else "hpcrl"


class Rules:
    """The stated layering: the launcher's layers (top first), the trainer side's (top first), and
    what the trainer side may import of the launcher."""

    def __init__(self, layers, trainer_side, trainer_may_import):
        self.rank = {name: i for i, line in enumerate(layers) for name in line}
        self.bottom = len(layers) - 1
        self.trainer_rank = {name: i for i, line in enumerate(trainer_side) for name in line}
        self.trainer_allowed = set(trainer_may_import)
        self.named = {n for n in [*self.rank, *self.trainer_rank] if "." in n}
        self.faces = {n.rsplit(".", 1)[0] for n in self.named}

    @classmethod
    def stated(cls) -> "Rules":
        return cls(_block("layers"), _block("trainer-side"), _block("trainer-side-may-import")[0])

    def unit(self, module: str) -> str:
        return unit(module, self.named)

    def problems(self, g: dict[str, set[str]]) -> list[str]:
        out = []
        for mod, deps in sorted(g.items()):
            src = self.unit(mod)
            if src in self.faces:
                out += [f"{mod} -> {dep}: the face of a package split across layers imports nothing" for dep in sorted(deps)]
                continue
            for dep in sorted(deps):
                dst = self.unit(dep)
                if src != dst:  # within one unit (backends.tpu -> backends.base) anything goes
                    out += self._check(mod, dep, src, dst)
        return out

    def _check(self, mod, dep, src, dst) -> list[str]:
        tr = self.trainer_rank
        if src in tr:
            if dst in tr:
                ok = tr[dst] > tr[src]
                return [] if ok else [f"{mod} -> {dep}: trainer side {src} may not import {dst} (not below it)"]
            if dst not in self.trainer_allowed:
                return [f"{mod} -> {dep}: the trainer side may import only {sorted(self.trainer_allowed)}"]
            return []
        if dst in tr:
            return [f"{mod} -> {dep}: nothing outside the trainer side imports it (the protocol is the way in)"]
        if src not in self.rank or dst not in self.rank:
            return [f"{mod} -> {dep}: {src if src not in self.rank else dst} is in no layer of docs/architecture.md"]
        if self.rank[dst] <= self.rank[src] and not (self.rank[src] == self.rank[dst] == self.bottom):
            return [f"{mod} -> {dep}: layer {self.rank[src]} ({src}) may not import layer {self.rank[dst]} ({dst})"]
        return []


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(g.get(node, ())):
            if nxt not in g:
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(g):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_imports_follow_the_stated_layers():
    problems = Rules.stated().problems(graph())
    assert not problems, "\n".join(problems)


def test_every_module_is_in_a_layer():
    rules = Rules.stated()
    stated = set(rules.rank) | set(rules.trainer_rank)
    units = {rules.unit(m) for m in graph()}
    assert units - rules.faces <= stated, f"modules in no layer: {sorted(units - rules.faces - stated)}"
    assert stated <= units, f"layers naming no module: {sorted(stated - units)}"
    assert not set(rules.rank) & set(rules.trainer_rank), "a unit on both sides"


def test_the_bottom_layer_is_stdlib_only():
    # the leaves are what the trainer and the job's own scripts may import on any interpreter
    import sys

    rules = Rules.stated()
    bottom = set(_block("layers")[-1]) - {"recipes"}
    optional = {"xxhash"}  # checkpoints.store: faster digests when installed, sha256 otherwise (guarded)
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        mod = module_name(path)
        if rules.unit(mod) not in bottom or "__pycache__" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in optional | {"hpcrl", "__future__"}:
                    problems.append(f"{mod} imports {name}")
    assert not problems, problems


def test_the_reader_sees_lazy_and_relative_imports():
    # a lazy import inside a function counts, relative imports resolve (two dots too)
    p = PKG / "backends" / "tpu.py"
    assert "hpcrl.backends.tpu_watch" in imports_of(p) and "hpcrl.backends.base" in imports_of(p)
    assert "hpcrl.checkpoints.store" in imports_of(PKG / "checkpoints" / "trainer" / "parts.py")
    rules = Rules.stated()
    assert rules.unit("hpcrl.backends.tpu") == "backends" and rules.unit("hpcrl") == "hpcrl"
    assert rules.unit("hpcrl.checkpoints.trainer.parts") == "checkpoints.trainer"
    assert rules.unit("hpcrl.checkpoints.store") == "checkpoints.store"


# the checker itself, on small graphs: each rule can fail
TOY = Rules([["cli"], ["status", "pkg.top"], ["runs"], ["errors", "pkg.low"]], [["rl"], ["pkg.torch"]], ["errors", "pkg.low"])


def test_the_checker_refuses_an_upward_import_and_a_sideways_one():
    assert TOY.problems({"hpcrl.cli": {"hpcrl.status", "hpcrl.runs"}, "hpcrl.status": {"hpcrl.runs"}}) == []
    up = TOY.problems({"hpcrl.runs": {"hpcrl.status"}})
    assert up == ["hpcrl.runs -> hpcrl.status: layer 2 (runs) may not import layer 1 (status)"]
    assert TOY.problems({"hpcrl.status": {"hpcrl.pkg.top"}}), "one layer may not import its own"
    assert TOY.problems({"hpcrl.errors": {"hpcrl.pkg.low"}}) == []  # the bottom layer among itself


def test_the_checker_sees_the_parts_of_a_split_package():
    # pkg.low is at the bottom, pkg.top above runs: each part is layered on its own
    assert TOY.problems({"hpcrl.pkg.top": {"hpcrl.runs", "hpcrl.pkg.low"}}) == []
    assert TOY.problems({"hpcrl.pkg.low.store": {"hpcrl.pkg.top"}}) == [
        "hpcrl.pkg.low.store -> hpcrl.pkg.top: layer 3 (pkg.low) may not import layer 1 (pkg.top)"]
    assert TOY.problems({"hpcrl.pkg": {"hpcrl.errors"}}), "the face of a split package imports nothing"


def test_the_checker_keeps_the_trainer_side_apart():
    assert TOY.problems({"hpcrl.rl.loop": {"hpcrl.pkg.torch.save", "hpcrl.errors"},
                         "hpcrl.pkg.torch.save": {"hpcrl.pkg.low"}}) == []
    assert TOY.problems({"hpcrl.status": {"hpcrl.pkg.torch.save"}}), "the launcher imports the trainer side"
    assert TOY.problems({"hpcrl.cli": {"hpcrl.rl.loop"}}), "the launcher imports rl"
    assert TOY.problems({"hpcrl.rl.loop": {"hpcrl.runs"}}), "the trainer side imports what it may not"
    assert TOY.problems({"hpcrl.pkg.torch.save": {"hpcrl.rl.loop"}}), "trainer side: upward"


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_reward_side_imports_nothing_of_hpcrl_outside_itself():
    # verl's reward workers load hpcrl/rewards' files by path from RUN/verl/, each finding the next
    # beside itself: an import of any other hpcrl module (even one the trainer side may import)
    # fails there, so `rewards` is held tighter than the trainer-side-may-import line
    outside = {mod: sorted(d for d in deps if unit(d) != "rewards")
               for mod, deps in graph().items() if unit(mod) == "rewards"}
    assert outside and not any(outside.values()), outside
