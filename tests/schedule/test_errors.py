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

BAD = Path(__file__).resolve().parents[1] / "schedules_bad"

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
    ("margin_one.yaml", "search.margin", "Input should be less than 1 (got 1)"),  # the 1 in "than 1" is not it
    ("margin_nan.yaml", "search.margin", "Input should be a finite number (got nan)"),
    ("predict_on.yaml", "search.predict", "not a boolean: write predict: auto (got True)"),
    ("predict_list.json", "search.predict", "Input should be 'off' or 'auto' (got ['auto'])"),
    ("buckets_power.yaml", "search.batching", "its sizes are not init_val doubled as search.mode: power promises"),
    ("init_val_zero.yaml", "search.init_val", "Input should be greater than or equal to 1 (got 0)"),
    ("max_val_below_init_val.yaml", "search.max_val", "max_val (32) must be >= init_val (64); raise max_val"),
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
    (
        "budget_quoted_above_one.yaml",
        "memory.budget",
        "a number budget is a fraction of device memory in (0, 1], got '40'; write absolute sizes with a unit",
    ),
    # -- dotted paths are resolved when the schedule is validated (issue 28) ------------------------
    (
        "sample_size_not_importable.yaml",
        "search.sample_size",
        "cannot import module 'mypkg_not_installed.sizes' of 'mypkg_not_installed.sizes.tokens': "
        "No module named 'mypkg_not_installed'",
    ),
    (
        "sample_size_not_a_function.yaml",
        "search.sample_size",
        "'tests.helpers.varlen.BUDGET' is a str, not a function fn(sample) -> int",
    ),
    (
        "loss_items_not_importable.json",
        "triggers[1].loss_items",
        "cannot import module 'mypkg_not_installed.items' of 'mypkg_not_installed.items:count'",
    ),
    # -- fields that another field makes meaningless, and fractions written as percentages ----------
    (
        "loss_items_with_mean.yaml",
        "triggers[1].loss_items",
        "loss_items ('shifted_labels') counts what a token_mean loss averages over, but loss_reduction is 'mean' "
        "(the default), which does not use it; set `loss_reduction: token_mean` or remove loss_items",
    ),
    (
        "min_fraction_percent.yaml",
        "triggers[1].min_fraction",
        "min_fraction is a fraction of the trainable-parameter count, 0 <= x < 1 (0.05 for 5%), got 5",
    ),
    ("stage_typo.yaml", "stages[1]", "Input should be 'train', 'val', 'test' or 'predict' (got 'valid')"),
    # -- lr_find: cross-field rules checked on the final values, defaults included ---------------
    (
        "lr_find_min_lr_above_default_max.yaml",
        "lr_find.min_lr",
        "max_lr (1.0, the default) must be greater than min_lr (2.0)",
    ),
    (
        "lr_find_skip_begin_above_default_steps.yaml",
        "lr_find.skip_begin",
        "steps (100, the default) must leave at least 2 points of the curve after skip_begin (150) and skip_end "
        "(1, the default)",
    ),
    (
        "lr_find_skips_leave_one_point.json",
        "lr_find.skip_end",
        "steps (100, the default) must leave at least 2 points of the curve after skip_begin (0) and skip_end (99)",
    ),
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


def test_a_quoted_fraction_budget_is_the_fraction() -> None:
    """``budget: "0.8"`` (quoted in YAML, or a string from an environment variable) means what ``0.8`` means,
    not 0.8 bytes; a quoted number above one is refused like the bare number (see the table)."""
    quoted = load_schedule({"memory": {"budget": "0.8"}, "triggers": [{"kind": "fit_start"}]})
    bare = load_schedule({"memory": {"budget": 0.8}, "triggers": [{"kind": "fit_start"}]})
    assert quoted == bare and quoted.memory.budget == 0.8
    assert quoted.memory.budget_bytes(1000) == 800
    assert load_schedule({"memory": {"budget": " 1 "}, "triggers": [{"kind": "fit_start"}]}).memory.budget == 1.0
    sized = load_schedule({"memory": {"budget": "512MiB"}, "triggers": [{"kind": "fit_start"}]})
    assert sized.memory.budget_bytes(None) == 512 * 2**20


def test_loss_items_with_sum_is_refused_and_with_token_mean_accepted() -> None:
    oom = {"kind": "oom", "loss_reduction": "sum", "loss_items": "labels"}
    with pytest.raises(ScheduleError, match=r"triggers\[0\]\.loss_items: .*loss_reduction is 'sum', which"):
        load_schedule({"triggers": [oom]})
    accepted = load_schedule({"triggers": [{**oom, "loss_reduction": "token_mean"}]})
    assert accepted.triggers[0].kind == "oom"


def test_dotted_paths_that_resolve_are_accepted() -> None:
    schedule = load_schedule(
        {
            "search": {"sample_size": "tests.helpers.varlen:token_count"},
            "triggers": [
                {
                    "kind": "oom",
                    "loss_reduction": "token_mean",
                    "loss_items": "tests.helpers.token_tasks.labelled_tokens",
                }
            ],
        }
    )
    assert schedule.search.sample_size == "tests.helpers.varlen:token_count"


def test_a_module_that_raises_on_import_is_reported_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_sizes_28.py").write_text("raise RuntimeError('needs a GPU')\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ScheduleError) as info:
        load_schedule({"search": {"sample_size": "broken_sizes_28.tokens"}, "triggers": [{"kind": "fit_start"}]})
    assert str(info.value) == (
        "<dict>: search.sample_size: importing module 'broken_sizes_28' of 'broken_sizes_28.tokens' raised "
        "RuntimeError: needs a GPU"
    )
