"""One contract, run over both callbacks (``ScheduledBatchSizeFinder`` and ``ScheduledLRFinder``).

What every retune callback owes a Lightning user, whatever it searches:

* its checkpoint state is plain data (it loads with ``torch.load(weights_only=True)``) and survives a
  round trip through a real checkpoint: a fresh callback that loads it saves the same state;
* it pickles before and after a fit (``ddp_spawn`` pickles the trainer and its callbacks);
* under ``fast_dev_run`` it searches nothing, says so once, and the run finishes;
* only rank zero speaks: on another rank it prints nothing and issues no warning, and writes no report.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from retune import ScheduledBatchSizeFinder, ScheduledLRFinder
from tests.helpers.lightning_ns import PRECISION_32, pl, seed
from tests.helpers.oracle import FineTuneModel
from tests.helpers.retune_warnings import retune_warnings

pytestmark = pytest.mark.timeout(120)

SCHEDULE: dict[str, Any] = {"triggers": [{"kind": "fit_start"}], "search": {"init_val": 16, "max_trials": 12}}
LR_SCHEDULE: dict[str, Any] = {"triggers": [{"kind": "fit_start"}], "lr_find": {"steps": 20}}


def _bs_finder(**kw: Any) -> Any:
    return ScheduledBatchSizeFinder(SCHEDULE, **kw)


def _lr_finder(**kw: Any) -> Any:
    return ScheduledLRFinder(LR_SCHEDULE, **kw)


CALLBACKS: dict[str, Callable[..., Any]] = {"batch_size_finder": _bs_finder, "lr_finder": _lr_finder}


def _fit(callback: Any, tmp_path: Path, **kwargs: Any) -> Any:
    seed(3)
    model = FineTuneModel(batch_size=16, n=256)
    trainer = pl.Trainer(
        max_epochs=kwargs.pop("max_epochs", 1),
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        precision=PRECISION_32,
        default_root_dir=tmp_path,
        **kwargs,
    )
    trainer.fit(model)
    return trainer


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


@pytest.mark.parametrize("kind", sorted(CALLBACKS))
def test_checkpoint_state_is_plain_data_and_round_trips(kind: str, tmp_path: Path) -> None:
    callback = CALLBACKS[kind](verbose=False)
    trainer = _fit(callback, tmp_path)
    assert callback.history, "the fit_start search ran"
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)  # plain data only: no pickled retune classes
    saved = checkpoint["callbacks"][callback.state_key]
    assert _plain(saved), saved
    fresh = CALLBACKS[kind](verbose=False)
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == callback.state_dict()
    assert fresh.history == callback.history


@pytest.mark.parametrize("kind", sorted(CALLBACKS))
def test_pickles_before_and_after_a_fit(kind: str, tmp_path: Path) -> None:
    callback = CALLBACKS[kind](verbose=False)
    before = pickle.loads(pickle.dumps(callback))
    assert before.state_dict() == callback.state_dict()
    _fit(callback, tmp_path)
    after = pickle.loads(pickle.dumps(callback))
    assert after.state_dict() == callback.state_dict()


@pytest.mark.parametrize("kind", sorted(CALLBACKS))
def test_fast_dev_run_searches_nothing_and_says_so_once(kind: str, tmp_path: Path) -> None:
    callback = CALLBACKS[kind](verbose=False)
    with retune_warnings() as said:
        trainer = _fit(callback, tmp_path, fast_dev_run=True)
    assert trainer.state.finished
    assert callback.history == []
    assert sum("fast_dev_run" in message for message in said) == 1, said


@pytest.mark.parametrize("kind", sorted(CALLBACKS))
@pytest.mark.parametrize("rank_zero", [True, False])
def test_only_rank_zero_speaks(
    kind: str, rank_zero: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same verbose run with a search: rank zero prints and writes its report; another rank does neither."""
    if not rank_zero:
        monkeypatch.setattr(pl.Trainer, "is_global_zero", property(lambda self: False))
    reports = tmp_path / "reports"
    callback = CALLBACKS[kind](verbose=True, out_dir=reports)
    with retune_warnings() as said:
        _fit(callback, tmp_path, limit_train_batches=4)
    spoken = capsys.readouterr()
    assert callback.history, "the search ran on every rank"
    written = sorted(p.name for p in reports.iterdir()) if reports.exists() else []
    if rank_zero:
        assert "[retune]" in spoken.out + spoken.err
        assert written, "rank zero writes the report"
    else:
        assert said == [] and "[retune]" not in spoken.out + spoken.err
        assert written == []
