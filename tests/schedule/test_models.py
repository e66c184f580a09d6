"""The schedule model itself: defaults, immutability, round trips, JSON Schema, memory sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from retune import RetuneSchedule, ScheduledBatchSizeFinder, ScheduleError, load_schedule
from retune.schedule.models import (
    TRIGGER_KINDS,
    ApplyConfig,
    EpochTrigger,
    FitStartTrigger,
    MemoryConfig,
    ParamGroupsChangedTrigger,
    SearchConfig,
    TrainableParamsChangedTrigger,
    parse_byte_size,
)

SCHEDULES = Path(__file__).resolve().parents[2] / "schedules"
MINIMAL: dict[str, Any] = {"triggers": [{"kind": "fit_start"}]}

FULL: dict[str, Any] = {
    "version": 1,
    "batch_arg_name": "bs",
    "search": {
        "mode": "binsearch",
        "init_val": 4,
        "steps_per_trial": 2,
        "max_trials": 10,
        "margin": 0.1,
        "max_val": 1024,
        "warm_start": False,
    },
    "memory": {"budget": None},
    "triggers": [
        {"kind": "fit_start"},
        {"kind": "epoch", "at": [3, 7]},
        {"kind": "epoch", "every": 4},
        {"kind": "param_groups_changed"},
        {"kind": "trainable_params_changed", "min_fraction": 0.25},
    ],
    "apply": {"accumulate": "free", "lr_scaling": "none"},
    "stages": ["train"],
    "stage_batch_arg_names": {
        "train": "train_batch_size",
        "val": "val_batch_size",
        "test": "test_batch_size",
        "predict": "predict_batch_size",
    },
}


# -- defaults -----------------------------------------------------------------------------------


def test_defaults_are_filled_in() -> None:
    schedule = load_schedule(MINIMAL)
    assert schedule.model_dump() == {
        "version": 1,
        "batch_arg_name": "batch_size",
        "search": {
            "mode": "binsearch",
            "init_val": 2,
            "steps_per_trial": 3,
            "max_trials": 25,
            "margin": 0.05,
            "max_val": 8192,
            "warm_start": True,
            "objective": "largest",
            "throughput_tolerance": 0.02,
            "probe_samples": "first",
            "sample_size": None,
            "scan_limit": None,
            "batching": "fixed",
            "buckets": 6,
            "predict": "off",
        },
        "memory": {"budget": None},
        "triggers": ({"kind": "fit_start"},),
        "apply": {"accumulate": "free", "lr_scaling": "none"},
        "lr_find": {
            "min_lr": 1e-7,
            "max_lr": 1.0,
            "mode": "exponential",
            "skip_begin": 10,
            "skip_end": 1,
            "steps": 100,
            "early_stop_threshold": 4.0,
            "smoothing": 0.98,
            "suggestion": "valley",
            "groups": "new",
        },
        "stages": ("train",),
        "stage_batch_arg_names": {
            "train": "train_batch_size",
            "val": "val_batch_size",
            "test": "test_batch_size",
            "predict": "predict_batch_size",
        },
    }
    assert isinstance(schedule.search, SearchConfig)
    assert isinstance(schedule.memory, MemoryConfig)
    assert isinstance(schedule.apply, ApplyConfig)


def test_trigger_kinds_become_their_classes() -> None:
    schedule = load_schedule(FULL)
    assert [type(t) for t in schedule.triggers] == [
        FitStartTrigger,
        EpochTrigger,
        EpochTrigger,
        ParamGroupsChangedTrigger,
        TrainableParamsChangedTrigger,
    ]
    epoch_at, epoch_every = schedule.triggers[1], schedule.triggers[2]
    assert isinstance(epoch_at, EpochTrigger)
    assert isinstance(epoch_every, EpochTrigger)
    assert (epoch_at.at, epoch_at.every) == ((3, 7), None)
    assert (epoch_every.at, epoch_every.every) == (None, 4)


def test_margin_accepts_an_integer_zero() -> None:
    # StrictFloat still takes an int (TOML writers often drop the ".0").
    assert load_schedule({**MINIMAL, "search": {"margin": 0}}).search.margin == 0.0


# -- immutability -------------------------------------------------------------------------------


def test_schedule_is_frozen() -> None:
    schedule = load_schedule(FULL)
    with pytest.raises(ValidationError, match="frozen"):
        schedule.batch_arg_name = "other"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        schedule.search.init_val = 64  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        schedule.memory.budget = 0.5  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        schedule.triggers[1].at = (1,)  # type: ignore[misc]
    # Sequences are tuples, so they cannot be changed in place either.
    assert isinstance(schedule.triggers, tuple)
    assert isinstance(schedule.stages, tuple)
    assert isinstance(schedule.triggers[1].at, tuple)  # type: ignore[union-attr]
    assert schedule == load_schedule(FULL)


def test_schedule_is_hashable() -> None:
    assert hash(load_schedule(FULL)) == hash(load_schedule(FULL))


# -- round trips --------------------------------------------------------------------------------


def test_yaml_json_toml_load_the_same_schedule() -> None:
    dumps = [load_schedule(SCHEDULES / f"freeze_unfreeze.{ext}").model_dump() for ext in ("yaml", "json", "toml")]
    assert dumps[0] == dumps[1] == dumps[2]


@pytest.mark.parametrize("data", [MINIMAL, FULL], ids=["minimal", "full"])
def test_dict_model_json_dict_round_trip(data: dict[str, Any]) -> None:
    schedule = load_schedule(data)
    dumped = schedule.model_dump(mode="json")
    json.dumps(dumped)  # plain JSON types only
    again = load_schedule(dumped)
    assert again == schedule
    assert again.model_dump(mode="json") == dumped
    # A JSON text round trip too, as a CI tool would do it.
    assert load_schedule(json.loads(json.dumps(dumped))) == schedule


def test_file_round_trip_through_json(tmp_path: Path) -> None:
    schedule = load_schedule(SCHEDULES / "unfreeze_milestones.yaml")
    out = tmp_path / "dumped.json"
    out.write_text(schedule.model_dump_json(), encoding="utf-8")
    assert load_schedule(out) == schedule


def test_a_ready_model_is_validated_again_and_equal() -> None:
    schedule = load_schedule(FULL)
    assert load_schedule(schedule) == schedule


def test_an_edited_copy_with_a_bad_value_is_refused_not_used() -> None:
    """``model_copy(update=...)`` does not validate: a typo there would have searched without predict, in silence."""
    schedule = load_schedule(FULL)
    edited = schedule.model_copy(update={"search": schedule.search.model_copy(update={"predict": "autto"})})
    with pytest.raises(ScheduleError, match=r"^<RetuneSchedule>: search\.predict: .*\(got 'autto'\)"):
        load_schedule(edited)
    with pytest.raises(ScheduleError, match=r"search\.predict"):
        ScheduledBatchSizeFinder(edited)


def test_path_and_str_give_the_same_schedule() -> None:
    path = SCHEDULES / "fit_start.yaml"
    assert load_schedule(path) == load_schedule(str(path))


# -- JSON Schema --------------------------------------------------------------------------------


def test_json_schema_has_the_public_fields() -> None:
    schema = RetuneSchedule.model_json_schema()
    json.dumps(schema)
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == {
        "version",
        "batch_arg_name",
        "search",
        "memory",
        "triggers",
        "apply",
        "lr_find",
        "stages",
        "stage_batch_arg_names",
    }
    assert schema["required"] == ["triggers"]
    mapping = schema["properties"]["triggers"]["items"]["discriminator"]["mapping"]
    assert set(mapping) == set(TRIGGER_KINDS)
    text = json.dumps(schema)
    for kind in TRIGGER_KINDS:
        assert f'"{kind}"' in text


def test_json_schema_search_fields_and_modes() -> None:
    defs = RetuneSchedule.model_json_schema()["$defs"]
    search = defs["SearchConfig"]["properties"]
    assert set(search) == {
        "mode",
        "init_val",
        "steps_per_trial",
        "max_trials",
        "margin",
        "max_val",
        "warm_start",
        "objective",
        "throughput_tolerance",
        "probe_samples",
        "sample_size",
        "scan_limit",
        "batching",
        "buckets",
        "predict",
    }
    assert search["mode"]["enum"] == ["power", "binsearch", "model"]
    assert search["objective"]["enum"] == ["largest", "throughput"]
    assert all(d["additionalProperties"] is False for d in defs.values())


# -- memory sizes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5GiB", int(1.5 * 2**30)),
        ("1.5 GiB", 1610612736),
        ("  4 kib ", 4096),
        ("1000", 1000),
        ("7b", 7),
        ("1TB", 10**12),
        ("2TiB", 2 * 2**40),
    ],
)
def test_parse_byte_size(text: str, expected: int) -> None:
    assert parse_byte_size(text) == expected


@pytest.mark.parametrize("text", ["12 parsecs", "", "GB", "-1GB", "1e9", "1,5GB", "0.5", "0MB"])
def test_parse_byte_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"not a memory size|less than one byte"):
        parse_byte_size(text)


def test_budget_bytes() -> None:
    total = 80 * 2**30
    assert MemoryConfig(budget=0.5).budget_bytes(total) == 40 * 2**30
    assert MemoryConfig(budget=1).budget_bytes(total) == total
    assert MemoryConfig(budget=0.5).budget_bytes(None) is None
    assert MemoryConfig(budget="512MiB").budget_bytes(total) == 512 * 2**20
    assert MemoryConfig(budget="512MiB").budget_bytes(None) == 512 * 2**20
    assert MemoryConfig().budget_bytes(total) is None


@pytest.mark.parametrize("budget", [0, 0.0, -0.5, 1.01, True, [1], "12 parsecs"])
def test_memory_config_rejects(budget: object) -> None:
    with pytest.raises(ValidationError):
        MemoryConfig(budget=budget)  # type: ignore[arg-type]


# -- sources that are not schedules -------------------------------------------------------------


@pytest.mark.parametrize("source", [123, None, ["triggers"], b"triggers: []"], ids=["int", "none", "list", "bytes"])
def test_load_schedule_rejects_other_types(source: object) -> None:
    with pytest.raises(ScheduleError) as info:
        load_schedule(source)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert str(info.value) == (
        f"<schedule>: expected a file path, a dict or a RetuneSchedule, got {type(source).__name__}"
    )


def test_yaml_merge_keys_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text(
        "triggers:\n"
        "  - kind: fit_start\n"
        "  - &unfreeze\n"
        "    kind: trainable_params_changed\n"
        "    min_fraction: 0.1\n"
        "  - <<: *unfreeze\n"
        "    min_fraction: 0.5\n",
        encoding="utf-8",
    )
    schedule = load_schedule(path)
    assert [getattr(t, "min_fraction", None) for t in schedule.triggers] == [None, 0.1, 0.5]


@pytest.mark.parametrize(("written", "meant"), [("off", "off"), ("auto", "auto"), ("false", "off"), ("no", "off")])
def test_predict_off_in_yaml_means_off(tmp_path: Path, written: str, meant: str) -> None:
    """YAML 1.1 reads a bare ``off`` as false: ``search.predict: off`` must still mean "off", not an error. A true
    (``on``, ``yes``, ``true``) is refused: tests/schedules_bad/predict_on.yaml."""
    path = tmp_path / "schedule.yaml"
    path.write_text(f"triggers: [{{kind: fit_start}}]\nsearch:\n  predict: {written}\n", encoding="utf-8")
    assert load_schedule(path).search.predict == meant


def test_predict_refuses_other_values() -> None:
    with pytest.raises(ScheduleError, match=r"search\.predict"):
        load_schedule({"triggers": [{"kind": "fit_start"}], "search": {"predict": "sometimes"}})
