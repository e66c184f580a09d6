"""Every broken schedule in tests/schedules_bad/ fails with a located, readable ScheduleError.

The table below is the contract: for each file, the exact field path(s) the error points at
(``""`` for problems with the file as a whole) and a piece of text the message must contain,
usually the bad value or the allowed options. A file added to schedules_bad/ without a row here
fails ``test_every_bad_file_is_in_the_table``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from retune import ScheduleError, load_schedule
from retune.errors import FieldProblem

BAD = Path(__file__).parent / "schedules_bad"

# The one row without a file: it is about a path that does not exist.
MISSING = "does_not_exist.yaml"

TRIGGER_KINDS_TEXT = "fit_start, epoch, param_groups_changed, trainable_params_changed, fts_phase, oom"

# (file name in schedules_bad/, expected problem path(s) in order, text the message must contain)
CASES: list[Any] = [
    # -- the file itself ------------------------------------------------------------------------
    (MISSING, "", "no such file"),
    ("is_a_directory.yaml", "", "cannot read the file"),
    ("not_utf8.yaml", "", "cannot read the file: 'utf-8' codec can't decode byte 0xe9"),
    ("settings.ini", "", "unknown file type '.ini'; use one of .yaml, .yml, .json, .toml"),
    ("empty.yaml", "", "the top level must be a mapping of keys to values, got an empty document"),
    ("top_level_list.yaml", "", "the top level must be a mapping of keys to values, got a list"),
    # -- syntax: every parser error names its line ----------------------------------------------
    ("yaml_bad_indent.yaml", "", "YAML syntax error at line 6, column 19: mapping values are not allowed here"),
    ("yaml_tab_indent.yaml", "", "YAML syntax error at line 3, column 1"),
    ("duplicate_key.yaml", "", "duplicate key 'margin' (first on line 6, again on line 9)"),
    ("trailing_comma.json", "", "JSON syntax error at line 6, column 3: Expecting value"),
    ("duplicate_key.json", "", "duplicate key 'triggers'"),
    ("unquoted_string.toml", "", "TOML syntax error: Invalid value (at line 4, column 8)"),
    # -- unknown keys, with a did-you-mean hint where one is close -------------------------------
    (
        "unknown_top_level_key.yaml",
        "batch_size",
        "unknown key 'batch_size'; allowed keys: apply, batch_arg_name, lr_find, memory, search, "
        "stage_batch_arg_names, stages, triggers, version",
    ),
    (
        "typo_steps_per_trail.yaml",
        "search.steps_per_trail",
        "unknown key 'steps_per_trail' (did you mean 'steps_per_trial'?)",
    ),
    (
        "typo_trigger_evry.yaml",
        "triggers[1].evry",
        "unknown key 'evry' (did you mean 'every'?); allowed keys: at, every, kind",
    ),
    (
        "singular_trigger_table.toml",
        ("triggers", "trigger"),
        "unknown key 'trigger' (did you mean 'triggers'?)",
    ),
    # -- wrong types (numbers and booleans are strict) -------------------------------------------
    ("init_val_string.yaml", "search.init_val", "Input should be a valid integer (got '2')"),
    ("init_val_float.json", "search.init_val", "Input should be a valid integer (got 2.0)"),
    ("warm_start_string.yaml", "search.warm_start", "Input should be a valid boolean (got 'yes')"),
    ("epoch_at_string.yml", "triggers[1].at", "Input should be a list (got '5, 10')"),
    ("triggers_not_a_list.json", "triggers", "Input should be a list (got {'kind': 'fit_start'})"),
    # -- out of range -----------------------------------------------------------------------------
    ("margin_too_large.yaml", "search.margin", "Input should be less than 1 (got 1.5)"),
    ("margin_percent.toml", "search.margin", "Input should be less than 1 (got 5)"),
    ("init_val_zero.yaml", "search.init_val", "Input should be greater than or equal to 1 (got 0)"),
    ("max_val_below_init_val.yaml", "search.max_val", "max_val must be >= init_val (64) (got 32)"),
    ("version_2.yaml", "version", "Input should be 1 (got 2)"),
    # -- triggers ---------------------------------------------------------------------------------
    (
        "epoch_at_and_every.yaml",
        "triggers[1]",
        "set exactly one of `at` (a list of epochs) or `every` (N >= 1); both given",
    ),
    ("epoch_neither_at_nor_every.yaml", "triggers[1]", "neither given"),
    ("epoch_at_empty.yaml", "triggers[1].at", "list at least one epoch"),
    ("epoch_at_negative.yaml", "triggers[1].at[1]", "Input should be greater than or equal to 0 (got -1)"),
    ("triggers_empty.yaml", "triggers", f"list at least one trigger; kinds: {TRIGGER_KINDS_TEXT}"),
    ("triggers_missing.yaml", "triggers", "required key is missing"),
    (
        "trigger_kind_unknown.yaml",
        "triggers[1].kind",
        f"unknown trigger kind 'on_unfreeze'; allowed: {TRIGGER_KINDS_TEXT}",
    ),
    ("search_mode_unknown.yaml", "search.mode", "Input should be 'power', 'binsearch' or 'model' (got 'bisect')"),
    # -- throughput objective --------------------------------------------------------------------
    ("objective_unknown.yaml", "search.objective", "Input should be 'largest' or 'throughput' (got 'fastest')"),
    (
        "throughput_one_step.yaml",
        "search.objective",
        "needs search.steps_per_trial >= 2, got 1",
    ),
    ("throughput_tolerance_percent.toml", "search.throughput_tolerance", "Input should be less than 1 (got 5)"),
    ("throughput_tolerance_string.json", "search.throughput_tolerance", "Input should be a valid number (got '0.03')"),
    # -- memory budget ----------------------------------------------------------------------------
    ("budget_unparsable.yaml", "memory.budget", "'12 parsecs' is not a memory size"),
    (
        "budget_number_above_one.yaml",
        "memory.budget",
        "a number budget is a fraction of device memory in (0, 1], got 40",
    ),
    ("stage_typo.yaml", "stages[1]", "Input should be 'train', 'val', 'test' or 'predict' (got 'valid')"),
    # a YAML mapping key that is a list (`[5, 10]` inside a flow mapping, `at:` forgotten)
    ("flow_mapping_missing_key.yaml", "", "line 5"),
]


def _file_name(case: object) -> str:
    values = case.values if hasattr(case, "values") else case  # pytest.param or plain tuple
    return str(values[0])  # type: ignore[index]


def _paths(expected: str | tuple[str, ...]) -> list[str]:
    return [expected] if isinstance(expected, str) else list(expected)


@pytest.mark.parametrize(("filename", "expected_path", "expected_text"), CASES, ids=[_file_name(c) for c in CASES])
def test_bad_schedule_is_reported(filename: str, expected_path: str | tuple[str, ...], expected_text: str) -> None:
    path = BAD / filename
    if filename == MISSING:
        assert not path.exists()

    with pytest.raises(ScheduleError) as info:
        load_schedule(path)
    err = info.value
    message = str(err)

    assert isinstance(err, ValueError)
    assert err.source == str(path)
    assert filename in message
    assert message.startswith(f"{path}: ")

    paths = _paths(expected_path)
    assert [p.path for p in err.problems] == paths
    assert all(isinstance(p, FieldProblem) and p.message for p in err.problems)
    if len(paths) == 1:
        (only,) = paths
        if only:
            assert message.startswith(f"{path}: {only}: "), message
        assert message == f"{path}: {err.problems[0]}"
    else:
        lines = message.splitlines()
        assert lines[0] == f"{path}: {len(paths)} problems"
        assert lines[1:] == [f"  {p}: {problem.message}" for p, problem in zip(paths, err.problems, strict=True)]

    assert expected_text in message
    assert "Traceback" not in message


def test_every_bad_file_is_in_the_table() -> None:
    in_table = {_file_name(case) for case in CASES}
    on_disk = {entry.name for entry in BAD.iterdir()}
    assert len(on_disk) >= 20
    assert on_disk - in_table == set(), "add a row to CASES for each new file in schedules_bad/"
    assert in_table - on_disk == {MISSING}, "a row in CASES names a file that is not in schedules_bad/"


def test_table_rows_are_unique() -> None:
    names = [_file_name(case) for case in CASES]
    assert len(names) == len(set(names))


def test_str_path_is_accepted_and_named_as_given() -> None:
    name = str(BAD / "version_2.yaml")
    with pytest.raises(ScheduleError, match=r"version_2\.yaml: version: Input should be 1 \(got 2\)"):
        load_schedule(name)


def test_dict_source_is_named_dict() -> None:
    with pytest.raises(ScheduleError) as info:
        load_schedule({"triggers": [{"kind": "fit_start"}, {"kind": "epoch", "at": [5, -1]}]})
    assert str(info.value) == "<dict>: triggers[1].at[1]: Input should be greater than or equal to 0 (got -1)"
    assert info.value.source == "<dict>"


def test_several_problems_one_per_line() -> None:
    data = {"search": {"init_val": 0, "margin": 2}, "triggers": []}
    with pytest.raises(ScheduleError) as info:
        load_schedule(data)
    assert str(info.value).splitlines() == [
        "<dict>: 3 problems",
        "  search.init_val: Input should be greater than or equal to 1 (got 0)",
        "  search.margin: Input should be less than 1 (got 2)",
        f"  triggers: list at least one trigger; kinds: {TRIGGER_KINDS_TEXT}",
    ]
    assert [p.path for p in info.value.problems] == ["search.init_val", "search.margin", "triggers"]
