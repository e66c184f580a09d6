"""`retune demo`: the simulated device, the budget's sources, and one short run end to end.

The run uses 2 pretraining epochs, 2 fine-tuning epochs (unfreeze at 1) and 200 training images
per task. The simulated device makes the answer exact: the searches must land within the binsearch
margin of its true maxima for the frozen and the unfrozen backbone.

The checks of bad options and files need neither scikit-learn nor a run, so they run on every
stack (the Flash stack has no scikit-learn): the demo refuses them before it loads any data.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from retune import ScheduleError, is_oom_error, load_schedule
from retune import demo as demo_module
from retune.cli import main
from retune.demo import (
    BUILTIN_SCHEDULE,
    DEFAULT_BUDGET,
    FEATURES,
    SCHEDULE_FILE,
    DemoConfig,
    DemoResult,
    SimulatedDevice,
    load_digit_splits,
    make_backbone,
    resolve_schedule,
    run_demo,
)
from retune.reports import batch_size as report

# the demo reads sklearn's digits (not in the flash stack): only the tests that load them need it
needs_sklearn = pytest.mark.skipif(
    importlib.util.find_spec("sklearn") is None,
    reason="the demo's data set is sklearn's digits; scikit-learn is not installed",
)
QUICK = ["--epochs", "1", "--pretrain-epochs", "1", "--limit", "10", "--no-progress-bar"]

MARGIN = 0.05


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoResult:
    pytest.importorskip("sklearn", reason="the demo's data set is sklearn's digits; scikit-learn is not installed")
    out = tmp_path_factory.mktemp("demo")
    lines: list[str] = []
    config = DemoConfig(epochs=2, unfreeze_at=1, pretrain_epochs=2, limit=200, out=out, progress_bar=False)
    return run_demo(config, write=lines.append)


# -- one short run -------------------------------------------------------------------------------


def test_batch_size_changes_at_the_unfreeze(demo: DemoResult) -> None:
    assert [e.trigger for e in demo.history] == ["fit_start", "trainable_params_changed"]
    frozen, unfrozen = demo.history
    assert demo.true_max is not None
    assert demo.true_max["unfrozen"] < demo.true_max["frozen"] / 2, "the budget must make the change visible"
    assert (frozen.epoch, unfrozen.epoch) == (0, 1)
    assert frozen.max_fitting == demo.true_max["frozen"]
    assert unfrozen.max_fitting == demo.true_max["unfrozen"]
    assert frozen.batch_size_after == math.floor(demo.true_max["frozen"] * (1 - MARGIN))
    assert unfrozen.batch_size_after == math.floor(demo.true_max["unfrozen"] * (1 - MARGIN))
    assert unfrozen.direction == "down"
    assert unfrozen.batch_size_before == frozen.batch_size_after


def test_console_story(demo: DemoResult) -> None:
    text = "\n".join(demo.lines)
    assert f"memory budget: {report.format_bytes(demo.budget_bytes)} (the demo's default)" in text
    assert "simulated device" in text
    # the table of searches comes from the callback itself (stderr, above the progress bar), not twice
    assert report.format_table(demo.history) not in text
    assert f"accuracy on digits 5-9 (179 held-out images): {demo.accuracy:.3f}" in text
    assert demo.lines[-1].startswith("finished in ")
    epoch_lines = [line for line in demo.lines if line.startswith("epoch ") and "val accuracy" in line]
    assert [line.split(":")[0] for line in epoch_lines] == ["epoch 0", "epoch 1"]
    assert 0.0 <= demo.accuracy <= 1.0
    assert len(demo.epoch_accuracy) == 2


def test_outputs(demo: DemoResult) -> None:
    imread = pytest.importorskip("matplotlib.image", reason="the demo's plot needs matplotlib, not installed").imread
    assert demo.outputs.png is not None
    history = report.read_history(demo.outputs.json)
    assert history.events == demo.history
    assert history.budget_bytes == demo.budget_bytes
    assert history.memory_label == "simulated step memory"
    assert history.steps is not None and history.memory is not None
    sizes = {size for _, size in history.steps}
    assert sizes == {e.batch_size_after for e in demo.history}
    assert max(m for _, m in history.memory) <= demo.budget_bytes
    assert history.meta["source"] == "retune demo"
    assert history.end_step == history.steps[-1][0] + 1
    assert len(demo.outputs.csv.read_text().splitlines()) == 3
    assert imread(demo.outputs.png).shape[:2] == report.PLOT_SIZE_PX[::-1]
    metrics = next(Path(demo.outputs.json.parent, "logs").glob("version_*/metrics.csv"))
    assert "val_acc" in metrics.read_text().splitlines()[0]
    json.loads(demo.outputs.json.read_text())


# -- the simulated device ------------------------------------------------------------------------


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(make_backbone(), nn.Linear(FEATURES, 5))


def _freeze_backbone(model: nn.Sequential, frozen: bool) -> None:
    for p in model[0].parameters():
        p.requires_grad = not frozen


def test_device_raises_the_real_oom_past_the_budget() -> None:
    model = _model()
    device = SimulatedDevice(model, torch.zeros(1, 1, 8, 8), budget_bytes=2 * 2**20)
    largest = device.largest_batch(model)
    assert largest > 0
    device.check(largest, model)
    with pytest.raises(torch.OutOfMemoryError) as info:
        device.check(largest + 1, model)
    assert is_oom_error(info.value)


def test_unfreezing_costs_per_sample_and_fixed_memory() -> None:
    model = _model()
    device = SimulatedDevice(model, torch.zeros(1, 1, 8, 8), budget_bytes=2 * 2**20)
    _freeze_backbone(model, True)
    frozen = device.estimate(1, model)
    _freeze_backbone(model, False)
    unfrozen = device.estimate(1, model)
    n_params = sum(p.numel() for p in model.parameters())
    assert frozen.weights == unfrozen.weights == 4 * n_params
    # gradient + two Adam moments per trainable float32 parameter
    assert unfrozen.optimizer_state == 3 * 4 * n_params
    assert frozen.optimizer_state == 3 * 4 * sum(p.numel() for p in model[1].parameters())
    assert unfrozen.per_sample > 2 * frozen.per_sample
    # the layer sizes were measured from a real forward pass: conv1 writes 16 x 8 x 8 floats per sample
    first = device.layers[0][0]
    assert (first.in_bytes, first.out_bytes) == (64 * 4, 16 * 64 * 4)
    assert any(fp.out_bytes == 0 for fp, _ in device.layers), "Flatten is a view and costs nothing"


def test_device_that_does_not_enforce_only_estimates() -> None:
    model = _model()
    device = SimulatedDevice(model, torch.zeros(1, 1, 8, 8), budget_bytes=1, enforce=False)
    assert device.check(10_000, model).total > 1


# -- the schedule and its budget -----------------------------------------------------------------


def test_builtin_schedule_is_the_ready_made_file() -> None:
    assert load_schedule(BUILTIN_SCHEDULE) == load_schedule(SCHEDULE_FILE)


def test_budget_sources(tmp_path: Path) -> None:
    schedule, size, name, text = resolve_schedule(None, None)
    assert size == 2 * 2**20 and DEFAULT_BUDGET == "2MiB"
    assert name == "schedules/freeze_unfreeze.yaml"
    assert text == "2.0 MiB (the demo's default)"
    assert schedule.memory.budget is None  # the simulated device enforces it, not retune

    _, size, _, text = resolve_schedule(None, "3MiB")
    assert (size, text) == (3 * 2**20, "3.0 MiB (--budget)")

    own = tmp_path / "s.yaml"
    own.write_text("triggers: [{kind: fit_start}]\nmemory: {budget: 1500KiB}\n")
    schedule, size, name, text = resolve_schedule(own, None)
    assert (size, name, text) == (1500 * 1024, str(own), "1.5 MiB (the schedule's memory.budget)")
    assert resolve_schedule(own, "4MiB")[1] == 4 * 2**20

    schedule, size, _, _ = resolve_schedule(None, "3MiB", memory_mode="measured")
    assert schedule.memory.budget == "3MiB" and size == 3 * 2**20


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        ("lots", "'lots' is not a memory size"),
        ("0.5B", "'0.5B' is less than one byte"),
        ("2 parsecs", "'2 parsecs' is not a memory size"),
        # the rules of memory.budget: a bare number is a fraction (refused on a CPU), never a count of bytes
        ("0.5", "'0.5': the demo runs on a CPU and needs an absolute size such as '2MiB', not a fraction"),
        ("40", "a number budget is a fraction of device memory in (0, 1], got '40'"),
    ],
)
def test_bad_budget(budget: str, message: str) -> None:
    with pytest.raises(ScheduleError) as info:
        resolve_schedule(None, budget)
    assert str(info.value).startswith(f"--budget: {message}")  # the option, not the schedule file


@pytest.mark.parametrize("memory", ["5", "abc", "{budget: 40}", "{budget: '40'}", "{budget: lots}", "{budgit: 2MiB}"])
def test_schedule_is_validated_as_validate_does(
    tmp_path: Path, memory: str, capsys: pytest.CaptureFixture[str]
) -> None:
    own = tmp_path / "s.yaml"
    own.write_text(f"triggers: [{{kind: fit_start}}]\nmemory: {memory}\n")
    assert main(["validate", str(own)]) == 1
    expected = capsys.readouterr().err
    assert expected.startswith(f"error: {own}: memory")
    with pytest.raises(ScheduleError) as info:
        resolve_schedule(own, None)
    assert f"error: {info.value}\n" == expected
    assert main(["demo", "--schedule", str(own), *QUICK, "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr() == ("", expected)
    assert not (tmp_path / "out").exists()


def test_fraction_budget_in_the_schedule_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    own = tmp_path / "s.yaml"
    own.write_text("triggers: [{kind: fit_start}]\nmemory: {budget: 0.5}\n")
    with pytest.raises(ScheduleError, match="absolute size"):
        resolve_schedule(own, None)
    assert main(["demo", "--schedule", str(own), *QUICK, "--out", str(tmp_path / "out")]) == 1
    message = (
        f"{own}: memory.budget: 0.5: the demo runs on a CPU and needs an absolute size such as '2MiB', not a fraction"
    )
    assert capsys.readouterr().err == f"error: {message}\n"  # the file named once


def test_budget_option_overrides_a_fraction_in_the_schedule(tmp_path: Path) -> None:
    own = tmp_path / "s.yaml"
    own.write_text("triggers: [{kind: fit_start}]\nmemory: {budget: '0.5'}\n")
    assert resolve_schedule(own, "3MiB")[1:] == (3 * 2**20, str(own), "3.0 MiB (--budget)")


@needs_sklearn
def test_splits_are_disjoint_tasks() -> None:
    splits = load_digit_splits(seed=0, limit=50)
    assert len(splits.pretrain_train) == len(splits.finetune_train) == 50
    for part in (splits.pretrain_train, splits.pretrain_val, splits.finetune_train, splits.finetune_val):
        x, y = part.tensors
        assert x.shape[1:] == (1, 8, 8)
        assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
        assert set(y.tolist()) <= set(range(5))
    assert len(splits.finetune_val) == 179  # validation is never cut by `limit`


# -- the command line ----------------------------------------------------------------------------


def test_cli_help_states_the_real_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    defaults = DemoConfig()
    assert f"(default: {defaults.epochs})" in text
    assert f"(default: {defaults.unfreeze_at})" in text
    assert f"(default: {defaults.pretrain_epochs})" in text
    assert f"else {DEFAULT_BUDGET})" in text
    assert f"./{defaults.out}" in text
    assert f"(default: {defaults.seed})" in text


def test_cli_bad_budget_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--budget", "lots"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: --budget: 'lots' is not a memory size") and err.count("\n") == 1


@pytest.mark.parametrize("inside", [False, True], ids=["the-file", "below-it"])
def test_cli_out_that_is_a_file(tmp_path: Path, inside: bool, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "taken"
    file.write_text("not a folder")
    out = file / "run" if inside else file
    assert main(["demo", *QUICK, "--out", str(out)]) == 1
    where = f" (in --out {str(out)!r})" if inside else ""
    assert capsys.readouterr() == ("", f"error: --out: {str(file)!r} is a file, not a folder{where}\n")


def test_seed_everything_on_this_lightning() -> None:
    # Lightning 2 takes verbose=; pytorch_lightning 1.9 (the Flash stack) has no such argument
    demo_module._seed_everything(1234)
    assert torch.initial_seed() == 1234


def test_cli_without_scikit_learn_is_a_clean_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # gets as far as loading the data on every stack (on pytorch_lightning 1.9 it once failed to seed first)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # `from sklearn.datasets import ...` fails
    assert main(["demo", *QUICK, "--out", str(tmp_path / "out")]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "error: retune demo needs scikit-learn for its dataset (the digits ship inside it; nothing is "
        "downloaded): pip install scikit-learn\n"
    )


@needs_sklearn
def test_cli_budget_too_small_for_one_image(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *QUICK, "--budget", "1KiB", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "error: memory budget 1.0 KiB (--budget) is too small for the demo: not even a batch of 1 fits once the "
        "backbone is unfrozen, which needs about "
    )
    assert err.count("\n") == 1


def test_cli_rejects_zero_epochs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--epochs", "0"])
    assert "must be at least 1" in capsys.readouterr().err
