"""Rules between fields, defaults included, and the messages of mistakes YAML makes easy (review of the schedule
reference: a field another field makes meaningless is an error, never silently ignored).

Each rule is refused where the file chose the value (written, and other than its default): the annotated reference
block restates every default, and a copy of it, or ``retune show``'s expansion, must load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from retune import ScheduleError, load_schedule
from retune.schedule.models import RetuneSchedule

FIT_START: list[dict[str, Any]] = [{"kind": "fit_start"}]


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(ScheduleError) as info:
        load_schedule({"triggers": FIT_START, **data})
    message = str(info.value)
    assert "Traceback" not in message and len(info.value.problems) == 1, message
    return message


def _loads(data: dict[str, Any]) -> RetuneSchedule:
    return load_schedule({"triggers": FIT_START, **data})


# -- 1: max_val >= init_val, the default max_val included ------------------------------------------------------


def test_init_val_above_the_default_max_val_is_refused() -> None:
    assert _error({"search": {"init_val": 10000}}) == (
        "<dict>: search.init_val: max_val (8192, the default) must be >= init_val (10000); raise max_val or lower "
        "init_val"
    )
    assert _error({"search": {"init_val": 64, "max_val": 32}}) == (
        "<dict>: search.max_val: max_val (32) must be >= init_val (64); raise max_val or lower init_val"
    )
    assert _error({"search": {"max_val": 1}}).startswith("<dict>: search.max_val: max_val (1) must be >= init_val (2, ")
    assert _loads({"search": {"init_val": 8192}}).search.init_val == 8192
    assert _loads({"search": {"init_val": 10000, "max_val": 10000}}).search.max_val == 10000


# -- 2: fields another field makes meaningless ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("search", "path", "text"),
    [
        ({"scan_limit": 100}, "search.scan_limit", "but probe_samples is 'first' (the default), which sizes none"),
        ({"probe_samples": "first", "scan_limit": 5}, "search.scan_limit", "probe_samples is 'first', which"),
        (
            {"throughput_tolerance": 0.05},
            "search.throughput_tolerance",
            "objective is 'largest' (the default), which times none; set `objective: throughput` or remove",
        ),
        ({"mode": "power", "margin": 0.1}, "search.margin", "mode is 'power', whose sizes (init_val doubled)"),
        ({"buckets": 4}, "search.buckets", "batching is 'fixed' (the default), which makes none"),
    ],
)
def test_a_field_its_neighbour_ignores_is_refused(search: dict[str, Any], path: str, text: str) -> None:
    message = _error({"search": search})
    assert message.startswith(f"<dict>: {path}: ") and text in message, message


@pytest.mark.parametrize(
    "search",
    [
        {"scan_limit": None},
        {"probe_samples": "largest", "scan_limit": 100},
        {"batching": "buckets", "buckets": 3},
        {"throughput_tolerance": 0.02},
        {"objective": "throughput", "throughput_tolerance": 0.1},
        {"mode": "binsearch", "margin": 0.1},
        {"mode": "power", "margin": 0.0},  # no margin: what power does
        {"buckets": 6},
    ],
)
def test_a_field_that_applies_or_restates_its_default_is_accepted(search: dict[str, Any]) -> None:
    assert _loads({"search": search}).search.model_dump(exclude_unset=True) == search


def test_an_expanded_schedule_loads_again() -> None:
    """``retune show`` writes every field, defaults restated (throughput_tolerance with objective: largest, ...); it
    loads again."""
    schedule = _loads({"search": {"mode": "power", "probe_samples": "largest", "scan_limit": 10}})
    assert load_schedule(schedule.model_dump()) == schedule


def test_a_second_oom_trigger_is_refused_naming_its_index() -> None:
    triggers = [{"kind": "fit_start"}, {"kind": "oom"}, {"kind": "oom", "loss_reduction": "sum"}]
    assert _error({"triggers": triggers}) == (
        "<dict>: triggers[2]: a second oom trigger (the first is triggers[1]): only the first recovers a step that "
        "runs out of memory, so this one's settings would be ignored; keep one oom trigger"
    )


@pytest.mark.parametrize(
    "twice",
    [{"kind": "fit_start"}, {"kind": "epoch", "at": [5, 10]}, {"kind": "oom"}, {"kind": "trainable_params_changed"}],
)
def test_an_exact_duplicate_trigger_is_refused_naming_its_index(twice: dict[str, Any]) -> None:
    message = _error({"triggers": [twice, {"kind": "param_groups_changed"}, twice]})
    assert message == (
        f"<dict>: triggers[2]: repeats triggers[0] (kind {twice['kind']}, the same settings): a trigger listed "
        "twice adds nothing; remove one"
    )


def test_triggers_of_one_kind_with_other_settings_are_accepted() -> None:
    triggers = [
        {"kind": "epoch", "at": [5]},
        {"kind": "epoch", "every": 5},
        {"kind": "trainable_params_changed"},
        {"kind": "trainable_params_changed", "min_fraction": 0.1},
    ]
    assert len(load_schedule({"triggers": triggers}).triggers) == 4


def test_a_repeated_lr_find_group_is_refused() -> None:
    assert _error({"lr_find": {"groups": [0, 2, 0]}}) == (
        "<dict>: lr_find.groups: group indices must not repeat (0 listed twice), got [0, 2, 0]; list each group once"
    )
    assert _loads({"lr_find": {"groups": [2, 0]}}).lr_find.groups == (2, 0)


def test_the_shipped_and_example_schedules_use_no_refused_combination() -> None:
    root = Path(__file__).resolve().parents[2]
    files = [*sorted((root / "schedules").iterdir()), root / "examples" / "hf_peft_schedule.yaml"]
    assert len(files) >= 14
    for path in files:  # the other examples/*.yaml are LightningCLI and finetuning-scheduler configs
        load_schedule(path)


# -- 3: YAML 1.1 reads an exponent without a dot (or without a sign) as a string --------------------------------

YAML11 = """\
triggers: [{kind: fit_start}]
search: {init_val: 1e3, margin: 5e-2, max_val: 1.0e4}
lr_find: {min_lr: 1e-7, max_lr: 1.0e7, early_stop_threshold: 4e0}
"""


def test_yaml11_exponents_are_reported_with_the_spelling_yaml_reads(tmp_path: Path) -> None:
    path = tmp_path / "exponents.yaml"
    path.write_text(YAML11, encoding="utf-8")
    with pytest.raises(ScheduleError) as info:
        load_schedule(path)
    assert [f"{p.path}: {p.message}" for p in info.value.problems] == [
        "search.init_val: YAML 1.1 reads 1e3 as the string '1e3', not a number: write 1000",
        "search.margin: YAML 1.1 reads 5e-2 as the string '5e-2', not a number: write 5.0e-2",
        "search.max_val: YAML 1.1 reads 1.0e4 as the string '1.0e4', not a number: write 10000",
        "lr_find.min_lr: YAML 1.1 reads 1e-7 as the string '1e-7', not a number: write 1.0e-7",
        "lr_find.max_lr: YAML 1.1 reads 1.0e7 as the string '1.0e7', not a number: write 1.0e+7",
        "lr_find.early_stop_threshold: YAML 1.1 reads 4e0 as the string '4e0', not a number: write 4.0e+0",
    ]
    fixed = YAML11.replace("1e3", "1000").replace("5e-2", "5.0e-2").replace("1.0e4", "10000")
    fixed = fixed.replace("1e-7", "1.0e-7").replace("1.0e7", "1.0e+7").replace("4e0", "4.0e+0")
    path.write_text(fixed, encoding="utf-8")
    schedule = load_schedule(path)
    assert (schedule.search.init_val, schedule.search.margin, schedule.lr_find.min_lr) == (1000, 0.05, 1e-7)


def test_a_quoted_number_keeps_the_strict_message() -> None:
    """Only the exponent spellings YAML 1.1 misreads get the hint; a quoted "2" is refused as before."""
    assert _error({"search": {"init_val": "2"}}).endswith("Input should be a valid integer (got '2')")
    assert _error({"search": {"init_val": "1e-1"}}).endswith("Input should be a valid integer (got '1e-1')")


def test_a_quoted_exponent_in_json_is_not_blamed_on_yaml(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text('{"triggers": [{"kind": "fit_start"}], "lr_find": {"min_lr": "1e-7"}}', encoding="utf-8")
    with pytest.raises(ScheduleError, match=r"lr_find\.min_lr: Input should be a valid number \(got '1e-7'\)$"):
        load_schedule(path)


@pytest.mark.parametrize(
    ("written", "message"),
    [
        (
            "every: 010",
            "line 2, column 33: YAML 1.1 reads 010 as octal (a leading zero), the integer 8: write 8, or 10",
        ),
        (
            "at: [3, 012]",
            "line 2, column 34: YAML 1.1 reads 012 as octal (a leading zero), the integer 10: write 10, or 12",
        ),
        ("at: [1:30]", "line 2, column 31: YAML 1.1 reads 1:30 as base 60 (a colon), the integer 90: write 90"),
    ],
)
def test_yaml11_octal_and_base_60_integers_are_refused(tmp_path: Path, written: str, message: str) -> None:
    """PyYAML reads `every: 010` as 8 and `at: [1:30]` as 90 without a word: the file would run other epochs."""
    path = tmp_path / "octal.yaml"
    path.write_text(f"version: 1\ntriggers: [{{kind: epoch, {written}}}]\n", encoding="utf-8")
    with pytest.raises(ScheduleError) as info:
        load_schedule(path)
    assert str(info.value) == f"{path}: YAML error at {message}"


def test_yaml11_leading_zero_decimals_and_base_60_floats_say_what_to_write(tmp_path: Path) -> None:
    """`every: 09` is no octal, so YAML 1.1 reads the string '09' (the error said only "valid integer"); `margin:
    0:05.5` is base 60, the float 5.5 (refused by the margin's range, as if the file said 5.5)."""
    path = tmp_path / "zero.yaml"
    path.write_text("triggers: [{kind: epoch, every: 09}]\n", encoding="utf-8")
    with pytest.raises(
        ScheduleError,
        match=r"triggers\[0\]\.every: YAML 1.1 reads 09 as the string '09', not a number: "
        r"write 9$",
    ):
        load_schedule(path)
    path.write_text("triggers: [{kind: fit_start}]\nsearch: {margin: 0:05.5}\n", encoding="utf-8")
    with pytest.raises(ScheduleError) as info:
        load_schedule(path)
    assert str(info.value) == (
        f"{path}: YAML error at line 2, column 18: YAML 1.1 reads 0:05.5 as base 60 (a colon), the number 5.5: "
        "write 5.5"
    )


def test_integers_yaml_reads_as_written_still_load(tmp_path: Path) -> None:
    path = tmp_path / "plain.yaml"
    path.write_text(
        "triggers: [{kind: epoch, at: [0, 10, 1_000]}, {kind: epoch, every: 0x10}]\nsearch: {margin: 0.05}\n",
        encoding="utf-8",
    )
    schedule = load_schedule(path)
    milestones, every = schedule.triggers
    assert (milestones.at, every.every, schedule.search.margin) == ((0, 10, 1000), 16, 0.05)


# -- 4: budgets ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("budget", "shown"), [(1e-300, "1e-300"), ("1e-9", "'1e-9'"), (5e-7, "5e-07")])
def test_a_fraction_budget_below_a_millionth_is_refused(budget: object, shown: str) -> None:
    message = _error({"memory": {"budget": budget}})
    assert message.startswith("<dict>: memory.budget: a fraction budget below a millionth of device memory leaves ")
    assert message.endswith(f"GPU, got {shown}; write a fraction such as 0.8, or a budget that small as a size with a "
                            "unit, e.g. '64KiB'")  # fmt: skip


def test_a_budget_of_a_millionth_and_a_tiny_absolute_size_are_accepted() -> None:
    assert _loads({"memory": {"budget": 1e-6}}).memory.budget == 1e-6
    assert _loads({"memory": {"budget": "1KiB"}}).memory.budget_bytes(None) == 1024


@pytest.mark.parametrize(("budget", "shown"), [([1], "[1]"), (True, "True"), ({"MiB": 5}, "{'MiB': 5}")])
def test_a_budget_of_the_wrong_type_echoes_it(budget: object, shown: str) -> None:
    assert _error({"memory": {"budget": budget}}).endswith(f"or a size such as '512MiB', got {shown}")


# -- 5: a key in the wrong section ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {"search": {"budget": "1GB"}},
            "search.budget: unknown key 'budget' (did you mean memory.budget or 'buckets'?)",
        ),
        (
            {"memory": {"margin": 0.1}},
            "memory.margin: unknown key 'margin' (did you mean search.margin?); allowed keys: ",
        ),
        ({"apply": {"mode": "power"}}, "apply.mode: unknown key 'mode' (did you mean search.mode or lr_find.mode?)"),
        ({"budget": 0.5}, "budget: unknown key 'budget' (did you mean memory.budget?); allowed keys: apply, "),
        (
            {"lr_find": {"stages": ["val"]}},
            "lr_find.stages: unknown key 'stages' (did you mean top-level stages or 'steps'?)",
        ),
        ({"search": {"steps_per_trail": 3}}, "search.steps_per_trail: unknown key 'steps_per_trail' (did you mean "),
    ],
)
def test_a_key_of_another_section_is_named_before_the_spelling_hint(data: dict[str, Any], expected: str) -> None:
    assert _error(data).startswith(f"<dict>: {expected}")


# -- 6: message cosmetics ---------------------------------------------------------------------------------------


def test_throughput_with_one_step_says_got_once() -> None:
    assert _error({"search": {"objective": "throughput", "steps_per_trial": 1}}) == (
        "<dict>: search.objective: objective 'throughput' times the steps after the first of each trial (the first "
        "warms up), so it needs search.steps_per_trial >= 2, got 1"
    )


def test_a_key_that_is_not_a_name_is_shown_as_written(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("triggers: [{kind: fit_start}]\n1: x\nsearch: {2.5: 1}\n", encoding="utf-8")
    with pytest.raises(ScheduleError) as info:
        load_schedule(path)
    problems = {p.path: p.message for p in info.value.problems}
    assert set(problems) == {"1", "search.2.5"}
    assert problems["1"].startswith("unknown key 1: a key is a name, not a number; allowed keys: apply, ")
    assert problems["search.2.5"].startswith("unknown key 2.5: a key is a name, not a number; allowed keys: batching")
    path.write_text("triggers: [{kind: fit_start}]\non: 1\n", encoding="utf-8")
    with pytest.raises(ScheduleError, match=r": true: unknown key true: a key is a name, not a boolean \(YAML 1\.1 "):
        load_schedule(path)
