"""Every ready-made schedule shipped in schedules/ loads, and the format variants agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from retune import RetuneSchedule, load_schedule
from retune.schedule.loading import SUFFIXES

SCHEDULES = Path(__file__).resolve().parents[2] / "schedules"
FILES = sorted(p for p in SCHEDULES.iterdir() if not p.name.startswith("."))


def test_schedules_dir_is_populated() -> None:
    assert len(FILES) >= 6, f"expected at least 6 schedules in {SCHEDULES}, found {[p.name for p in FILES]}"


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_schedule_file_validates(path: Path) -> None:
    assert path.is_file()
    assert path.suffix in SUFFIXES
    schedule = load_schedule(path)
    assert isinstance(schedule, RetuneSchedule)
    assert schedule.triggers


def test_freeze_unfreeze_formats_are_equivalent() -> None:
    yaml_s, json_s, toml_s = (load_schedule(SCHEDULES / f"freeze_unfreeze.{ext}") for ext in ("yaml", "json", "toml"))
    assert yaml_s == json_s == toml_s
    assert yaml_s.model_dump() == json_s.model_dump() == toml_s.model_dump()
    assert [t.kind for t in yaml_s.triggers] == ["fit_start", "trainable_params_changed"]
