"""Turn a path, dict or model into a validated :class:`RetuneSchedule`, or a :class:`ScheduleError`.

Parsing is done here rather than by pydantic so that every failure (missing file, syntax error
with its line, duplicate YAML key, unknown key, bad value) becomes one message naming the file,
the field path and what is allowed. Users fix configs from that message alone.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import tomllib
import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from retune.errors import FieldProblem, ScheduleError
from retune.schedule.models import TRIGGER_KINDS, FieldConflict, RetuneSchedule

ScheduleSource = Union[str, Path, Mapping[str, Any], RetuneSchedule]

SUFFIXES = {".yaml": "yaml", ".yml": "yaml", ".json": "json", ".toml": "toml"}


def load_schedule(source: ScheduleSource) -> RetuneSchedule:
    """Return a validated, immutable schedule with defaults filled in.

    Args:
        source: a path to a ``.yaml``/``.yml``, ``.json`` or ``.toml`` file, a dict with the same
            content, or a :class:`RetuneSchedule` (validated again: an edited copy, ``model_copy(update=...)``,
            is not validated by pydantic).

    Raises:
        ScheduleError: naming the file (or ``<dict>``), the field path, the bad value and what is
            allowed, for any problem from a missing file to an out-of-range number.
    """
    if isinstance(source, RetuneSchedule):
        # validated again: ``model_copy(update=...)`` and attribute writes through ``object.__setattr__`` skip
        # validation, so an edited schedule may hold a value no file could (a typo'd predict that would search
        # without it in silence)
        return validate_data(source.model_dump(mode="python", exclude_unset=True), f"<{type(source).__name__}>")
    if isinstance(source, Mapping):
        return validate_data(dict(source), "<dict>")
    if isinstance(source, (str, Path)):
        path = Path(source)
        return validate_data(read_schedule_file(path), str(path))
    raise ScheduleError(
        "<schedule>",
        [FieldProblem("", f"expected a file path, a dict or a RetuneSchedule, got {type(source).__name__}")],
    )


def read_schedule_file(path: Path) -> dict[str, Any]:
    """Read and parse one schedule file into plain data; raise ScheduleError naming the file."""
    name = str(path)
    fmt = SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise ScheduleError(
            name, [FieldProblem("", f"unknown file type {path.suffix!r}; use one of {', '.join(SUFFIXES)}")]
        )
    if not path.exists():
        raise ScheduleError(name, [FieldProblem("", "no such file")])
    try:
        text = path.read_text(encoding="utf-8-sig")  # editors on Windows prepend a byte-order mark
    except (OSError, UnicodeDecodeError) as exc:
        raise ScheduleError(name, [FieldProblem("", f"cannot read the file: {exc}")]) from None
    data = _parse(text, fmt, name)
    if not isinstance(data, dict):
        raise ScheduleError(
            name, [FieldProblem("", f"the top level must be a mapping of keys to values, got {_kind(data)}")]
        )
    return data


def validate_data(data: dict[str, Any], source: str) -> RetuneSchedule:
    """Validate already parsed data; ``source`` names it in error messages."""
    try:
        schedule = RetuneSchedule.model_validate(data)
    except ValidationError as exc:
        yaml_read = not source.lower().endswith((".json", ".toml"))  # a file's parser, or a dict (often YAML's)
        raise ScheduleError(source, [_problem(err, yaml_read) for err in exc.errors()]) from None
    return schedule


# -- parsing -----------------------------------------------------------------------------------


class _StrictYamlLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys: YAML keeps the last one silently, losing the first."""


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _construct_mapping(loader: _StrictYamlLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:
            continue  # `<<: *anchor` merges; keys written beside it legitimately override merged ones
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        try:
            duplicate = key in seen
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a plain value, found {_kind(key)} (a missing `key:`?)", key_node.start_mark
            ) from None
        if duplicate:
            message = f"duplicate key {key!r} (first on line {seen[key]}, again on line {line})"
            raise yaml.constructor.ConstructorError(None, None, message, key_node.start_mark)
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictYamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


_OCTAL = re.compile(r"[-+]?0[0-7_]+")  # YAML 1.1's octal integer: `010` is 8
_LEADING_ZERO_DECIMAL = re.compile(r"[-+]?0[0-9_]*[89][0-9_]*")  # `09`: no octal, no integer: a string
_SEXAGESIMAL = re.compile(r"[-+]?[1-9][0-9_]*(?::[0-5]?[0-9])+")  # YAML 1.1's base 60: `1:30` is 90


