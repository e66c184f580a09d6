"""``retune.callbacks.base``: what both callbacks share reads each one's events through its report module.

The base prints an event's summary, logs its metrics and prints the table at fit end through the
callback's ``_report`` (an ``EventReport``); both report modules take the same ``where`` a recovered step's
or a search's line starts with, so one ``_record`` serves both callbacks.
"""

from __future__ import annotations

import inspect

from retune import ScheduledBatchSizeFinder, ScheduledLRFinder
from retune.callbacks.base import EventReport
from retune.lr.events import LRFindEvent
from retune.reports import batch_size, lr


def _lr_event() -> LRFindEvent:
    return LRFindEvent(
        epoch=3, global_step=30, trigger="unfreeze", groups=[1], lrs_before=[0.1], lr_after=0.01, method="min_div10"
    )


def test_each_callback_reads_its_events_through_its_report_module() -> None:
    assert ScheduledBatchSizeFinder._report is batch_size
    assert ScheduledLRFinder._report is lr
    members = [name for name in vars(EventReport) if not name.startswith("_")]
    assert sorted(members) == ["event_metrics", "format_summary", "format_table"]
    for module in (batch_size, lr):
        for name in members:
            ours = list(inspect.signature(getattr(EventReport, name)).parameters)[1:]  # without self
            assert list(inspect.signature(getattr(module, name)).parameters) == ours, (module.__name__, name)


def test_the_range_tests_summary_starts_where_it_is_told() -> None:
    event = _lr_event()
    assert lr.format_summary(event).startswith("epoch 3: param groups [1] lr 0.1 -> 0.01")
    assert lr.format_summary(event, "fit start").startswith("fit start: param groups [1]")
    assert lr.event_metrics(event)["retune/lr_group1"] == 0.01
    assert "1 learning-rate range test" in lr.format_table([event])
