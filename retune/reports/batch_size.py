"""What a run with the finder leaves behind: history as JSON and CSV, a text table and a PNG plot.

Everything here is a plain function of a list of :class:`~retune.RetuneEvent` (``finder.history``)
plus optional per-step series, with no Lightning import, so that the callback, ``retune demo`` and
``retune report history.json`` all render the same files from the same data, and a history saved
from one run can be re-rendered later on a machine without the model.

The callback calls :func:`write_outputs` once at the end of a fit; :func:`format_trial` and
:func:`format_summary` are the lines it prints while it searches, and :func:`event_metrics` is what
it sends to the trainer's loggers after each search.

matplotlib is imported only by :func:`plot_history` (and on the Agg backend, through
``matplotlib.figure.Figure`` rather than ``pyplot``), so writing JSON/CSV and formatting the table
never pay for that import and never touch a user's interactive backend.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retune import messages
from retune.events import RetuneEvent
from retune.reports.files import PathLike, write_csv_rows, write_json_events

FORMAT_VERSION = 1
JSON_NAME = "history.json"
CSV_NAME = "history.csv"
PNG_NAME = "batch_size.png"
# Pixel size of the plot: fixed so that the file is the same size whatever the data (and a test
# can check it); no ``bbox_inches="tight"``, which would crop it to the content.
PLOT_SIZE_PX = (1000, 500)
PLOT_DPI = 100

CSV_FIELDS = (
    "epoch",
    "global_step",
    "trigger",
    "stage",
    "direction",
    "batch_size_before",
    "batch_size_after",
    "trials",
    "duration_s",
    "max_fitting",
    "min_failing",
    "trial_sizes",
    "peak_bytes",
    "budget_bytes",
    "mode",
    "bucket_sizes",
    "bucket_bounds",
    "samples_per_step",
    "bucket_largest",
    "reference_bucket",
    "padded_per_step",
    "objective",
    "largest",
    "samples_per_s",
    "trial_samples_per_s",
    "prediction",
    "prediction_errors",
)

StepSeries = Sequence[tuple[int, int]]
"""``(global_step, value)`` pairs in step order: a batch size, or a number of bytes."""


@dataclass(frozen=True)
class History:
    """The contents of a ``history.json``: the events plus whatever per-step data the run recorded.

    ``steps`` is the train batch size at each recorded global step; when absent, plots derive it
    from the events (each search's size holds until the next one) up to ``end_step``.
    ``memory`` is peak memory per step in bytes, ``memory_label`` says what kind (measured peak,
    or the demo's simulated device), and ``budget_bytes`` is the limit searches ran against.
    """

    events: list[RetuneEvent]
    steps: list[tuple[int, int]] | None = None
    memory: list[tuple[int, int]] | None = None
    memory_label: str = "peak memory"
    budget_bytes: int | None = None
    end_step: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "events": [event.to_dict() for event in self.events],
            "steps": None if self.steps is None else [[s, v] for s, v in self.steps],
            "memory": None if self.memory is None else [[s, v] for s, v in self.memory],
            "memory_label": self.memory_label,
            "budget_bytes": self.budget_bytes,
            "end_step": self.end_step,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> History:
        """Read a ``history.json`` document; a bare list of events (``finder.state_dict()["history"]``) works too."""
        if isinstance(data, Sequence):
            return cls(events=[RetuneEvent.from_dict(dict(e)) for e in data])
        events = data.get("events")
        if not isinstance(events, list):
            # any JSON object read as a history with no events printed "0 searches" and wrote a plot beside it
            keys = ", ".join(sorted(map(str, data))) or "none"
            hint = (
                " (it looks like a schedule: pass the history.json a run wrote)"
                if {"triggers", "search"} & set(data)
                else ""
            )
            raise ValueError(f"no 'events' list, so not a history written by retune (its keys: {keys}){hint}")
        version = data.get("version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ValueError(f"unsupported history format version {version!r}; this retune reads {FORMAT_VERSION}")
        return cls(
            events=[RetuneEvent.from_dict(dict(e)) for e in events],
            steps=_pairs(data.get("steps")),
            memory=_pairs(data.get("memory")),
            memory_label=str(data.get("memory_label") or "peak memory"),
            budget_bytes=data.get("budget_bytes"),
            end_step=data.get("end_step"),
            meta=dict(data.get("meta") or {}),
        )


@dataclass(frozen=True)
class OutputPaths:
    """Where :func:`write_outputs` put each file (``png`` is None when matplotlib is missing)."""

    json: Path
    csv: Path
    png: Path | None


def _pairs(value: Any) -> list[tuple[int, int]] | None:
    if value is None:
        return None
    return [(int(step), int(v)) for step, v in value]


# -- files ---------------------------------------------------------------------------------------


def write_json(path: PathLike, history: History) -> Path:
    """Write ``history`` as JSON that ``retune report`` reads back; return the path.

    One event, and each per-step series, per line: a history stays readable in a diff or a pager
    without one line per trial field.
    """
    return write_json_events(path, history.to_dict())


def read_history(path: PathLike) -> History:
    """Load a ``history.json`` written by :func:`write_json` (or a bare JSON list of events)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, (dict, list)):
        raise ValueError(f"{path}: expected a JSON object or list of events, got {type(data).__name__}")
    return History.from_dict(data)


def write_csv(path: PathLike, events: Sequence[RetuneEvent]) -> Path:
    """One row per search, for spreadsheets.

    ``trial_sizes`` lists the probes in order as ``size:fit`` or ``size:fail``; ``peak_bytes`` is the
    measured peak of the size chosen (blank when not measured). Blank cells mean None.
    """
    return write_csv_rows(path, CSV_FIELDS, (_csv_row(e) for e in events))


def _csv_row(e: RetuneEvent) -> dict[str, Any]:
    return {
        "epoch": e.epoch,
        "global_step": e.global_step,
        "trigger": e.trigger,
        "stage": e.stage,
        "direction": e.direction,
        "batch_size_before": e.batch_size_before,
        "batch_size_after": e.batch_size_after,
        "trials": len(e.trials),
        "duration_s": f"{e.duration_s:.4f}",
        "max_fitting": _blank(e.max_fitting),
        "min_failing": _blank(e.min_failing),
        "trial_sizes": " ".join(f"{t.batch_size}:{'fit' if t.fits else 'fail'}" for t in e.trials),
        "peak_bytes": _blank(chosen_peak(e)),
        "budget_bytes": _blank(getattr(e, "budget_bytes", None)),
        "mode": getattr(e, "mode", ""),
        "objective": e.objective,
        "largest": _blank(e.largest),
        "samples_per_s": _rate_cell(chosen_rate(e)),
        "trial_samples_per_s": " ".join(
            f"{t.batch_size}:{_rate_cell(r) or '-'}" for t, r in zip(e.trials, trial_rates_of(e), strict=True)
        )
        if e.samples_per_s
        else "",
        "bucket_sizes": _slashed(e.bucket_sizes),
        "bucket_bounds": _slashed(e.bucket_bounds),
        "samples_per_step": f"{e.samples_per_step:g}" if e.bucket_sizes else "",
        "bucket_largest": _slashed(e.bucket_largest),
        "reference_bucket": _blank(e.reference_bucket),
        "padded_per_step": _blank(e.padded_per_step),
        "prediction": e.prediction,
        "prediction_errors": " ".join(
            f"{t.batch_size}:{'-' if err is None else f'{err:+.4f}'}"
            for t, err in zip(e.trials, e.prediction_errors, strict=False)
        ),
    }


def write_outputs(
    history: Sequence[RetuneEvent],
    out_dir: PathLike,
    *,
    steps: StepSeries | None = None,
    memory: StepSeries | None = None,
    memory_label: str = "peak memory",
    budget_bytes: int | None = None,
    end_step: int | None = None,
    meta: Mapping[str, Any] | None = None,
    plot: bool = True,
) -> OutputPaths:
    """Write ``history.json``, ``history.csv`` and ``batch_size.png`` into ``out_dir``.

    Idempotent: a later call (say, the demo after the callback's own call at fit end) overwrites
    the same three files. The plot is skipped with a warning, not an error, when matplotlib is not
    installed: losing a picture must never fail a training run that has finished.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = History(
        events=list(history),
        steps=None if steps is None else [(int(s), int(v)) for s, v in steps],
        memory=None if memory is None else [(int(s), int(v)) for s, v in memory],
        memory_label=memory_label,
        budget_bytes=budget_bytes,
        end_step=end_step,
        meta=dict(meta or {}),
    )
    json_path = write_json(out / JSON_NAME, record)
    csv_path = write_csv(out / CSV_NAME, record.events)
    png_path: Path | None = None
    if plot:
        try:
            png_path = plot_history(out / PNG_NAME, record)
        except ImportError as exc:
            messages.warn(f"not writing {out / PNG_NAME} ({exc}); install matplotlib for the plot")
    return OutputPaths(json=json_path, csv=csv_path, png=png_path)


def _blank(value: int | None) -> int | str:
    return "" if value is None else value


def _rate_cell(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


# -- console lines and logged metrics -----------------------------------------------------------


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``; binary units, because device memory is reported that way."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def format_trial(
    n: int,
    batch_size: int,
    fits: bool,
    peak_bytes: int | None = None,
    samples_per_s: float | None = None,
    bucket: int | None = None,
) -> str:
    """One progress line per probe: ``trial 3 batch_size=8: fits, peak 1.2 MiB, 512.3 samples/s`` (``trial 3
    bucket 2 batch_size=8: ...`` when a length bucket's worst batch was probed).

    "does not fit" rather than "out of memory": under a budget a trial fails by exceeding it.
    """
    which = "" if bucket is None else f"bucket {bucket} "
    line = f"trial {n} {which}batch_size={batch_size}: {'fits' if fits else 'does not fit'}"
    if peak_bytes is not None:
        line += f", peak {format_bytes(peak_bytes)}"
    if samples_per_s is not None:
        line += f", {format_rate(samples_per_s)}"
    return line


def format_rate(samples_per_s: float) -> str:
    """``1234.5`` -> ``'1,234 samples/s'`` (one decimal below 100, where it still means something)."""
    return f"{samples_per_s:,.1f} samples/s" if samples_per_s < 100 else f"{samples_per_s:,.0f} samples/s"


def trial_rates_of(event: RetuneEvent) -> list[float | None]:
    """Samples per second of each trial, in trial order (all None for a ``largest`` search)."""
    rates: list[float | None] = list(event.samples_per_s or [])
    return (rates + [None] * len(event.trials))[: len(event.trials)]


def size_rates(event: RetuneEvent) -> dict[int, float]:
    """Samples per second per size tried, the median over the size's trials (a repeated size has several).

    With buckets, only the reference bucket's trials: the same size in another bucket is another batch.
    """
    by_size: dict[int, list[float]] = {}
    reference = event.reference_bucket
    buckets = event.trial_buckets if len(event.trial_buckets) == len(event.trials) else None
    for index, (trial, rate) in enumerate(zip(event.trials, trial_rates_of(event), strict=True)):
        if reference is not None and buckets is not None and buckets[index] != reference:
            continue
        if rate is not None:
            by_size.setdefault(trial.batch_size, []).append(rate)
    return {size: statistics.median(rates) for size, rates in sorted(by_size.items())}


def chosen_size(event: RetuneEvent) -> int:
    """The size a throughput search chose where it timed: ``batch_size_after``, or with buckets the
    reference bucket's size."""
    reference = event.reference_bucket
    if reference is not None and reference < len(event.bucket_sizes):
        return event.bucket_sizes[reference]
    return event.batch_size_after


def chosen_rate(event: RetuneEvent) -> float | None:
    """Samples per second measured at the size a throughput search chose (None otherwise)."""
    return size_rates(event).get(chosen_size(event))


def _predicted(event: RetuneEvent) -> str:
    """``search.predict``: how the search went, for the summary line (empty when prediction was off)."""
    if event.prediction == "probed":
        return " (probed: could not predict)"
    if event.prediction != "predicted":
        return ""
    errors = [e for e in event.prediction_errors if e is not None]
    spread = f", trace error {min(errors):+.1%} to {max(errors):+.1%}" if errors else ""
    return f" verifying a prediction (traces {event.prediction_s:.2f}s{spread})"


def format_summary(event: RetuneEvent, where: str | None = None) -> str:
    """The one line that ends a search (or reports a recovered step); ``where`` defaults to ``epoch N``."""
    if event.is_recovery:
        return (
            f"{where or f'epoch {event.epoch}, step {event.global_step}'}: a {event.stage} step ran out of memory at "
            f"batch size {event.batch_size_after} and was recovered ({event.note}); trigger oom"
        )
    if event.bucket_sizes:
        before = _sizes_before(event)
        return (
            f"{where or f'epoch {event.epoch}'}: {event.stage} batch sizes per bucket {before} -> "
            f"{_slashed(event.bucket_sizes)} ({_bucket_throughput(event)}samples up to "
            f"{_slashed(event.bucket_bounds)}; {event.samples_per_step:g} samples per step; "
            f"{_trials(len(event.trials))}{_predicted(event)}, {event.duration_s:.2f}s, trigger {event.trigger})"
        )
    fastest = ""
    if event.objective == "throughput":
        rates = size_rates(event)
        chosen = rates.get(event.batch_size_after)
        fastest = "the fastest" + ("" if chosen is None else f" at {format_rate(chosen)}")
        if event.largest is not None and event.largest != event.batch_size_after:
            at_largest = rates.get(event.largest)
            fastest += f"; largest that fits {event.largest}" + (
                "" if at_largest is None else f" at {format_rate(at_largest)}"
            )
        fastest += ", "
    return (
        f"{where or f'epoch {event.epoch}'}: {event.stage} batch size {event.batch_size_before} -> "
        f"{event.batch_size_after} ({fastest}{_trials(len(event.trials))}{_predicted(event)}, {event.duration_s:.2f}s, "
        f"trigger {event.trigger})"
    )


def _bucket_throughput(event: RetuneEvent) -> str:
    """``objective: throughput`` with buckets: the largest sizes before the cap, the bucket timed, and ``T*``."""
    reference = event.reference_bucket
    if event.objective != "throughput" or reference is None:
        return ""
    chosen = chosen_rate(event)
    at = "" if chosen is None else f" at {format_rate(chosen)}"
    if event.padded_per_step is None:
        cap = "no cap: the largest that fits is the fastest"
    else:
        cap = f"capped at {event.padded_per_step:,} padded per step"
    largest = f"largest that fit {_slashed(event.bucket_largest)}; " if event.bucket_largest else ""
    return f"{largest}fastest {chosen_size(event)} in bucket {reference}{at}, {cap}; "


def _trials(count: int) -> str:
    """``1 trial``, ``3 trials``."""
    return f"{count} trial{'' if count == 1 else 's'}"


def _slashed(values: Sequence[int]) -> str:
    return "/".join(str(v) for v in values)


def event_metrics(event: RetuneEvent) -> dict[str, float]:
    """What one search sends to the trainer's loggers, as floats (every logger accepts those).

    Train searches log ``retune/batch_size``, ``retune/search_seconds`` and ``retune/trials``; a
    search of another stage logs the same names with the stage added (``retune/val_batch_size``).
    With buckets, each bucket's size is logged too (``retune/batch_size_bucket0``, shortest samples
    first) with ``retune/samples_per_step``; ``retune/batch_size`` is the longest samples' bucket's.
    """
    prefix = "retune/" if event.stage == "train" else f"retune/{event.stage}_"
    if event.is_recovery:
        return {f"{prefix}oom_micro_batches": float(event.micro_batches)}
    metrics = {
        f"{prefix}batch_size": float(event.batch_size_after),
        f"{prefix}search_seconds": float(event.duration_s),
        f"{prefix}trials": float(len(event.trials)),
    }
    for bucket, size in enumerate(event.bucket_sizes):
        metrics[f"{prefix}batch_size_bucket{bucket}"] = float(size)
    if event.bucket_sizes:
        metrics[f"{prefix}samples_per_step"] = float(event.samples_per_step)
    if event.padded_per_step is not None:
        metrics[f"{prefix}padded_per_step"] = float(event.padded_per_step)
    rate = chosen_rate(event)
    if rate is not None:
        metrics[f"{prefix}samples_per_s"] = float(rate)
    return metrics


_ARROW = " \u2192 "


def _sizes_before(e: RetuneEvent) -> str:
    """A bucketed event's sizes before the search: per bucket, with the buckets' bounds where the search grouped
    the samples anew (the sizes are other buckets'); the batch-size attribute's before the first."""
    before = _slashed(e.bucket_sizes_before) or str(e.batch_size_before)
    if e.bucket_bounds_before and e.bucket_sizes_before:
        before += f" (samples up to {_slashed(e.bucket_bounds_before)})"
    return before


def _size_change(e: RetuneEvent) -> str:
    if e.bucket_sizes:
        return f"{_sizes_before(e)} -> {_slashed(e.bucket_sizes)}"
    return f"{e.batch_size_before} -> {e.batch_size_after}"


def format_table(events: Sequence[RetuneEvent]) -> str:
    """A fixed-width table of the searches: epoch, step, trigger, size before -> after, trials, seconds.

    A ``stage`` column is added when any search tuned another stage than train, and a ``peak``
    column (measured peak of the chosen size) when any search measured one.
    """
    header = ["epoch", "step", "trigger", "batch size", "trials", "seconds"]
    if any(e.bucket_sizes for e in events):
        header[3] = "batch size (per bucket)"
    rows = [
        [
            str(e.epoch),
            str(e.global_step),
            e.trigger,
            _size_change(e),
            str(len(e.trials)),
            f"{e.duration_s:.2f}",
        ]
        for e in events
    ]
    if any(e.stage != "train" for e in events):
        header.insert(3, "stage")
        for row, e in zip(rows, events, strict=True):
            row.insert(3, e.stage)
    if any(e.is_recovery for e in events):
        header.append("split")
        for row, e in zip(rows, events, strict=True):
            row.append(f"{e.micro_batches} micro-batches" if e.is_recovery else "")
    peaks = [chosen_peak(e) for e in events]
    if any(p is not None for p in peaks):
        header.append("peak")
        for row, peak in zip(rows, peaks, strict=True):
            row.append("-" if peak is None else format_bytes(peak))
    if any(e.objective == "throughput" for e in events):
        header += ["samples/s", "largest"]
        for row, e in zip(rows, events, strict=True):
            rate = chosen_rate(e)
            row.append("-" if rate is None else format_rate(rate).removesuffix(" samples/s"))
            if e.bucket_largest:
                row.append(_slashed(e.bucket_largest))  # per bucket, before the cap
            else:
                row.append("-" if e.largest is None else str(e.largest))
    if any(e.reference_bucket is not None for e in events):
        header.append("padded/step (bucket timed)")
        for row, e in zip(rows, events, strict=True):
            cap = "no cap" if e.padded_per_step is None else f"{e.padded_per_step:,}"
            row.append("" if e.reference_bucket is None else f"{cap} (bucket {e.reference_bucket})")
    searches = sum(1 for e in events if not e.is_recovery)
    title = f"retune: {searches} search{'es' if searches != 1 else ''}"
    bounds = next((e.bucket_bounds for e in reversed(events) if e.bucket_bounds), None)
    if searches != len(events):
        recovered = len(events) - searches
        title += f", {recovered} recovered out-of-memory step{'s' if recovered != 1 else ''}"
    if not rows:
        return f"{title} (the schedule's triggers never fired)"
    if bounds:
        title += f"; buckets of samples up to {_slashed(bounds)}"
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]
    # text left-aligned, numbers right-aligned
    align = ["<" if name in ("trigger", "stage") else ">" for name in header]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, align, widths, strict=True)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([title, line(header), rule, *(line(r) for r in rows)])


