"""What ``ScheduledLRFinder`` leaves behind: ``lr_history.json``, ``lr_history.csv``, a table and ``lr_find.png``.

Plain functions of a list of :class:`~retune.lr.events.LRFindEvent`, without Lightning, so that the
callback and ``retune report lr_history.json`` render the same files from the same data. The file
names differ from the batch-size finder's (``history.json``, ``batch_size.png``), so both callbacks
can write into one folder. matplotlib is imported only to draw, on the Agg canvas.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retune import messages
from retune.lr.events import LRFindEvent
from retune.reports.batch_size import PLOT_DPI, PLOT_SIZE_PX
from retune.reports.files import PathLike, write_csv_rows, write_json_events
from retune.schedule.models import LRFindConfig

KIND = "lr_find"
FORMAT_VERSION = 1
JSON_NAME = "lr_history.json"
CSV_NAME = "lr_history.csv"
PNG_NAME = "lr_find.png"
CSV_FIELDS = (
    "epoch",
    "global_step",
    "trigger",
    "groups",
    "lrs_before",
    "lr_after",
    "method",
    "steps",
    "steps_planned",
    "stopped_early",
    "duration_s",
    "batch_size",
)


@dataclass(frozen=True)
class LROutputPaths:
    json: Path
    csv: Path
    png: Path | None


def is_lr_history(data: Any) -> bool:
    """Whether parsed JSON is an ``lr_history.json`` (as opposed to the batch-size ``history.json``)."""
    return isinstance(data, dict) and data.get("kind") == KIND


def write_json(path: PathLike, events: Sequence[LRFindEvent]) -> Path:
    """One event per line, so that a history stays readable in a pager; read back by :func:`read_lr_history`."""
    return write_json_events(path, {"kind": KIND, "version": FORMAT_VERSION, "events": [e.to_dict() for e in events]})


def read_lr_history(path: PathLike) -> list[LRFindEvent]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return events_from_json(data)


def events_from_json(data: Any) -> list[LRFindEvent]:
    if not is_lr_history(data):
        raise ValueError('not a learning-rate history (expected an object with "kind": "lr_find")')
    version = data.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise ValueError(f"unsupported lr history format version {version!r}; this retune reads {FORMAT_VERSION}")
    return [LRFindEvent.from_dict(dict(e)) for e in data.get("events", [])]


def write_csv(path: PathLike, events: Sequence[LRFindEvent]) -> Path:
    """One row per range test; list cells are space-separated, a missing suggestion is blank."""
    return write_csv_rows(path, CSV_FIELDS, (_csv_row(e) for e in events))


def _csv_row(e: LRFindEvent) -> dict[str, Any]:
    return {
        "epoch": e.epoch,
        "global_step": e.global_step,
        "trigger": e.trigger,
        "groups": " ".join(map(str, e.groups)),
        "lrs_before": " ".join(f"{v:.6g}" for v in e.lrs_before),
        "lr_after": "" if e.lr_after is None else f"{e.lr_after:.6g}",
        "method": e.method,
        "steps": e.steps,
        "steps_planned": e.steps_planned,
        "stopped_early": e.stopped_early,
        "duration_s": f"{e.duration_s:.4f}",
        "batch_size": "" if e.batch_size is None else e.batch_size,
    }


def write_outputs(events: Sequence[LRFindEvent], out_dir: PathLike, plot: bool = True) -> LROutputPaths:
    """Write ``lr_history.json``, ``lr_history.csv`` and ``lr_find.png`` into ``out_dir`` (the plot is
    skipped with a warning without matplotlib: a finished run must not fail over a picture)."""
    out = Path(out_dir)
    json_path = write_json(out / JSON_NAME, events)
    csv_path = write_csv(out / CSV_NAME, events)
    png: Path | None = None
    if plot:
        try:
            png = plot_lr_history(out / PNG_NAME, events)
        except ImportError as exc:
            messages.warn(f"not writing {out / PNG_NAME} ({exc}); install matplotlib for the plot")
    return LROutputPaths(json_path, csv_path, png)


def format_lr(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def format_summary(event: LRFindEvent, where: str | None = None) -> str:
    """The line that ends a range test; ``where`` defaults to ``epoch N``."""
    before = ", ".join(format_lr(v) for v in event.lrs_before)
    groups = ",".join(map(str, event.groups))
    if event.lr_after is None:
        result = "no suggestion (too few finite points), learning rates unchanged"
    else:
        result = f"lr {before} -> {format_lr(event.lr_after)}"
    stop = ", stopped early: loss diverged" if event.stopped_early else ""
    return (
        f"{where or f'epoch {event.epoch}'}: param groups [{groups}] {result} ({event.method}; {event.steps} of "
        f"{event.steps_planned} steps{stop}, {event.duration_s:.2f}s, trigger {event.trigger})"
    )


def event_metrics(event: LRFindEvent) -> dict[str, float]:
    """What one range test sends to the loggers: the rate set (per group), its cost in steps and seconds."""
    metrics = {"retune/lr_find_seconds": float(event.duration_s), "retune/lr_find_steps": float(event.steps)}
    if event.lr_after is not None:
        for group in event.groups:
            metrics[f"retune/lr_group{group}"] = float(event.lr_after)
    return metrics


def format_table(events: Sequence[LRFindEvent]) -> str:
    """Fixed-width table: epoch, step, trigger, groups, lr before -> after, method, steps run, seconds."""
    title = f"retune: {len(events)} learning-rate range test{'s' if len(events) != 1 else ''}"
    if not events:
        return f"{title} (the schedule's triggers never fired)"
    header = ["epoch", "step", "trigger", "groups", "lr", "method", "steps", "seconds"]
    rows = [
        [
            str(e.epoch),
            str(e.global_step),
            e.trigger,
            ",".join(map(str, e.groups)),
            f"{'/'.join(format_lr(v) for v in sorted(set(e.lrs_before)))} -> {format_lr(e.lr_after)}",
            e.method,
            f"{e.steps}/{e.steps_planned}{'*' if e.stopped_early else ''}",
            f"{e.duration_s:.2f}",
        ]
        for e in events
    ]
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]
    align = ["<" if name in ("trigger", "method", "groups") else ">" for name in header]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, align, widths, strict=True)).rstrip()

    lines = [title, line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]
    if any(e.stopped_early for e in events):
        lines.append("* stopped early: the loss diverged before the last rate")
    return "\n".join(lines)


def plot_lr_history(path: PathLike, events: Sequence[LRFindEvent]) -> Path:
    """One panel per range test (up to 6, the latest): smoothed loss against the learning rate (log axis
    for an exponential sweep), the raw losses faint behind it, the suggestion marked with a dot and a line.

    Raises ImportError without matplotlib. The image is always ``PLOT_SIZE_PX`` wide; taller with more panels.
    """
    from matplotlib.figure import Figure

    shown = list(events)[-6:]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    width, height = PLOT_SIZE_PX
    columns = 1 if len(shown) <= 1 else 2
    rows = max(1, math.ceil(len(shown) / columns))
    fig = Figure(figsize=(width / PLOT_DPI, height * rows / PLOT_DPI), dpi=PLOT_DPI)
    axes = fig.subplots(rows, columns, squeeze=False)
    for k, ax in enumerate(axes.flat):
        if k >= len(shown):
            ax.set_visible(False)
            continue
        e = shown[k]
        n = len(e.losses)
        lrs = e.lrs[:n]
        ax.plot(lrs, e.losses, color="tab:blue", alpha=0.25, linewidth=1, label="loss")
        ax.plot(lrs, e.smoothed, color="tab:blue", linewidth=2, label="smoothed loss")
        if e.mode == "exponential":
            ax.set_xscale("log")
        finite = [v for v in e.smoothed if math.isfinite(v)]
        if finite:
            low, high = min(finite), max(finite)
            pad = (high - low) * 0.1 or abs(high) * 0.1 or 1.0
            ax.set_ylim(low - pad, high + pad)
        if e.lr_after is not None and e.suggestion_index is not None and e.suggestion_index < n:
            i = e.suggestion_index
            ax.plot([lrs[i]], [e.smoothed[i]], "o", color="tab:red", markersize=8, label=f"{e.method} point")
            ax.axvline(e.lr_after, color="tab:red", linestyle="--", linewidth=1, label=f"set: {e.lr_after:.3g}")
        groups = ",".join(map(str, e.groups))
        ax.set_title(f"epoch {e.epoch} (step {e.global_step}), {e.trigger}: groups [{groups}]", fontsize=9)
        ax.set_xlabel("learning rate")
        ax.set_ylabel("loss")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI, format="png")
    return path


def defaults_notice(config: LRFindConfig) -> str:
    """What a schedule without an ``lr_find`` section runs with, as Lightning's ``LearningRateFinder()`` runs
    with its defaults: said once, so that a schedule written for the batch-size finder does not pick a
    rate without the user seeing how."""
    values = ", ".join(f"{name} {_text(getattr(config, name))}" for name in type(config).model_fields)
    return f"the schedule has no lr_find section: the range tests use the defaults ({values})"


def _text(value: object) -> str:
    if isinstance(value, tuple):
        return str(list(value))
    return "null" if value is None else str(value)


__all__ = [
    "CSV_FIELDS",
    "CSV_NAME",
    "FORMAT_VERSION",
    "JSON_NAME",
    "KIND",
    "LROutputPaths",
    "PNG_NAME",
    "defaults_notice",
    "event_metrics",
    "events_from_json",
    "format_lr",
    "format_summary",
    "format_table",
    "is_lr_history",
    "plot_lr_history",
    "read_lr_history",
    "write_csv",
    "write_json",
    "write_outputs",
]
