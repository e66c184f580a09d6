"""Triggers as pure logic over ``TrainingView``: when each fires, which direction, state round trips, merging."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest

from retune import Trigger, load_schedule
from retune.events import Direction
from retune.schedule.triggers import (
    EpochMilestones,
    Firing,
    FitStart,
    ParamGroupsChanged,
    TrainableParamsChanged,
    TrainingView,
    build_triggers,
    evaluate,
)

BACKBONE = frozenset({"backbone.0.weight", "backbone.0.bias", "backbone.1.weight"})
HEAD = frozenset({"head.weight", "head.bias"})


def view(
    epoch: int = 0,
    *,
    global_step: int = 0,
    fit_starting: bool = False,
    trainable_params: int = 1000,
    param_groups: tuple[frozenset[str], ...] = (HEAD,),
) -> TrainingView:
    return TrainingView(epoch, global_step, fit_starting, trainable_params, param_groups)


def fired_epochs(trigger: Trigger, epochs: range) -> list[int]:
    return [e for e in epochs if trigger.check(view(e)) is not None]


# --- FitStart --------------------------------------------------------------------------------------


def test_fit_start_fires_only_when_fit_starting() -> None:
    trigger = FitStart()
    assert trigger.kind == "fit_start"
    assert trigger.check(view(0, fit_starting=True)) == "unknown"
    assert trigger.check(view(0, fit_starting=False)) is None
    assert trigger.check(view(3, fit_starting=False)) is None
    # stateless: it fires again whenever asked at a fit start
    assert trigger.check(view(0, fit_starting=True)) == "unknown"


# --- EpochMilestones -------------------------------------------------------------------------------


def test_epoch_at_fires_at_listed_epochs() -> None:
    trigger = EpochMilestones(at=[5, 10, 0])
    assert trigger.kind == "epoch"
    assert fired_epochs(trigger, range(20)) == [0, 5, 10]


def test_epoch_at_answers_unknown() -> None:
    trigger = EpochMilestones(at=[2])
    assert [trigger.check(view(e)) for e in range(4)] == [None, None, "unknown", None]


@pytest.mark.parametrize("every", [1, 2, 3, 5, 7])
def test_epoch_every_fires_at_multiples_not_zero(every: int) -> None:
    trigger = EpochMilestones(every=every)
    assert fired_epochs(trigger, range(40)) == [e for e in range(1, 40) if e % every == 0]


def test_epoch_every_fires_when_starting_mid_run() -> None:
    trigger = EpochMilestones(every=5)
    assert fired_epochs(trigger, range(10, 21)) == [10, 15, 20]


def test_epoch_already_seen_does_not_fire_again() -> None:
    trigger = EpochMilestones(at=[5])
    assert trigger.check(view(5)) == "unknown"
    assert trigger.check(view(5)) is None  # the same epoch start checked again (resumed mid-epoch)
    assert trigger.check(view(4)) is None  # an earlier epoch is never new
    every = EpochMilestones(every=2)
    assert every.check(view(2)) == "unknown"
    assert every.check(view(2)) is None


def test_epoch_skipped_milestone_is_not_caught_up() -> None:
    # Only the epoch being started counts: jumping over a milestone does not fire it later.
    trigger = EpochMilestones(at=[5])
    assert trigger.check(view(4)) is None
    assert trigger.check(view(6)) is None


def test_epoch_state_round_trip_resumed_run() -> None:
    trigger = EpochMilestones(every=5)
    assert fired_epochs(trigger, range(6)) == [5]
    state = trigger.state_dict()
    assert state == {"last_epoch": 5}
    json.dumps(state)

    resumed = EpochMilestones(every=5)
    resumed.load_state_dict(copy.deepcopy(state))
    assert resumed.last_epoch == 5
    assert resumed.check(view(5)) is None  # resumed inside epoch 5: already searched there
    assert fired_epochs(resumed, range(6, 11)) == [10]

    fresh = EpochMilestones(every=5)
    fresh.load_state_dict({})
    assert fresh.last_epoch is None
    assert fresh.check(view(5)) == "unknown"


def test_epoch_state_dict_before_first_check() -> None:
    trigger = EpochMilestones(at=[0])
    assert trigger.state_dict() == {"last_epoch": None}
    other = EpochMilestones(at=[0])
    other.load_state_dict(trigger.state_dict())
    assert other.check(view(0)) == "unknown"


@pytest.mark.parametrize("kwargs", [{}, {"at": [1], "every": 2}])
def test_epoch_needs_exactly_one_of_at_every(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        EpochMilestones(**kwargs)  # type: ignore[arg-type]


# --- ParamGroupsChanged ----------------------------------------------------------------------------


def test_param_groups_no_fire_on_first_observation() -> None:
    trigger = ParamGroupsChanged()
    assert trigger.kind == "param_groups_changed"
    assert trigger.check(view(param_groups=(HEAD,))) is None
    assert trigger.check(view(1, param_groups=(HEAD,))) is None


def test_param_groups_flash_extends_group_zero() -> None:
    # Flash unfreezes by adding the backbone's parameters to param_groups[0]: one group before and after.
    trigger = ParamGroupsChanged()
    trigger.check(view(0, param_groups=(HEAD,)))
    assert trigger.check(view(1, param_groups=(HEAD | BACKBONE,))) == "down"
    assert trigger.check(view(2, param_groups=(HEAD | BACKBONE,))) is None


def test_param_groups_new_group_added_is_down() -> None:
    trigger = ParamGroupsChanged()
    trigger.check(view(0, param_groups=(HEAD, frozenset())))
    assert trigger.check(view(1, param_groups=(HEAD, BACKBONE))) == "down"


def test_param_groups_fewer_params_is_up() -> None:
    trigger = ParamGroupsChanged()
    trigger.check(view(0, param_groups=(HEAD | BACKBONE,)))
    assert trigger.check(view(1, param_groups=(HEAD,))) == "up"


def test_param_groups_same_count_different_names_is_unknown() -> None:
    trigger = ParamGroupsChanged()
    trigger.check(view(0, param_groups=(frozenset({"a", "b"}),)))
    assert trigger.check(view(1, param_groups=(frozenset({"a", "c"}),))) == "unknown"


def test_param_groups_second_optimizer_changes() -> None:
    trigger = ParamGroupsChanged()
    trigger.check(view(0, param_groups=(HEAD, frozenset({"d.weight"}))))
    assert trigger.check(view(1, param_groups=(HEAD, frozenset({"d.weight", "d.bias"})))) == "down"


def test_param_groups_state_round_trip() -> None:
    trigger = ParamGroupsChanged()
    assert trigger.state_dict() == {"baseline": None}
    trigger.check(view(0, param_groups=(HEAD, BACKBONE)))
    state = trigger.state_dict()
    assert state == {"baseline": [sorted(HEAD), sorted(BACKBONE)]}
    state = json.loads(json.dumps(state))  # checkpoint-safe

    resumed = ParamGroupsChanged()
    resumed.load_state_dict(state)
    assert resumed.baseline == (HEAD, BACKBONE)
    assert resumed.check(view(1, param_groups=(HEAD, BACKBONE))) is None
    assert resumed.check(view(2, param_groups=(HEAD,))) == "up"

    empty = ParamGroupsChanged()
    empty.load_state_dict({"baseline": None})
    assert empty.check(view(0, param_groups=(HEAD,))) is None


# --- TrainableParamsChanged ------------------------------------------------------------------------


def test_trainable_params_direction_and_first_observation() -> None:
    trigger = TrainableParamsChanged()
    assert trigger.kind == "trainable_params_changed"
    assert trigger.check(view(0, trainable_params=1000)) is None
    assert trigger.check(view(1, trainable_params=1000)) is None
    assert trigger.check(view(2, trainable_params=5000)) == "down"  # unfrozen: a step costs more
    assert trigger.check(view(3, trainable_params=5000)) is None
    assert trigger.check(view(4, trainable_params=1000)) == "up"  # frozen again


def test_trainable_params_min_fraction() -> None:
    trigger = TrainableParamsChanged(min_fraction=0.1)
    trigger.check(view(0, trainable_params=1000))
    assert trigger.check(view(1, trainable_params=1050)) is None  # +5%
    assert trigger.check(view(2, trainable_params=950)) is None  # -5%
    assert trigger.check(view(3, trainable_params=1200)) == "down"  # +20%
    # the baseline moved to 1200
    assert trigger.check(view(4, trainable_params=1260)) is None  # +5% of 1200
    assert trigger.check(view(5, trainable_params=960)) == "up"  # -20% of 1200


def test_trainable_params_small_changes_compare_with_last_firing() -> None:
    # Below-threshold changes leave the baseline alone, so creeping changes add up and eventually fire.
    trigger = TrainableParamsChanged(min_fraction=0.1)
    trigger.check(view(0, trainable_params=1000))
    assert trigger.check(view(1, trainable_params=1060)) is None
    assert trigger.check(view(2, trainable_params=1120)) == "down"


def test_trainable_params_exact_threshold_does_not_fire() -> None:
    trigger = TrainableParamsChanged(min_fraction=0.5)
    trigger.check(view(0, trainable_params=1000))
    assert trigger.check(view(1, trainable_params=1500)) is None  # exactly 50%: "more than" is required
    assert trigger.check(view(2, trainable_params=1501)) == "down"


def test_trainable_params_from_zero() -> None:
    trigger = TrainableParamsChanged(min_fraction=0.1)
    trigger.check(view(0, trainable_params=0))
    assert trigger.check(view(1, trainable_params=10)) == "down"


def test_trainable_params_state_round_trip() -> None:
    trigger = TrainableParamsChanged(min_fraction=0.1)
    assert trigger.state_dict() == {"baseline": None}
    trigger.check(view(0, trainable_params=1000))
    state = json.loads(json.dumps(trigger.state_dict()))
    assert state == {"baseline": 1000}

    resumed = TrainableParamsChanged(min_fraction=0.1)
    resumed.load_state_dict(state)
    assert resumed.check(view(1, trainable_params=1000)) is None  # no fire: same as the checkpointed run
    assert resumed.check(view(2, trainable_params=1050)) is None
    assert resumed.check(view(3, trainable_params=3000)) == "down"


# --- build_triggers --------------------------------------------------------------------------------


def test_build_triggers_from_loaded_schedule() -> None:
    schedule = load_schedule(
        {
            "triggers": [
                {"kind": "fit_start"},
                {"kind": "epoch", "at": [5, 10]},
                {"kind": "epoch", "every": 3},
                {"kind": "param_groups_changed"},
                {"kind": "trainable_params_changed", "min_fraction": 0.25},
            ]
        }
    )
    triggers = build_triggers(schedule.triggers)
    assert [type(t) for t in triggers] == [
        FitStart,
        EpochMilestones,
        EpochMilestones,
        ParamGroupsChanged,
        TrainableParamsChanged,
    ]
    assert [t.kind for t in triggers] == [
        "fit_start",
        "epoch",
        "epoch",
        "param_groups_changed",
        "trainable_params_changed",
    ]
    at, every = triggers[1], triggers[2]
    assert isinstance(at, EpochMilestones) and isinstance(every, EpochMilestones)
    assert at.at == frozenset({5, 10}) and at.every is None
    assert every.every == 3 and every.at is None
    last = triggers[4]
    assert isinstance(last, TrainableParamsChanged) and last.min_fraction == 0.25
    assert all(isinstance(t, Trigger) for t in triggers)


def test_build_triggers_from_shipped_schedule_file() -> None:
    schedule = load_schedule(Path(__file__).resolve().parents[2] / "schedules" / "unfreeze_milestones.yaml")
    triggers = build_triggers(schedule.triggers)
    assert [t.kind for t in triggers] == ["fit_start", "epoch", "param_groups_changed"]
    fired = [e for e in range(12) if evaluate(triggers, view(e, fit_starting=e == 0)) is not None]
    assert fired == [0, 5, 10]


def test_build_triggers_instances_are_independent() -> None:
    schedule = load_schedule({"triggers": [{"kind": "epoch", "every": 2}]})
    first, second = build_triggers(schedule.triggers)[0], build_triggers(schedule.triggers)[0]
    assert first.check(view(2)) == "unknown"
    assert second.check(view(2)) == "unknown"


# --- evaluate --------------------------------------------------------------------------------------


class Always:
    """A custom trigger answering a fixed direction (implements the Trigger protocol)."""

    def __init__(self, kind: str, answer: Direction | None) -> None:
        self.kind = kind
        self.answer = answer
        self.calls = 0

    def check(self, view: TrainingView) -> Direction | None:
        self.calls += 1
        return self.answer


def test_evaluate_nothing_fires() -> None:
    assert evaluate([], view()) is None
    assert evaluate([Always("a", None), Always("b", None)], view()) is None


def test_evaluate_single() -> None:
    firing = evaluate([Always("a", None), Always("b", "up")], view())
    assert firing == Firing(("b",), "up")
    assert firing.label == "b"


@pytest.mark.parametrize(
    ("answers", "direction"),
    [
        (["unknown", "unknown"], "unknown"),
        (["down", "unknown"], "down"),
        (["unknown", "down"], "down"),
        (["up", "unknown"], "up"),
        (["down", "down"], "down"),
        (["down", "up"], "unknown"),
        (["up", "down", "unknown"], "unknown"),
        (["down", None, "unknown"], "down"),
    ],
)
def test_evaluate_merges_directions(answers: list[Direction | None], direction: Direction) -> None:
    triggers = [Always(f"k{i}", answer) for i, answer in enumerate(answers)]
    firing = evaluate(triggers, view())
    assert firing is not None
    assert firing.direction == direction
    assert firing.kinds == tuple(f"k{i}" for i, a in enumerate(answers) if a is not None)


def test_evaluate_label_joins_kinds_in_order_without_repeats() -> None:
    triggers = [Always("epoch", "unknown"), Always("trainable_params_changed", "down"), Always("epoch", "unknown")]
    firing = evaluate(triggers, view())
    assert firing is not None
    assert firing.kinds == ("epoch", "trainable_params_changed")
    assert firing.label == "epoch+trainable_params_changed"


def test_evaluate_asks_every_trigger_even_after_one_fired() -> None:
    triggers = [Always("a", "down"), Always("b", None), Always("c", "up")]
    evaluate(triggers, view())
    assert [t.calls for t in triggers] == [1, 1, 1]


def test_evaluate_real_triggers_unfreeze_epoch() -> None:
    # The freeze -> unfreeze story: fit start searches cold, the unfreeze epoch merges two triggers.
    triggers = [FitStart(), EpochMilestones(at=[5]), TrainableParamsChanged(), ParamGroupsChanged()]
    firings = {}
    for epoch in range(8):
        unfrozen = epoch >= 5
        v = view(
            epoch,
            fit_starting=epoch == 0,
            trainable_params=5000 if unfrozen else 1000,
            param_groups=(HEAD | BACKBONE,) if unfrozen else (HEAD,),
        )
        firing = evaluate(triggers, v)
        if firing is not None:
            firings[epoch] = firing
    assert firings == {
        0: Firing(("fit_start",), "unknown"),
        5: Firing(("epoch", "trainable_params_changed", "param_groups_changed"), "down"),
    }
    assert firings[5].label == "epoch+trainable_params_changed+param_groups_changed"


# --- custom triggers -------------------------------------------------------------------------------


class EveryThousandSteps:
    """The custom trigger from the module docstring."""

    kind = "every_1000_steps"

    def __init__(self) -> None:
        self.last = 0

    def check(self, view: TrainingView) -> Direction | None:
        if view.global_step - self.last >= 1000:
            self.last = view.global_step
            return "unknown"
        return None


def test_custom_trigger_satisfies_protocol() -> None:
    assert isinstance(EveryThousandSteps(), Trigger)
    for builtin in (FitStart(), EpochMilestones(every=1), ParamGroupsChanged(), TrainableParamsChanged()):
        assert isinstance(builtin, Trigger)


def test_non_triggers_fail_protocol_check() -> None:
    class NoKind:
        def check(self, view: TrainingView) -> Direction | None:
            return None

    class NoCheck:
        kind = "x"

    assert not isinstance(NoKind(), Trigger)
    assert not isinstance(NoCheck(), Trigger)
    assert not isinstance(object(), Trigger)


def test_custom_trigger_with_evaluate() -> None:
    custom = EveryThousandSteps()
    triggers: list[Trigger] = [custom, TrainableParamsChanged()]
    steps = [0, 400, 1000, 1500, 2100, 2200]
    labels = []
    for epoch, step in enumerate(steps):
        firing = evaluate(triggers, view(epoch, global_step=step, trainable_params=1000 if step < 2000 else 3000))
        labels.append(None if firing is None else (firing.label, firing.direction))
    assert labels == [
        None,
        None,
        ("every_1000_steps", "unknown"),
        None,
        ("every_1000_steps+trainable_params_changed", "down"),
        None,
    ]


def test_training_view_is_frozen() -> None:
    v = view()
    with pytest.raises(AttributeError):
        v.epoch = 3  # type: ignore[misc]
    assert replace(v, epoch=3).epoch == 3