# -- the plot ------------------------------------------------------------------------------------


def batch_size_series(events: Sequence[RetuneEvent], end_step: int | None = None) -> list[tuple[int, int]]:
    """Batch size over steps as implied by the events alone: each search's size holds until the next.

    Used when the run did not record the size at every step. Only train searches count (the
    x axis is training steps). Two searches at one step (a resume) keep the later one. The series
    ends at ``end_step`` when given.
    """
    points: dict[int, int] = {}
    for e in events:
        if e.stage == "train":
            points[e.global_step] = e.batch_size_after
    series = sorted(points.items())
    if series and end_step is not None and end_step > series[-1][0]:
        series.append((end_step, series[-1][1]))
    return series


def trial_peaks(event: RetuneEvent) -> list[int | None]:
    """Measured peak bytes of each trial, in trial order (None where unknown or not measured)."""
    peaks: list[int | None] = list(getattr(event, "peak_bytes", None) or [])
    return (peaks + [None] * len(event.trials))[: len(event.trials)]


def chosen_peak(event: RetuneEvent) -> int | None:
    """Measured peak for the size the search chose, or an upper bound for it; None if not measured.

    The trial at the chosen size when there was one; else (binsearch's margin applies a size that
    was not itself probed) the trial at ``max_fitting``, the smallest fitting size above it.
    """
    if event.bucket_sizes and len(event.trial_buckets) == len(event.trials):
        return _bucket_chosen_peak(event)
    peaks = dict[int, int]()
    for trial, peak in zip(event.trials, trial_peaks(event), strict=True):
        if trial.fits and peak is not None:
            peaks[trial.batch_size] = peak
    if event.batch_size_after in peaks:
        return peaks[event.batch_size_after]
    above = [size for size in peaks if size >= event.batch_size_after]
    return peaks[min(above)] if above else None


