"""The reference pages' sections generated from the code, committed, and kept current.

Two pages hold a section between a pair of markers that is generated from the code:

* ``<!-- generated:schedule-reference:start -->`` ... ``:end -->`` (``docs/reference/schedule.md``): one
  table per section of the schedule format, rendered from the pydantic models in
  ``retune.schedule.models``: every field with its type, default, constraints and description. Adding a
  field to a model adds a row here; ``tests/project/test_docs.py`` checks that every field of
  ``RetuneSchedule`` is listed.
* ``<!-- generated:cli-reference:start -->`` ... (``docs/reference/cli.md``): the ``--help`` of the
  ``retune`` command and each subcommand, from ``retune.cli.build_parser``.

The generated text is committed between the markers, so the pages read whole where the site is not built
(GitHub, an editor); ``python docs/hooks/generated.py --write`` (``make docs-generate``) rewrites it, and
``tests/project/test_docs.py`` fails while a committed copy differs from what the code generates. The site
build (this module is an MkDocs hook: :func:`on_page_markdown`) renders freshly generated text either way.

The functions here import only retune's schedule models and CLI (pydantic, PyYAML): no mkdocs, no
torch. That lets the tests call them in either virtual environment, mkdocs installed or not.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # build against this checkout's retune, not an installed copy
    sys.path.insert(0, str(ROOT))

from pydantic import BaseModel  # noqa: E402

SCHEDULE_SECTION = "schedule-reference"
CLI_SECTION = "cli-reference"
PAGES = {
    SCHEDULE_SECTION: ROOT / "docs" / "reference" / "schedule.md",
    CLI_SECTION: ROOT / "docs" / "reference" / "cli.md",
}
"""Each generated section and the page that holds it."""

__all__ = [
    "CLI_SECTION",
    "PAGES",
    "SCHEDULE_SECTION",
    "cli_reference_markdown",
    "expand",
    "main",
    "on_page_markdown",
    "schedule_reference_markdown",
    "stale_pages",
]


def _cell(text: str) -> str:
    # `|` would end the cell; `[...]` (as in batch['labels'][..., 1:]) would read as a reference link
    return text.replace("|", "\\|").replace("[", "\\[").replace("]", "\\]").replace("\n", " ")


def _yaml_value(value: Any) -> str:
    """A default as a user writes it in YAML: null, true, lists in brackets, strings bare."""
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _type_of(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return "mapping (section below)"
    if "enum" in schema:
        return " | ".join(_yaml_value(v) for v in schema["enum"])
    if "const" in schema:
        return _yaml_value(schema["const"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " | ".join(_type_of(sub) for sub in schema[key])
    kind = schema.get("type")
    if kind == "array":
        items = schema.get("items")
        return f"list of {_type_of(items)}" if isinstance(items, dict) and items else "list"
    names = {"integer": "int", "number": "float", "string": "string", "boolean": "bool", "null": "null"}
    return names.get(str(kind), str(kind))


def _constraints(schema: dict[str, Any]) -> list[str]:
    found = []
    rules = (
        ("minimum", ">= {}"),
        ("exclusiveMinimum", "> {}"),
        ("maximum", "<= {}"),
        ("exclusiveMaximum", "< {}"),
        ("minLength", "length >= {}"),
        ("minItems", "at least {} items"),
    )
    for key, text in rules:
        if key in schema:
            found.append(text.format(schema[key]))
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, []):
            found.extend(_constraints(sub))
    if isinstance(schema.get("items"), dict):
        found.extend(f"each {c}" for c in _constraints(schema["items"]))
    return found


def _field_rows(model: type[BaseModel], prefix: str) -> list[str]:
    properties = model.model_json_schema()["properties"]
    rows = ["| field | type | default | constraints | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        schema = properties[name]
        if field.is_required():
            default = "required"
        elif isinstance(field.default, BaseModel):
            default = "(section below)"
        else:
            default = f"`{_yaml_value(field.default)}`"
        constraints = ", ".join(_constraints(schema)) or "—"
        kind = _type_of(schema) if name != "triggers" else "list of triggers (`kind` and its fields, below)"
        description = field.description or schema.get("description") or ""
        cells = (f"`{prefix}{name}`", kind, default, constraints, description)
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return rows


def _doc(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split())


def _trigger_models() -> list[type[BaseModel]]:
    from retune.schedule.models import TriggerConfig

    union = typing.get_args(TriggerConfig)[0]
    return list(typing.get_args(union))


def schedule_reference_markdown() -> str:
    """Tables of every field of ``RetuneSchedule``, one per section, rendered from the pydantic models."""
    from retune.schedule.models import RetuneSchedule

    out = [f"### Top level\n\n{_doc(RetuneSchedule)}\n"]
    top = [n for n, f in RetuneSchedule.model_fields.items() if not _nested(f.annotation)]
    rows = _field_rows(RetuneSchedule, "")
    keep = {f"`{name}`" for name in top}
    out.append("\n".join(rows[:2] + [r for r in rows[2:] if r.split(" | ")[0][2:] in keep]) + "\n")
    for name, field in RetuneSchedule.model_fields.items():
        annotation = field.annotation
        if _nested(annotation):
            assert isinstance(annotation, type)
            out.append(f"### `{name}`\n\n{_doc(annotation)}\n")
            out.append("\n".join(_field_rows(annotation, f"{name}.")) + "\n")
    out.append(
        "### `triggers`\n\nA list of at least one trigger; each item is a mapping whose `kind` selects one of "
        "the trigger types below (unknown kinds and keys are errors).\n"
    )
    for model in _trigger_models():
        kind = model.model_fields["kind"].default
        out.append(f"#### `kind: {kind}`\n\n{_doc(model)}\n")
        fields = [n for n in model.model_fields if n != "kind"]
        if fields:
            rows = _field_rows(model, "")
            out.append("\n".join(rows[:2] + [r for r in rows[2:] if not r.startswith("| `kind`")]) + "\n")
        else:
            out.append("No fields besides `kind`.\n")
    return "\n".join(out)


def _nested(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def cli_reference_markdown() -> str:
    """The ``--help`` of ``retune`` and of each subcommand, as the installed parser prints it."""
    from retune.cli import build_parser

    def wide(prog: str) -> argparse.HelpFormatter:
        return argparse.HelpFormatter(prog, width=100)

    parser = build_parser()
    parser.formatter_class = wide
    out = ["### `retune`\n", "```text\n" + parser.format_help().rstrip() + "\n```\n"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                sub.formatter_class = wide
                out.append(f"### `retune {name}`\n")
                out.append("```text\n" + sub.format_help().rstrip() + "\n```\n")
    return "\n".join(out)


def _generators() -> dict[str, Callable[[], str]]:
    return {SCHEDULE_SECTION: schedule_reference_markdown, CLI_SECTION: cli_reference_markdown}


def _section(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated:{name}:start -->\n)(.*?)(^<!-- generated:{name}:end -->)", re.S | re.M)


def expand(markdown: str) -> str:
    """``markdown`` with every generated section between its markers replaced by what the code generates now."""
    for name, generate in _generators().items():
        pattern = _section(name)
        if pattern.search(markdown):
            text = generate().rstrip("\n") + "\n"

            def fill(match: re.Match[str], text: str = text) -> str:
                return match.group(1) + text + match.group(3)

            markdown = pattern.sub(fill, markdown)
    return markdown


def stale_pages() -> list[Path]:
    """The pages whose committed generated sections differ from what the code generates (or lack their markers)."""
    stale = []
    for name, page in PAGES.items():
        text = page.read_text(encoding="utf-8")
        if not _section(name).search(text) or expand(text) != text:
            stale.append(page)
    return stale


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs event: the site renders freshly generated sections, whatever the committed copy holds."""
    return expand(markdown)


def main(argv: list[str] | None = None) -> int:
    """``--write``: rewrite the generated sections of the pages in place; ``--check``: exit 1 while one is stale."""
    parser = argparse.ArgumentParser(description="Generate the reference pages' sections from the code.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the sections in place")
    mode.add_argument("--check", action="store_true", help="exit 1 if a committed section is stale")
    args = parser.parse_args(argv)
    if args.write:
        for name, page in PAGES.items():
            text = page.read_text(encoding="utf-8")
            if not _section(name).search(text):
                print(f"{page.relative_to(ROOT)}: no <!-- generated:{name}:start/end --> markers", file=sys.stderr)
                return 1
            page.write_text(expand(text), encoding="utf-8")
        return 0
    stale = stale_pages()
    for page in stale:
        print(f"{page.relative_to(ROOT)}: generated section is stale; run `make docs-generate`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
