"""The layer rules of ``retune/``, held by reading the source (AST), not by importing it.

The rules (docs/development.md, "The layer rule"):

* **One door to Lightning.** Only ``retune/compat/`` imports Lightning (``lightning``,
  ``pytorch_lightning``, ``lightning_fabric``, ``lightning_utilities``, ``finetuning_scheduler``) or reads a
  private attribute of a trainer, strategy or loop. Two exemptions, both *users* of retune rather than
  parts of it: ``retune/demo.py`` (a Lightning training script) and ``retune/integrations/`` (adapters
  to a fine-tuning library's own classes, each imported only when asked for).
* **No torch in the file formats.** ``retune/schedule/`` and ``retune/reports/`` import no torch, also
  not through another retune module, so ``retune validate`` and ``retune report`` start in a blink.
* **Layers.** Every import goes down or sideways, never up, in this order: the base vocabulary
  (``errors``, ``events``, ``messages``, ``oom``, ``step_parts``); torch-only and torch-free foundations
  (``distributed/``, ``memory``, ``schedule/``); ``compat/`` (Lightning); the capabilities that run real
  steps (``probing/``, ``recovery/``); the searches, predictions and reports (``search/``, ``buckets/``,
  ``lr/``, ``prediction/``,
  ``reports/``); the callbacks; the applications (``integrations/``, ``cli``, ``demo``).
  ``compat/`` imports nothing of retune above the base vocabulary. Sideways imports must not form a
  cycle.
* **One search path.** ``retune/search/`` never reaches ``retune/buckets/`` (not even through another
  module): the buckets implement the search's ``Batching`` seam (``retune.search.batching``) and the
  callback passes them, so a fixed search never enters the buckets' code.
* **No private names across packages**: ``from retune.a import _x`` only inside package ``a``.
* **``__all__`` in every module.**
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "retune"
LIGHTNING = {"lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "finetuning_scheduler"}
LIGHTNING_EXEMPT = ("retune.demo", "retune.integrations")
# a private attribute read on an object whose expression names one of these is a Lightning internal
LIGHTNING_OBJECTS = ("trainer", "strategy", "loop")

RANKS: dict[str, int] = {
    "retune.errors": 0,
    "retune.events": 0,
    "retune.messages": 0,
    "retune.oom": 0,
    "retune.random_state": 0,
    "retune.step_parts": 0,
    "retune.distributed": 1,
    "retune.memory": 1,
    "retune.allocator": 1,
    "retune.schedule": 1,
    "retune.compat": 2,
    "retune.probing": 3,
    "retune.recovery": 3,
    "retune.search": 4,
    "retune.buckets": 4,
    "retune.lr": 4,
    "retune.prediction": 4,
    "retune.reports": 4,
    "retune.callbacks": 5,
    "retune.integrations": 6,
    "retune.cli": 6,
    "retune.demo": 6,
    "retune.__main__": 6,
}
BASE_RANK = 0
COMPAT = "retune.compat"
NO_TORCH = ("retune.schedule", "retune.reports")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    name = ".".join(parts)
    return name.removesuffix(".__init__")


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
TREES: dict[str, ast.Module] = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _unit(module: str) -> str:
    """The layer unit a module belongs to: its top-level package, or the module itself at the top."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def _imports(name: str) -> Iterator[tuple[str, int, str | None]]:
    """(imported module, line, imported name or None) for every runtime import of a module, at any depth."""
    tree = TREES[name]
    typing_only = _type_checking_lines(tree)
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in typing_only:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, None
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                yield node.module, node.lineno, alias.name


def _retune_target(module: str, imported: str | None) -> str:
    """The retune module an import reaches: ``from retune.x import y`` is module ``retune.x.y`` when one exists."""
    if imported and f"{module}.{imported}" in MODULES:
        return f"{module}.{imported}"
    return module


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for module, _, imported in _imports(name):
            if module == "retune" or module.startswith("retune."):
                target = _retune_target(module, imported)
                if target != name and target in MODULES:
                    edges[name].add(target)
    return edges


EDGES = _edges()


def test_every_module_has_a_rank() -> None:
    """A new top-level module or package must be placed in the layers (RANKS) before it is used."""
    missing = sorted({_unit(name) for name in MODULES if name != "retune" and _unit(name) not in RANKS})
    assert not missing, f"place these in RANKS (tests/architecture/test_layers.py) and the README layout: {missing}"


def test_lightning_only_in_compat() -> None:
    found = []
    for name in MODULES:
        if name.startswith(COMPAT) or name.startswith(LIGHTNING_EXEMPT):
            continue
        for module, line, _ in _imports(name):
            if module.split(".")[0] in LIGHTNING:
                found.append(f"{MODULES[name].relative_to(ROOT.parent)}:{line} imports {module}")
    assert not found, "Lightning is imported outside retune/compat/:\n" + "\n".join(found)