def _bucket_chosen_peak(event: RetuneEvent) -> int | None:
    """The largest of the buckets' chosen peaks: the worst batch the epoch can produce."""
    worst: int | None = None
    for bucket, size in enumerate(event.bucket_sizes):
        peaks = {
            t.batch_size: p
            for t, p, b in zip(event.trials, trial_peaks(event), event.trial_buckets, strict=True)
            if b == bucket and t.fits and p is not None
        }
        above = [s for s in peaks if s >= size]
        if above:
            peak = peaks[min(above)]
            worst = peak if worst is None else max(worst, peak)
    return worst


def bucket_series(events: Sequence[RetuneEvent], end_step: int | None = None) -> list[list[tuple[int, int]]]:
    """Each bucket's train batch size over steps (empty when no search used buckets)."""
    count = max((len(e.bucket_sizes) for e in events if e.stage == "train"), default=0)
    series: list[dict[int, int]] = [{} for _ in range(count)]
    for e in events:
        if e.stage == "train" and len(e.bucket_sizes) == count:
            for bucket, size in enumerate(e.bucket_sizes):
                series[bucket][e.global_step] = size
    out = []
    for points in series:
        ordered = sorted(points.items())
        if ordered and end_step is not None and end_step > ordered[-1][0]:
            ordered.append((end_step, ordered[-1][1]))
        out.append(ordered)
    return out


