"""Griffe extension: retune's Sphinx-style docstrings rendered as the docs site needs them.

retune's docstrings name other objects the Sphinx way (``:class:`~retune.RetuneSchedule```,
``:mod:`retune.recovery.split```, ``:func:`default_schedule```), which reads well in ``help()`` and
in the source. mkdocstrings does not interpret those roles, so this extension rewrites each one into
an autorefs link (``[RetuneSchedule][retune.schedule.models.RetuneSchedule]``) before the docstring is
rendered. A target that is not documented on any page of the site then fails ``mkdocs build
--strict`` like any broken link; names that have no page of their own by nature (Python builtins,
private helpers) become code spans.

Two more reST habits are turned into fenced code, so that Markdown does not read their contents
(``[(3, 'nli'), (2, 'nli')]`` is a reference link to Markdown): doctest blocks (``>>>`` lines and
their output) and literal blocks introduced by a line ending in ``::``.
"""

from __future__ import annotations

import builtins
import re
from typing import Any

import griffe

__all__ = ["SphinxRoles"]

_ROLE = re.compile(r":(?:py:)?(?:class|mod|func|meth|attr|data|exc|obj):`(~?)([^`]+)`")

# Top-level names that ``retune/__init__.py`` provides lazily (module ``__getattr__``), which static
# analysis cannot follow.
_LAZY = {
    "retune.ScheduledBatchSizeFinder": "retune.callbacks.batch_size_finder.ScheduledBatchSizeFinder",
    "retune.ScheduledLRFinder": "retune.callbacks.lr_finder.ScheduledLRFinder",
    "retune.is_oom_error": "retune.oom.is_oom_error",
}


def _target(obj: griffe.Object, name: str, pkg: griffe.Module) -> str | None:
    """The canonical path ``name`` refers to from ``obj``'s docstring, or None (no page for it)."""
    if name in _LAZY:
        return _LAZY[name]
    last = name.rsplit(".", 1)[-1]
    if last.startswith("_") or hasattr(builtins, name):
        return None
    if "." not in name:
        try:
            name = obj.resolve(name)
        except Exception:  # griffe's NameResolutionError, or an alias it cannot follow
            return None
    if not name.startswith("retune"):
        return None
    try:
        found: Any = pkg.modules_collection[name]
    except Exception:
        return _LAZY.get(name, name)
    try:
        return str(found.canonical_path)
    except Exception:
        return name


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _fence_code(text: str) -> str:
    """Wrap doctest blocks and ``::`` literal blocks in fenced code blocks."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith(">>>"):
            pad = " " * _indent(line)
            out.append(f"{pad}```pycon")
            while i < len(lines) and lines[i].strip():
                out.append(lines[i])
                i += 1
            out.append(f"{pad}```")
            continue
        if stripped.endswith("::") and i + 1 < len(lines) and not lines[i + 1].strip():
            base = _indent(line)
            j = i + 2
            block: list[str] = []
            while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > base):
                block.append(lines[j])
                j += 1
            while block and not block[-1].strip():
                block.pop()
                j -= 1
            if block:
                inner = min(_indent(b) for b in block if b.strip())
                pad = " " * (base + 4)  # the block stays inside its section ("Example:")
                out.append(line.rstrip()[:-1])
                out.append(f"{pad}```python")
                out.extend(pad + b[inner:] if b.strip() else "" for b in block)
                out.append(f"{pad}```")
                i = j
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


def _walk(obj: griffe.Object) -> list[griffe.Object]:
    found = [obj]
    for member in obj.members.values():
        if not member.is_alias:
            assert isinstance(member, griffe.Object)
            found.extend(_walk(member))
    return found


class SphinxRoles(griffe.Extension):
    """Rewrite the Sphinx roles of every docstring in the loaded package into autorefs links."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for obj in _walk(pkg):
            if obj.docstring is None:
                continue

            def link(match: re.Match[str], obj: griffe.Object = obj) -> str:
                short, name = match.group(1), match.group(2)
                shown = name.rsplit(".", 1)[-1] if short else name
                path = _target(obj, name, pkg)
                return f"`{shown}`" if path is None else f"[`{shown}`][{path}]"

            obj.docstring.value = _fence_code(_ROLE.sub(link, obj.docstring.value))
