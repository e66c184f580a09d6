"""Every argument of what the API reference renders is documented (issue 31).

The pages under ``docs/reference/api/`` render objects with mkdocstrings (``::: retune.x.y``; a
module renders every name in its ``__all__``). A user reads the argument list there, so each
parameter of a rendered function, and of a rendered class's constructor, must be described: in an
``Args:`` (or ``Attributes:``) section of its docstring or of ``__init__``'s, or, for a dataclass or
``NamedTuple`` field, by the attribute docstring under the field, which mkdocstrings renders too.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs" / "reference" / "api").glob("*.md"))
SECTION = re.compile(
    r"^(?P<indent>[ \t]*)(?:Args|Arguments|Parameters|Attributes):[ \t]*\n"
    r"(?P<body>(?:(?P=indent)[ \t]+.*\n|[ \t]*\n)*)",
    re.M,
)


def rendered() -> Iterator[tuple[str, Any]]:
    """``(dotted name, object)`` for every function and class the API pages render."""
    for page in PAGES:
        for line in page.read_text(encoding="utf-8").splitlines():
            if not line.startswith("::: "):
                continue
            path = line[4:].strip()
            try:
                target = importlib.import_module(path)
            except ModuleNotFoundError as error:
                if error.name and not error.name.startswith("retune"):
                    continue  # an optional integration not installed in this stack (Flash)
                module, _, name = path.rpartition(".")
                target = getattr(importlib.import_module(module), name)
            if inspect.ismodule(target):
                for name in target.__all__:
                    yield f"{path}.{name}", getattr(target, name)
            else:
                yield path, target


def described_in_sections(doc: str) -> set[str]:
    names: set[str] = set()
    for match in SECTION.finditer(doc + "\n"):
        names |= set(re.findall(r"^[ \t]+\**(\w+)(?:[ \t]*\([^)]*\))?[ \t]*:", match.group("body"), re.M))
    return names


def attribute_docstrings(cls: type) -> set[str]:
    """Fields of ``cls`` (and its bases) followed by a string literal in the class body."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object or not klass.__module__.startswith("retune"):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0]
        assert isinstance(body, ast.ClassDef)
        for stmt, after in zip(body.body, body.body[1:], strict=False):
            is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and is_doc:
                names.add(stmt.target.id)
    return names


def undocumented(obj: Any) -> list[str]:
    if inspect.isclass(obj):
        if issubclass(obj, BaseException) and "__init__" not in obj.__dict__:
            return []
        function = obj.__init__ if "__init__" in obj.__dict__ or hasattr(obj, "__dataclass_fields__") else None
        if function is None or function is object.__init__:
            return []
        if hasattr(obj, "_fields") and not hasattr(obj, "__dataclass_fields__"):  # a NamedTuple
            params = list(obj._fields)
        else:
            params = _params(function)
        doc = (inspect.getdoc(obj) or "") + "\n" + ((function.__doc__ and inspect.getdoc(function)) or "")
        known = described_in_sections(doc) | attribute_docstrings(obj)
    elif inspect.isfunction(obj):
        params = _params(obj)
        known = described_in_sections(inspect.getdoc(obj) or "")
    else:
        return []
    return [p for p in params if p not in known]


def _params(function: Any) -> list[str]:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return []
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [
        name
        for name, p in signature.parameters.items()
        if name not in ("self", "cls") and p.kind not in skip and not name.startswith("_")
    ]


OBJECTS = dict(rendered())


def test_the_pages_render_something() -> None:
    assert len(OBJECTS) >= 20, sorted(OBJECTS)


@pytest.mark.parametrize("name", sorted(OBJECTS))
def test_every_argument_of_a_rendered_object_is_documented(name: str) -> None:
    missing = undocumented(OBJECTS[name])
    assert not missing, f"{name}: document {missing} in its docstring's Args: (or an attribute docstring)"


def test_the_check_sees_a_missing_argument() -> None:
    def documented(a: int, b: int) -> int:
        """Add.

        Args:
            a: the first.
        """
        return a + b

    assert undocumented(documented) == ["b"]