def _chosen_peaks(events: Iterable[RetuneEvent]) -> list[tuple[int, int]]:
    return [(e.global_step, peak) for e in events if e.stage == "train" and (peak := chosen_peak(e)) is not None]


def _plot_throughput(axis: Any, events: Sequence[RetuneEvent]) -> None:
    """Samples/s over batch size for each throughput search: the curve it measured, its choice starred."""
    for e in events:
        rates = size_rates(e)
        label = f"step {e.global_step}: {e.trigger}" + (
            "" if e.reference_bucket is None else f" (bucket {e.reference_bucket})"
        )
        (line,) = axis.plot(list(rates), list(rates.values()), "o-", markersize=3, linewidth=1, label=label)
        size = chosen_size(e)
        chosen = rates.get(size)
        if chosen is not None:
            axis.plot([size], [chosen], "*", markersize=12, color=line.get_color())
        if e.largest is not None and e.largest in rates:
            axis.plot([e.largest], [rates[e.largest]], "x", markersize=8, color=line.get_color())
    axis.set_xscale("log", base=2)
    axis.set_xlabel("batch size (\u2605 chosen, \u00d7 largest that fits)")
    axis.set_ylabel("samples/s")
    axis.set_title("throughput per search", fontsize=10)
    axis.grid(True, alpha=0.3)
    axis.legend(loc="lower right", fontsize=7)


