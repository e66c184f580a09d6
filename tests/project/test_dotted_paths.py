"""Every ``retune.x.y`` path the README, the docs pages, the examples and retune's own docstrings name exists.

Users copy these paths (``retune.recovery.split.split_batch``) and readers follow them; a module that
moves (issue 30 moved them all) must take its mentions along or stay importable. The changelog is left
out: it records paths as they were. A path into a module that needs an optional library
(``retune.integrations.flash`` without lightning-flash) counts when the module's file exists.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATH = re.compile(r"(?<![\w/.-])retune(?:\.[A-Za-z_]\w*)+")
"""A dotted name starting at ``retune`` (not a file name such as ``schedules/retune.yaml``)."""


def _sources() -> list[Path]:
    docs = [p for p in (ROOT / "docs").rglob("*.md") if p.name != "changelog.md"]
    code = [*(ROOT / "examples").rglob("*.py"), *(ROOT / "retune").rglob("*.py")]
    return sorted([ROOT / "README.md", ROOT / "mkdocs.yml", *docs, *(ROOT / "examples").rglob("*.md"), *code])


def _resolves(path: str) -> bool:
    """The longest importable module prefix of ``path``, then each further name as an attribute."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            found: object = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not exc.name.startswith("retune"):
                return importlib.util.find_spec(module) is not None  # an optional library is missing
            continue
        for name in parts[cut:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def test_every_named_retune_path_exists() -> None:
    missing: dict[str, list[str]] = {}
    named = 0
    for source in _sources():
        for match in PATH.finditer(source.read_text(encoding="utf-8")):
            named += 1
            path = match.group(0)
            if not _resolves(path):
                missing.setdefault(path, []).append(str(source.relative_to(ROOT)))
    assert named > 100  # the scan reads what it should
    assert not missing, "paths that do not import (fix the text, or keep the name importable):\n" + "\n".join(
        f"  {path}: {', '.join(sorted(set(where)))}" for path, where in sorted(missing.items())
    )


def test_the_check_catches_a_moved_path() -> None:
    assert _resolves("retune.recovery.split.split_batch")
    assert _resolves("retune.recovery.step_recovery.TrainStepRecovery")  # kept importable after the split
    assert not _resolves("retune.split.split_batch")  # where it was before issue 30
    assert not _resolves("retune.recovery.split.no_such_function")
    assert PATH.findall("schedules/retune.yaml and retune.memory.peak") == ["retune.memory.peak"]
