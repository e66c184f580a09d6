"""``RetuneEvent`` as a plain record: dict and JSON round trips, trials as ``(batch_size, fits)``."""

from __future__ import annotations

import dataclasses
import json

import pytest

from retune import RetuneEvent, Trial

TRIALS = [Trial(2, True), Trial(4, True), Trial(8, False), Trial(6, True), Trial(7, False)]


def event(**overrides: object) -> RetuneEvent:
    values: dict[str, object] = {
        "epoch": 5,
        "global_step": 1234,
        "trigger": "epoch+trainable_params_changed",
        "stage": "train",
        "batch_size_before": 64,
        "batch_size_after": 6,
        "trials": list(TRIALS),
        "duration_s": 1.25,
        "direction": "down",
        "max_fitting": 6,
        "min_failing": 7,
    }
    values.update(overrides)
    return RetuneEvent(**values)  # type: ignore[arg-type]


def test_to_dict_fields_and_trials_as_pairs() -> None:
    data = event().to_dict()
    assert data == {
        "epoch": 5,
        "global_step": 1234,
        "trigger": "epoch+trainable_params_changed",
        "stage": "train",
        "batch_size_before": 64,
        "batch_size_after": 6,
        "trials": [[2, True], [4, True], [8, False], [6, True], [7, False]],
        "duration_s": 1.25,
        "direction": "down",
        "max_fitting": 6,
        "min_failing": 7,
        "peak_bytes": [],
        "budget_bytes": None,
        "accumulate": 1,
        "effective_batch_size": 0,
        "lr_factor": 1.0,
        "mode": "",
        "note": "",
        "micro_batches": 0,
        "bucket_sizes": [],
        "bucket_sizes_before": [],
        "bucket_bounds": [],
        "bucket_bounds_before": [],
        "bucket_samples": [],
        "trial_buckets": [],
        "samples_per_step": 0.0,
        "bucket_largest": [],
        "reference_bucket": None,
        "padded_per_step": None,
        "prediction": "",
        "predicted_bytes": [],
        "prediction_s": 0.0,
        "objective": "largest",
        "samples_per_s": [],
        "largest": None,
    }
    assert set(data) == {f.name for f in dataclasses.fields(RetuneEvent)}


@pytest.mark.parametrize(
    "original",
    [
        event(),
        event(trials=[], max_fitting=None, min_failing=None, direction="unknown"),
        event(trigger="oom", trials=[], batch_size_after=64, micro_batches=4, note="out of memory in backward"),
        event(direction="cold", trigger="fit_start"),
        RetuneEvent(0, 0, "fit_start", "train", 2, 2),
    ],
)
def test_dict_and_json_round_trip(original: RetuneEvent) -> None:
    assert RetuneEvent.from_dict(original.to_dict()) == original
    text = json.dumps(original.to_dict())
    restored = RetuneEvent.from_dict(json.loads(text))
    assert restored == original
    assert all(isinstance(t, Trial) for t in restored.trials)


def test_from_dict_trials_unpack_as_size_fits_tuples() -> None:
    restored = RetuneEvent.from_dict(json.loads(json.dumps(event().to_dict())))
    assert restored.trials == TRIALS
    for (size, fits), original in zip(restored.trials, TRIALS, strict=True):
        assert (size, fits) == (original.batch_size, original.fits)
        assert type(size) is int and type(fits) is bool
    assert restored.trials[2] == (8, False)
    assert restored.trials[2].batch_size == 8 and restored.trials[2].fits is False


def test_from_dict_accepts_tuples_and_coerces() -> None:
    data = event().to_dict()
    data["trials"] = [(2, 1), ("4", 0)]
    restored = RetuneEvent.from_dict(data)
    assert restored.trials == [Trial(2, True), Trial(4, False)]


def test_from_dict_without_trials_and_defaults() -> None:
    data = {
        "epoch": 1,
        "global_step": 10,
        "trigger": "epoch",
        "stage": "train",
        "batch_size_before": 8,
        "batch_size_after": 16,
    }
    restored = RetuneEvent.from_dict(data)
    assert restored.trials == []
    assert restored.duration_s == 0.0 and restored.direction == "unknown"
    assert restored.max_fitting is None and restored.min_failing is None
    assert data == {  # the input dict is not mutated
        "epoch": 1,
        "global_step": 10,
        "trigger": "epoch",
        "stage": "train",
        "batch_size_before": 8,
        "batch_size_after": 16,
    }


def test_from_dict_does_not_mutate_input() -> None:
    data = event().to_dict()
    snapshot = json.loads(json.dumps(data))
    RetuneEvent.from_dict(data)
    assert data == snapshot


def test_from_dict_rejects_unknown_keys() -> None:
    data = event().to_dict()
    data["surprise"] = 1
    with pytest.raises(TypeError):
        RetuneEvent.from_dict(data)


def test_event_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        event().epoch = 3  # type: ignore[misc]


def test_trial_is_a_named_tuple() -> None:
    trial = Trial(32, True)
    size, fits = trial
    assert (size, fits) == (32, True)
    assert trial == (32, True)
    assert trial._asdict() == {"batch_size": 32, "fits": True}
    assert json.loads(json.dumps(trial)) == [32, True]
