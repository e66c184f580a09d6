"""The annotated schedule block users copy must match the pydantic models; the README stays a landing page.

The block lives in the docs site's schedule reference (docs/reference/schedule.md) since the README
became a landing page (issue 31); the rest of the pages' snippets are checked by tests/project/test_docs.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from retune import RetuneSchedule, load_schedule
from retune.schedule.models import TRIGGER_KINDS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
REFERENCE = ROOT / "docs" / "reference" / "schedule.md"


def _reference() -> tuple[str, dict[str, Any]]:
    text = REFERENCE.read_text(encoding="utf-8")
    match = re.search(r"<!-- schedule-reference:start -->\s*```yaml\n(.*?)```", text, re.S)
    assert match, "docs/reference/schedule.md lost its annotated schedule block"
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
            assert re.search(rf"\b{field}\b", text), f"trigger field {field} missing from the schedule block"


def test_reference_block_lists_every_choice() -> None:
    text, _ = _reference()
    choices = ("power", "binsearch", "model", "free", "keep_effective", "none", "linear", "sqrt", "first", "largest")
    choices += ("exponential", "valley", "steepest", "min_div10", "new", "all")
    for choice in choices:
        assert re.search(rf"\b{choice}\b", text), choice
    for stage in ("train", "val", "test", "predict"):
        assert stage in text


def test_reference_block_shows_the_defaults() -> None:
    """Every value in the block is the model's default (the block says "every field with its default")."""
    _, data = _reference()
    shown = load_schedule(data).model_dump(exclude={"triggers"})
    assert shown == load_schedule({"triggers": [{"kind": "fit_start"}]}).model_dump(exclude={"triggers"})


def test_readme_keeps_the_two_commands_ci_runs() -> None:
    """.ci/run runs exactly the README's two commands; the landing page must still show them."""
    text = README.read_text(encoding="utf-8")
    block = re.search(r"```bash\n(make run .*?\nmake test .*?)\n```", text)
    assert block, "README lost the `make run` / `make test` block"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert 'make PYTHON="$PYTHON" run' in ci and 'make PYTHON="$PYTHON" test' in ci


def test_readme_is_a_landing_page() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250


def _slugs(page: Path) -> set[str]:
    """Heading anchors as MkDocs' toc (and GitHub) make them."""
    slugs = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.M):
        text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
        slugs.add(re.sub(r"[-\s]+", "-", text).strip("-"))
    return slugs


def test_readme_links_resolve() -> None:
    """Every relative link of the README names a file that exists, and an anchor that its headings make."""
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#([\w-]+))?\)", text)
    assert len(links) >= 15
    for target, anchor in links:
        if target.startswith("http"):
            continue
        path = ROOT / target
        assert path.exists(), f"README links to {target}, which does not exist"
        if anchor:
            assert anchor in _slugs(path), f"README links to {target}#{anchor}: no such heading"
