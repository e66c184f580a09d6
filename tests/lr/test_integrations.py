"""ScheduledLRFinder with finetuning-scheduler phases, Flash strategies and LightningCLI.

Each test skips where its library is not installed: finetuning-scheduler and LightningCLI on the main
stack (Lightning 2.6), Flash on the flash stack (pytorch-lightning 1.9.5).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from retune import ScheduledBatchSizeFinder, ScheduledLRFinder
from tests.helpers.lightning_ns import NAMESPACE, pl
from tests.helpers.oracle import FineTuneModel

ROOT = Path(__file__).resolve().parents[2]
LR_FIND = {"steps": 30, "skip_begin": 3, "min_lr": 1e-5, "max_lr": 10.0}

pytestmark = [
    pytest.mark.filterwarnings("ignore:Final phase max_transition_epoch"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.mark.skipif(
    importlib.util.find_spec("finetuning_scheduler") is None or NAMESPACE != "lightning.pytorch",
    reason="finetuning-scheduler builds on lightning.pytorch and is installed in the main stack only",
)
def test_each_fts_phase_tests_only_its_new_groups(tmp_path: Path) -> None:
    from finetuning_scheduler import FinetuningScheduler

    pl.seed_everything(0)
    schedule = {"triggers": [{"kind": "fit_start"}, {"kind": "fts_phase"}], "lr_find": LR_FIND}
    finder = ScheduledLRFinder(schedule, verbose=False, write_report=False)
    fts = FinetuningScheduler(
        ft_schedule=str(ROOT / "tests" / "fts" / "epoch_driven.yaml"), epoch_transitions_only=True
    )
    model = FineTuneModel(batch_size=32, n=256)
    trainer = pl.Trainer(
        max_epochs=5,
        callbacks=[finder, fts],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        default_root_dir=tmp_path,
    )
    trainer.fit(model)
    assert [(e.epoch, e.trigger) for e in finder.history] == [(0, "fit_start"), (2, "fts_phase"), (4, "fts_phase")]
    assert [e.groups for e in finder.history] == [[0], [1], [2]]  # FTS adds each phase's params as a new group
    groups = trainer.optimizers[0].param_groups
    assert len(groups) == 3
    assert groups[2]["lr"] == finder.history[2].lr_after
    assert finder.history[1].lrs_before == [0.01]  # the phase's configured lr, replaced by the test's
    assert all(e.lr_after is not None for e in finder.history)


@pytest.mark.skipif(importlib.util.find_spec("flash") is None, reason="lightning-flash is in the flash stack only")
def test_flash_freeze_unfreeze_with_both_finders() -> None:
    import flash
    import numpy as np
    from flash.template.classification import TemplateSKLearnClassifier
    from flash.template.classification.data import TemplateData

    pl.seed_everything(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 16)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    dm = TemplateData.from_numpy(train_data=x, train_targets=y, batch_size=8)
    backbone = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU())
    model = TemplateSKLearnClassifier(num_features=16, num_classes=2, backbone=(backbone, 32), learning_rate=1e-3)
    schedule = {
        "triggers": [{"kind": "fit_start"}, {"kind": "param_groups_changed"}],
        "lr_find": LR_FIND,
        "search": {"max_val": 64},
    }
    lr_finder = ScheduledLRFinder(schedule, verbose=False, write_report=False)
    bs_finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    trainer = flash.Trainer(
        max_epochs=2,
        callbacks=[lr_finder, bs_finder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.finetune(model, datamodule=dm, strategy=("freeze_unfreeze", 1))
    assert [(e.epoch, e.groups) for e in lr_finder.history] == [(0, [0]), (1, [0])]  # Flash extends group 0
    assert trainer.optimizers[0].param_groups[0]["lr"] == lr_finder.history[1].lr_after
    assert [e.batch_size for e in lr_finder.history] == [e.batch_size_after for e in bs_finder.history]


@pytest.mark.skipif(NAMESPACE != "lightning.pytorch", reason="the example config is for Lightning 2.x's LightningCLI")
@pytest.mark.filterwarnings("ignore:.*deprecated in v4\\.49:DeprecationWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning:lightning.pytorch.cli")
def test_lightning_cli_config_with_both_finders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("lightning_cli_example", ROOT / "examples" / "lightning_cli.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.chdir(ROOT)
    cli = example.cli_main(
        [
            "fit",
            "--config",
            str(ROOT / "examples" / "lightning_cli_lr.yaml"),
            "--trainer.max_epochs=3",
            "--trainer.enable_progress_bar=false",
            "--data.samples=256",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    lr_finders = [cb for cb in cli.trainer.callbacks if isinstance(cb, ScheduledLRFinder)]
    bs_finders = [cb for cb in cli.trainer.callbacks if isinstance(cb, ScheduledBatchSizeFinder)]
    assert len(lr_finders) == len(bs_finders) == 1
    assert cli.trainer.callbacks[-2:] == [bs_finders[0], lr_finders[0]]
    assert [e.epoch for e in lr_finders[0].history] == [e.epoch for e in bs_finders[0].history] == [0, 2]
    assert lr_finders[0].history[1].groups == [1]