def _construct_int(loader: _StrictYamlLoader, node: yaml.ScalarNode) -> int:
    """An integer as written: YAML 1.1 reads `every: 010` as 8 and `at: [1:30]` as 90, without a word."""
    value = int(loader.construct_yaml_int(node))
    text = str(node.value)
    if _OCTAL.fullmatch(text):
        sign = text[0] if text[0] in "+-" else ""
        decimal = sign + (text.lstrip("+-").lstrip("0_") or "0")
        message = f"YAML 1.1 reads {text} as octal (a leading zero), the integer {value}: write {value}, or {decimal}"
    elif _SEXAGESIMAL.fullmatch(text):
        message = f"YAML 1.1 reads {text} as base 60 (a colon), the integer {value}: write {value}"
    else:
        return value
    raise yaml.constructor.ConstructorError(None, None, message, node.start_mark)


_StrictYamlLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _construct_float(loader: _StrictYamlLoader, node: yaml.ScalarNode) -> float:
    """A float as written: YAML 1.1 reads `margin: 0:05.5` (base 60) as 5.5."""
    value = float(loader.construct_yaml_float(node))
    text = str(node.value)
    if ":" in text:
        raise yaml.constructor.ConstructorError(
            None,
            None,
            f"YAML 1.1 reads {text} as base 60 (a colon), the number {value}: write {value}",
            node.start_mark,
        )
    return value


_StrictYamlLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def _reject_duplicate_json_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _parse(text: str, fmt: str, name: str) -> Any:
    try:
        if fmt == "yaml":
            return yaml.load(text, Loader=_StrictYamlLoader)
        if fmt == "json":
            return json.loads(text, object_pairs_hook=_reject_duplicate_json_keys)
        return tomllib.loads(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        detail = " ".join(part for part in (exc.context, exc.problem) if part)
        label = "YAML error" if isinstance(exc, yaml.constructor.ConstructorError) else "YAML syntax error"
        raise ScheduleError(name, [FieldProblem("", f"{label} at {where}{detail}")]) from None
    except yaml.YAMLError as exc:
        raise ScheduleError(name, [FieldProblem("", f"YAML syntax error: {exc}")]) from None
    except json.JSONDecodeError as exc:
        raise ScheduleError(
            name, [FieldProblem("", f"JSON syntax error at line {exc.lineno}, column {exc.colno}: {exc.msg}")]
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ScheduleError(name, [FieldProblem("", f"TOML syntax error: {exc}")]) from None
    except ValueError as exc:  # duplicate JSON key
        raise ScheduleError(name, [FieldProblem("", f"JSON error: {exc}")]) from None


def _kind(value: Any) -> str:
    if value is None:
        return "an empty document"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__}"


# -- error messages ----------------------------------------------------------------------------


_UNION_FIELDS = {"at", "every", "budget"}
_UNION_MEMBER_NAMES = {"float", "str", "int", "none", "tuple[int,...]", "tuple[constrained-int,...]", "constrained-int"}


def format_path(loc: Sequence[int | str]) -> str:
    """``('triggers', 1, 'epoch', 'at')`` -> ``triggers[1].at`` (the union tag is not a user key)."""
    out = ""
    parts = list(loc)
    for i, part in enumerate(parts):
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        after_trigger_index = i >= 2 and parts[i - 2] == "triggers" and isinstance(parts[i - 1], int)
        if after_trigger_index and part in TRIGGER_KINDS:
            continue
        after_union_field = i >= 1 and parts[i - 1] in _UNION_FIELDS
        if after_union_field and (part.startswith("function-") or part in _UNION_MEMBER_NAMES):
            continue  # pydantic's names for union members, not keys
        out += f".{part}" if out else part
    return out


def _model_at(loc: Sequence[int | str], data_kind: str | None) -> type[BaseModel] | None:
    """The model class whose keys are allowed at ``loc`` (for 'did you mean' hints)."""
    model: type[BaseModel] = RetuneSchedule
    parts = list(loc)
    i = 0
    while i < len(parts):
        part = parts[i]
        if part == "triggers":
            from retune.schedule import models as sched

            by_kind: dict[str, type[BaseModel]] = {
                "fit_start": sched.FitStartTrigger,
                "epoch": sched.EpochTrigger,
                "param_groups_changed": sched.ParamGroupsChangedTrigger,
                "trainable_params_changed": sched.TrainableParamsChangedTrigger,
                "fts_phase": sched.FtsPhaseTrigger,
                "oom": sched.OomTrigger,
            }
            kind = parts[i + 2] if i + 2 < len(parts) else data_kind
            found = by_kind.get(str(kind))
            if found is None:
                return None
            model = found
            i += 3
            continue
        field = model.model_fields.get(str(part))
        annotation = None if field is None else field.annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return model if i == len(parts) else None
        model = annotation
        i += 1
    return model


def _elsewhere(key: str, here: type[BaseModel] | None) -> list[str]:
    """Where ``key`` is a field, other than in ``here``: ``memory.budget`` for a ``budget`` under ``search``."""
    places = [] if here is RetuneSchedule or key not in RetuneSchedule.model_fields else [f"top-level {key}"]
    for name, field in RetuneSchedule.model_fields.items():
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel) and section is not here:
            places += [f"{name}.{key}"] if key in section.model_fields else []
    return places


