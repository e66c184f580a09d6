"""The finder's own outputs: logged metrics, the table at fit end, history files and plot in the log folder."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from matplotlib.image import imread

import retune
from retune.reports import batch_size as report
from tests.helpers.lightning_ns import callbacks, pl
from tests.helpers.oracle import FineTuneModel

SCHEDULE = {
    "search": {"init_val": 64, "steps_per_trial": 1},
    "triggers": [{"kind": "fit_start"}, {"kind": "trainable_params_changed"}],
}


def _fit(tmp_path: Path, **finder_args: object) -> tuple[retune.ScheduledBatchSizeFinder, pl.Trainer]:
    pl.seed_everything(0)
    model = FineTuneModel(batch_size=8, head_only_optimizer=True, n=512)
    finder = retune.ScheduledBatchSizeFinder(SCHEDULE, **finder_args)  # type: ignore[arg-type]
    trainer = pl.Trainer(
        max_epochs=3,
        callbacks=[callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1), finder],
        logger=pl.loggers.CSVLogger(save_dir=tmp_path, name="csv", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=1,
    )
    trainer.fit(model)
    return finder, trainer


def test_metrics_table_and_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    finder, trainer = _fit(tmp_path)
    assert [e.trigger for e in finder.history] == ["fit_start", "trainable_params_changed"]

    with open(Path(trainer.logger.log_dir) / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("retune/batch_size")]
    assert [(int(r["step"]), float(r["retune/batch_size"])) for r in rows] == [
        (e.global_step, float(e.batch_size_after)) for e in finder.history
    ]
    assert [float(r["retune/trials"]) for r in rows] == [float(len(e.trials)) for e in finder.history]
    assert all(float(r["retune/search_seconds"]) > 0 for r in rows)

    err = capsys.readouterr().err
    assert "[retune]   trial 1 batch_size=64: " in err
    assert report.format_table(finder.history) in err

    out = Path(trainer.logger.log_dir) / "retune"
    assert finder.report_paths is not None and finder.report_paths.json == out / "history.json"
    assert report.read_history(out / "history.json").events == finder.history
    assert report.read_history(out / "history.json").end_step == trainer.global_step
    assert (out / "history.csv").exists()
    assert imread(out / "batch_size.png").shape[:2] == report.PLOT_SIZE_PX[::-1]


def test_out_dir_and_opt_out(tmp_path: Path) -> None:
    finder, _ = _fit(tmp_path / "a", out_dir=tmp_path / "mine", verbose=False)
    assert (tmp_path / "mine" / "history.json").exists()
    finder, trainer = _fit(tmp_path / "b", write_report=False, verbose=False)
    assert finder.report_paths is None
    assert not (Path(trainer.log_dir) / "retune").exists()
