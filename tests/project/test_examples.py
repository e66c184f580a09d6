"""Smoke tests: each example in examples/ runs on small data and re-tunes where it should.

The examples are scripts, not a package, so they are loaded from their files. The Flash and
finetuning-scheduler examples have their own tests (tests/integrations/test_flash.py, tests/integrations/test_fts.py).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

import retune
from retune.reports import batch_size as report

# skip guards: the examples import lightning.pytorch, and write their PNG plots with matplotlib
pytest.importorskip("lightning.pytorch", reason="the examples use the `lightning` package, which is not installed")
pytest.importorskip("matplotlib", reason="the examples' plots need matplotlib, which is not installed")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"retune_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and jsonargparse look classes up by module
    spec.loader.exec_module(module)
    return module


def test_plain_backbone_finetuning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = _load("plain_backbone_finetuning")
    out = tmp_path / "out"
    result = example.main(
        ["--epochs", "2", "--unfreeze-at", "1", "--samples", "256", "--budget", "800KiB", "--out", str(out), "--quiet"]
    )
    frozen, unfrozen = result.history
    assert (frozen.trigger, unfrozen.trigger) == ("fit_start", "trainable_params_changed")
    assert unfrozen.epoch == 1 and unfrozen.direction == "down"
    # with the budget, unfreezing the backbone must lower the size
    assert unfrozen.batch_size_after < frozen.batch_size_after
    assert result.batch_size == unfrozen.batch_size_after
    assert 0.0 <= result.val_acc <= 1.0
    assert result.outputs.png is not None and result.outputs.png.exists()
    assert report.read_history(result.outputs.json).events == result.history
    assert report.format_table(result.history) in capsys.readouterr().out


# LightningCLI 2.6 calls jsonargparse APIs that jsonargparse 4.49+ deprecates: not ours to fix
@pytest.mark.filterwarnings("ignore:.*deprecated in v4\\.49:DeprecationWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning:lightning.pytorch.cli")
def test_lightning_cli_config_sets_the_finder_and_its_schedule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = EXAMPLES / "lightning_cli.yaml"
    callbacks = yaml.safe_load(config.read_text())["trainer"]["callbacks"]
    assert callbacks[1] == {
        "class_path": "retune.ScheduledBatchSizeFinder",
        "init_args": {"schedule": "schedules/freeze_unfreeze.yaml"},
    }
    unfreeze_at = callbacks[0]["init_args"]["unfreeze_backbone_at_epoch"]

    monkeypatch.chdir(ROOT)  # the config's schedule path is relative to where the command runs
    example = _load("lightning_cli")
    cli = example.cli_main(
        [
            "fit",
            "--config",
            str(config),
            f"--trainer.max_epochs={unfreeze_at + 1}",
            "--trainer.enable_progress_bar=false",
            "--data.samples=256",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    finders = [cb for cb in cli.trainer.callbacks if isinstance(cb, retune.ScheduledBatchSizeFinder)]
    assert len(finders) == 1
    finder = finders[0]
    assert finder.schedule == retune.load_schedule(ROOT / "schedules" / "freeze_unfreeze.yaml")
    assert cli.trainer.callbacks[-1] is finder  # it runs after BackboneFinetuning
    assert [e.trigger for e in finder.history] == ["fit_start", "trainable_params_changed"]
    assert finder.history[1].epoch == unfreeze_at
    assert cli.datamodule.batch_size == finder.batch_size
    assert cli.trainer.current_epoch == unfreeze_at + 1
    assert (tmp_path / "config.yaml").exists()  # LightningCLI saved the resolved config there, not in the repo
