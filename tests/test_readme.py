"""The README's schedule reference is the format users copy: it must match the pydantic models."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from retune import RetuneSchedule, load_schedule
from retune.schedule.models import TRIGGER_KINDS

README = Path(__file__).resolve().parents[1] / "README.md"


def _reference() -> tuple[str, dict[str, Any]]:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"<!-- schedule-reference:start -->\s*```yaml\n(.*?)```", text, re.S)
    assert match, "README lost its schedule reference block"
    return match.group(1), yaml.safe_load(match.group(1))


def _field_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    paths = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        paths.add(path)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths |= _field_paths(annotation, f"{path}.")
    return paths


def _data_paths(data: Any, prefix: str = "") -> set[str]:
    paths = set()
    if isinstance(data, dict):
        for key, value in data.items():
            path = f"{prefix}{key}"
            paths.add(path)
            if key != "triggers":
                paths |= _data_paths(value, f"{path}.")
    return paths


def test_reference_block_is_a_valid_schedule() -> None:
    _, data = _reference()
    load_schedule(data)


def test_reference_block_names_every_field() -> None:
    _, data = _reference()
    assert _field_paths(RetuneSchedule) == _data_paths(data)


def test_reference_block_shows_every_trigger_kind_and_its_fields() -> None:
    text, data = _reference()
    assert [t["kind"] for t in data["triggers"]] == list(TRIGGER_KINDS)
    for trigger in load_schedule(data).triggers:
        for field in type(trigger).model_fields:
            assert re.search(rf"\b{field}\b", text), f"trigger field {field} missing from the README"


def test_reference_block_lists_every_choice() -> None:
    text, _ = _reference()
    choices = ("power", "binsearch", "model", "free", "keep_effective", "none", "linear", "sqrt", "first", "largest")
    choices += ("exponential", "valley", "steepest", "min_div10", "new", "all")
    for choice in choices:
        assert re.search(rf"\b{choice}\b", text), choice
    for stage in ("train", "val", "test", "predict"):
        assert stage in text