def test_no_private_lightning_attribute_outside_compat() -> None:
    found = []
    for name, tree in TREES.items():
        if name.startswith(COMPAT) or name.startswith(LIGHTNING_EXEMPT):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            owner = ast.unparse(node.value).lower()
            if any(word in owner for word in LIGHTNING_OBJECTS):
                found.append(f"{MODULES[name].relative_to(ROOT.parent)}:{node.lineno} reads {owner}.{node.attr}")
    assert not found, "private Lightning attributes read outside retune/compat/:\n" + "\n".join(found)


def _reachable(name: str) -> set[str]:
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        for target in EDGES[current]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


@pytest.mark.parametrize("package", NO_TORCH)
def test_file_formats_import_no_torch(package: str) -> None:
    found = []
    for name in MODULES:
        if not name.startswith(package):
            continue
        for module in [name, *sorted(_reachable(name))]:
            if module == "retune":
                continue  # the package face: its torch-needing names load lazily (retune/__init__.py)
            for imported, line, _ in _imports(module):
                if imported.split(".")[0] == "torch":
                    found.append(f"{name} reaches {module}, which imports torch (line {line})")
    assert not found, "\n".join(sorted(set(found)))


# sideways imports that must not happen (not even through another module): the package on the left
# defines a seam the one on the right implements
SEAMS: dict[str, str] = {"retune.search": "retune.buckets"}


@pytest.mark.parametrize("package", sorted(SEAMS))
def test_seams_are_not_crossed_backwards(package: str) -> None:
    implementer = SEAMS[package]
    found = sorted(
        f"{name} reaches {target}"
        for name in MODULES
        if _unit(name) == package
        for target in _reachable(name)
        if _unit(target) == implementer
    )
    assert not found, f"{package} must not import {implementer} (it implements {package}'s seam):\n" + "\n".join(found)


def test_imports_never_run_up_the_layers() -> None:
    found = []
    for name, targets in EDGES.items():
        if name == "retune":
            continue  # the package face re-exports from every layer
        rank = RANKS.get(_unit(name))
        for target in targets:
            if target == "retune" or rank is None:
                continue
            target_rank = RANKS.get(_unit(target))
            if target_rank is not None and target_rank > rank:
                found.append(f"{name} (layer {rank}) imports {target} (layer {target_rank})")
    assert not found, "imports that run back up the layers:\n" + "\n".join(sorted(found))


def test_compat_imports_only_the_base_vocabulary() -> None:
    found = [
        f"{name} imports {target}"
        for name, targets in EDGES.items()
        if name.startswith(COMPAT)
        for target in targets
        if not target.startswith(COMPAT) and RANKS.get(_unit(target)) != BASE_RANK
    ]
    assert not found, "retune/compat/ must import nothing of retune but the base vocabulary:\n" + "\n".join(found)


def test_no_import_cycles() -> None:
    """Sideways imports (same layer) are allowed, cycles are not: a cycle makes import order matter."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in EDGES[node]:
            if target == "retune":
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in MODULES:
        if name not in index and name != "retune":
            visit(name)
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_name_imported_across_packages() -> None:
    found = []
    for name in MODULES:
        for module, line, imported in _imports(name):
            if not module.startswith("retune") or imported is None:
                continue
            if imported.startswith("_") and not imported.startswith("__") and _unit(module) != _unit(name):
                found.append(f"{MODULES[name].relative_to(ROOT.parent)}:{line} imports {module}.{imported}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_declares_all(name: str) -> None:
    tree = TREES[name]
    targets = [
        target
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
    ]
    declared = any(isinstance(target, ast.Name) and target.id == "__all__" for target in targets)
    assert declared, f"{MODULES[name].relative_to(ROOT.parent)} has no __all__"


def test_rules_catch_a_violation(tmp_path: Path) -> None:
    """The checks above can fail: an upward import and a Lightning import are found in a planted module."""
    planted = "retune.schedule.planted"
    TREES[planted] = ast.parse("import lightning\nfrom retune.callbacks import batch_size_finder\n")
    MODULES[planted] = ROOT / "schedule" / "planted.py"
    EDGES[planted] = {"retune.callbacks.batch_size_finder"}
    try:
        with pytest.raises(AssertionError, match="planted"):
            test_lightning_only_in_compat()
        with pytest.raises(AssertionError, match="planted"):
            test_imports_never_run_up_the_layers()
        with pytest.raises(AssertionError, match="planted"):
            test_file_formats_import_no_torch("retune.schedule")
    finally:
        del TREES[planted], MODULES[planted], EDGES[planted]


def test_seam_rule_catches_a_crossing() -> None:
    """A search module that imports the buckets (directly or through another module) fails the seam rule."""
    planted = "retune.search.planted"
    MODULES[planted] = ROOT / "search" / "planted.py"
    EDGES[planted] = {"retune.buckets.train_buckets"}
    try:
        with pytest.raises(AssertionError, match=r"planted reaches retune\.buckets\.train_buckets"):
            test_seams_are_not_crossed_backwards("retune.search")
    finally:
        del MODULES[planted], EDGES[planted]