def _unknown_key(loc: Sequence[int | str], key: str, shown: str) -> str:
    model = _model_at(loc[:-1], None)
    allowed = sorted(model.model_fields) if model is not None else []
    hints = [] if model is None else _elsewhere(key, model)
    hints += [repr(close) for close in difflib.get_close_matches(key, allowed, n=1)]
    msg = f"unknown key {shown}"
    if hints:
        msg += f" (did you mean {' or '.join(hints)}?)"
    if allowed:
        msg += f"; allowed keys: {', '.join(allowed)}"
    return msg


_YAML11_STRING_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def _yaml11_number(value: Any, kind: str) -> str | None:
    """``min_lr: 1e-7`` reaches a number field as the string '1e-7': YAML 1.1 (PyYAML) reads an exponent as a
    number only with a dot in the mantissa and a sign in the exponent. The spelling it reads, or None."""
    if isinstance(value, str) and _LEADING_ZERO_DECIMAL.fullmatch(value.strip()) and kind == "int_type":
        return str(int(value.strip().replace("_", "")))  # `09`: not octal (a 9), so YAML 1.1 leaves it a string
    if not isinstance(value, str) or not _YAML11_STRING_NUMBER.match(value.strip()):
        return None
    mantissa, _, exponent = value.strip().lower().partition("e")
    if kind == "int_type":
        number = float(value)
        return f"{int(number)}" if number.is_integer() else None
    mantissa += "" if "." in mantissa else ".0"
    mantissa = f"0{mantissa}" if mantissa.lstrip("+-").startswith(".") else mantissa
    return f"{mantissa}e{exponent if exponent[0] in '+-' else '+' + exponent}"


def _problem(err: ErrorDetails, yaml_read: bool = True) -> FieldProblem:
    loc = err["loc"]
    conflict = err.get("ctx", {}).get("error")
    if isinstance(conflict, FieldConflict):
        loc = (*loc, conflict.field)
    path = format_path(loc)
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        return FieldProblem(path, _unknown_key(loc, str(loc[-1]), repr(str(loc[-1]))))
    if kind == "invalid_key":
        # a key YAML read as a number, a boolean (a bare `on:`) or null: not a name; shown as written
        where = format_path(loc[:-1])
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        what = "null" if value is None else "a number" if isinstance(value, (int, float)) else f"a {_kind(value)[2:]}"
        if isinstance(value, bool):
            what = "a boolean (YAML 1.1 reads a bare on, off, yes, no as one; quote it)"
        message = _unknown_key((*loc[:-1], shown), shown, f"{shown}: a key is a name, not {what}")
        return FieldProblem(f"{where}.{shown}" if where else shown, message)
    if kind == "missing":
        return FieldProblem(path, "required key is missing")
    if kind == "union_tag_invalid":
        return FieldProblem(
            f"{path}.kind" if path else "kind",
            f"unknown trigger kind {_short(err.get('ctx', {}).get('tag'))}; allowed: {', '.join(TRIGGER_KINDS)}",
        )
    if kind == "union_tag_not_found":
        return FieldProblem(path, f"a trigger needs a `kind`; allowed: {', '.join(TRIGGER_KINDS)}")
    spelled = _yaml11_number(value, kind) if yaml_read and kind in {"int_type", "float_type"} else None
    if spelled is not None:
        return FieldProblem(path, f"YAML 1.1 reads {value} as the string {value!r}, not a number: write {spelled}")
    message = err["msg"].replace("valid tuple", "list")
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if isinstance(value, dict) and kind not in {"list_type", "tuple_type", "dict_type", "model_type"}:
        return FieldProblem(path, message)  # a rule between a section's fields: the message names them
    if isinstance(value, list) and kind == "value_error":
        return FieldProblem(path, message)  # a rule on a list (at least one trigger): the message says what
    if _shows(message, value):
        return FieldProblem(path, message)  # the message already shows the value
    return FieldProblem(path, f"{message} (got {_short(value)})")


def _shows(message: str, value: Any) -> bool:
    """Whether ``message`` already shows ``value``: a string quoted in it, or any value after a "got". A number's
    digits alone do not count: "Input should be less than 1" says nothing of the 1 it got."""
    if isinstance(value, str) and repr(value) in message:
        return True
    return any(f"got {text}" in message for text in (repr(value), str(value)))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = ["SUFFIXES", "ScheduleSource", "format_path", "load_schedule", "read_schedule_file", "validate_data"]
