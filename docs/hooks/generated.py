"""MkDocs hook: the reference pages that are generated from the code at build time.

Two pages hold a marker that this hook replaces while the site builds:

* ``<!-- generated:schedule-reference -->`` (``docs/reference/schedule.md``) becomes one table per
  section of the schedule format, rendered from the pydantic models in ``retune.schedule.models``:
  every field with its type, default, constraints and description. Adding a field to a model adds a
  row here; ``tests/project/test_docs.py`` checks that every field of ``RetuneSchedule`` is listed.
* ``<!-- generated:cli-reference -->`` (``docs/reference/cli.md``) becomes the ``--help`` of the
  ``retune`` command and each subcommand, from ``retune.cli.build_parser``.

The functions here import only retune's schedule models and CLI (pydantic, PyYAML): no mkdocs, no
torch. That lets the tests call them in either virtual environment, mkdocs installed or not.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # build against this checkout's retune, not an installed copy
    sys.path.insert(0, str(ROOT))

from pydantic import BaseModel  # noqa: E402

SCHEDULE_MARKER = "<!-- generated:schedule-reference -->"
CLI_MARKER = "<!-- generated:cli-reference -->"

__all__ = ["CLI_MARKER", "SCHEDULE_MARKER", "cli_reference_markdown", "on_page_markdown", "schedule_reference_markdown"]


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


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs event: fill the markers before the page's Markdown is rendered."""
    if SCHEDULE_MARKER in markdown:
        markdown = markdown.replace(SCHEDULE_MARKER, schedule_reference_markdown())
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference_markdown())
    return markdown