def plot_history(path: PathLike, history: History | Sequence[RetuneEvent]) -> Path:
    """Draw batch size (and memory, when known) over global steps, with a marked line per search.

    Top panel: the train batch size, a step line, each search marked at its global step with its
    trigger and ``before -> after``. Bottom panel, only when any memory is known: the per-step
    memory series if the run recorded one, else the measured peak of each search's chosen size
    (dots), and the budget (dashed).
    Two panels rather than a second y-axis, so sizes and bytes never share a scale by accident.
    Right panel, only when a search had ``objective: throughput``: samples/s over batch size as each
    such search measured it, with the size chosen starred and the largest that fits crossed.
    The image is always :data:`PLOT_SIZE_PX` pixels. Raises ImportError without matplotlib.
    """
    from matplotlib.figure import Figure  # Agg canvas, no pyplot: no global state, no GUI backend

    record = history if isinstance(history, History) else History(events=list(history))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    series = record.steps or batch_size_series(record.events, record.end_step)
    # an explicit per-step series is the caller's view of memory; trial peaks are only the fallback,
    # so two different measures (say, the demo's simulated device and tensor bytes) never mix
    peaks = [] if record.memory else _chosen_peaks(record.events)
    has_memory = bool(record.memory or peaks or record.budget_bytes is not None)

    curves = [e for e in record.events if any(r is not None for r in trial_rates_of(e))]

    width, height = PLOT_SIZE_PX
    fig = Figure(figsize=(width / PLOT_DPI, height / PLOT_DPI), dpi=PLOT_DPI)
    # a throughput search adds a panel on the right: samples/s over batch size, its own x axis
    grid = fig.add_gridspec(2 if has_memory else 1, 2 if curves else 1, height_ratios=[2, 1] if has_memory else [1],
                            width_ratios=[2, 1] if curves else [1])  # fmt: skip
    ax = fig.add_subplot(grid[0, 0])
    mem_ax = fig.add_subplot(grid[1, 0], sharex=ax) if has_memory else None
    if mem_ax is not None:
        ax.tick_params(labelbottom=False)
    if curves:
        _plot_throughput(fig.add_subplot(grid[:, 1]), curves)

    buckets = bucket_series(record.events, record.end_step or (series[-1][0] if series else None))
    bounds = next((e.bucket_bounds for e in reversed(record.events) if e.bucket_bounds), [])
    if buckets:
        # one line per length bucket: the shortest samples' bucket on top
        top = 1.0
        for bucket, points in enumerate(buckets):
            if points:
                label = f"bucket {bucket}" + (f" (samples up to {bounds[bucket]})" if bucket < len(bounds) else "")
                ax.plot(
                    [s for s, _ in points], [v for _, v in points], drawstyle="steps-post", linewidth=1.5, label=label
                )
                top = max(top, *(v for _, v in points))
        ax.set_ylim(0, top * 1.3)
        ax.legend(loc="upper right", fontsize=7)
    elif series:
        xs = [s for s, _ in series]
        ys = [v for _, v in series]
        # steps-post: a size holds from the step it was set until the next change
        ax.plot(xs, ys, drawstyle="steps-post", color="tab:blue", linewidth=2)
        ax.set_ylim(0, max(ys) * 1.3)
    ax.set_ylabel("train batch size")
    ax.grid(True, alpha=0.3)
    ax.set_title(f"retune: train batch size over training ({len(record.events)} searches)")

    ymax = ax.get_ylim()[1]
    for e in record.events:
        stage = "" if e.stage == "train" else f"{e.stage} "
        for axis in (ax, mem_ax):
            if axis is not None:
                axis.axvline(e.global_step, color="gray", linestyle=":", linewidth=1)
        ax.annotate(
            f"{e.trigger}\n{stage}{_size_change(e).replace(' -> ', _ARROW)}",
            xy=(e.global_step, ymax),
            xytext=(3, -3),
            textcoords="offset points",
            va="top",
            ha="left",
            fontsize=8,
            color="dimgray",
        )

    if mem_ax is not None:
        mib = 1024 * 1024
        top = 0.0
        if record.memory:
            mem_y = [v / mib for _, v in record.memory]
            mem_ax.plot(
                [s for s, _ in record.memory], mem_y, color="tab:orange", linewidth=1.5, label=record.memory_label
            )
            top = max(mem_y)
        if peaks:
            peak_y = [v / mib for _, v in peaks]
            mem_ax.plot([s for s, _ in peaks], peak_y, "o", color="tab:green", label="measured peak of the size chosen")
            top = max(top, *peak_y)
        if record.budget_bytes is not None:
            budget = record.budget_bytes / mib
            mem_ax.axhline(budget, color="tab:red", linestyle="--", linewidth=1, label="memory budget")
            top = max(top, budget)
        mem_ax.set_ylim(0, top * 1.3 if top > 0 else 1)
        mem_ax.set_ylabel("memory (MiB)")
        mem_ax.grid(True, alpha=0.3)
        mem_ax.legend(loc="lower right", fontsize=8)
        mem_ax.set_xlabel("global step")
    else:
        ax.set_xlabel("global step")
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI, format="png")
    return path


__all__ = [
    "CSV_NAME",
    "JSON_NAME",
    "PNG_NAME",
    "PLOT_SIZE_PX",
    "History",
    "OutputPaths",
    "batch_size_series",
    "bucket_series",
    "chosen_peak",
    "chosen_rate",
    "chosen_size",
    "event_metrics",
    "format_bytes",
    "format_summary",
    "format_table",
    "format_rate",
    "format_trial",
    "plot_history",
    "read_history",
    "size_rates",
    "trial_peaks",
    "trial_rates_of",
    "write_csv",
    "write_json",
    "write_outputs",
]
