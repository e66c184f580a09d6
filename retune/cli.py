"""The ``retune`` command: check, show and publish the schedule format; run the demo; re-render reports.

``demo`` and ``report`` import their modules (Lightning, matplotlib) only when run, so ``retune
validate`` in CI stays a light, fast import.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from retune import __version__
from retune.errors import RetuneError, ScheduleError
from retune.schedule.loading import load_schedule
from retune.schedule.models import RetuneSchedule


def _import_from_cwd() -> None:
    """Put the working directory on the import path, as ``python -m`` and ``python train.py`` run from it do.

    Validation imports the schedule's dotted paths (``search.sample_size``, ``loss_items``); the ``retune``
    console script's own path is its bin folder, so without this a module beside the schedule that the
    training script imports fine would be reported as missing.
    """
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def _validate(args: argparse.Namespace) -> int:
    _import_from_cwd()
    status = 0
    for name in args.files:
        try:
            schedule = load_schedule(name)
        except ScheduleError as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 1
            continue
        kinds = "+".join(t.kind for t in schedule.triggers)
        print(f"OK {name} (mode={schedule.search.mode}, triggers={kinds})")
    return status


def _schema(args: argparse.Namespace) -> int:
    print(json.dumps(RetuneSchedule.model_json_schema(), indent=2))
    return 0


def _show(args: argparse.Namespace) -> int:
    _import_from_cwd()
    try:
        schedule = load_schedule(args.file)
    except ScheduleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    data = schedule.model_dump(mode="json")
    if args.format == "json":
        print(json.dumps(data, indent=2))
    else:
        print(yaml.safe_dump(data, sort_keys=False).rstrip())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from retune.demo import DemoConfig, run_demo

    _import_from_cwd()  # the schedule is validated as `retune validate` does it

    given = {
        "schedule": args.schedule,
        "epochs": args.epochs,
        "budget": args.budget,
        "out": None if args.out is None else Path(args.out),
        "seed": args.seed,
        "unfreeze_at": args.unfreeze_at,
        "pretrain_epochs": args.pretrain_epochs,
        "limit": args.limit,
        "progress_bar": args.progress_bar,
        "memory": args.memory,
    }
    try:
        run_demo(DemoConfig(**{k: v for k, v in given.items() if v is not None}))
    except (ValueError, ImportError, RetuneError, OSError) as exc:  # ScheduleError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _report(args: argparse.Namespace) -> int:
    from retune.events import RetuneEvent
    from retune.lr.events import LRFindEvent
    from retune.reports import batch_size as report
    from retune.reports import lr as lr_report

    path = Path(args.history)
    data = _json_or_none(path)
    event_type: type[Any]
    if lr_report.is_lr_history(data):  # ScheduledLRFinder's lr_history.json
        what, png_name, event_type = "learning-rate history", lr_report.PNG_NAME, LRFindEvent
        read: Callable[[Path], Any] = lr_report.read_lr_history
        table: Callable[[Any], str] = lr_report.format_table
        plot: Callable[[Path, Any], Any] = lr_report.plot_lr_history
        events_of: Callable[[Any], list[Any]] = list
    else:
        what, png_name, event_type = "history", report.PNG_NAME, RetuneEvent
        read, plot = report.read_history, report.plot_history
        table = lambda history: report.format_table(history.events)  # noqa: E731
        events_of = lambda history: history.events  # noqa: E731
    if args.plot is not None:
        refused = _plot_path_problem(Path(args.plot), png_name)
        if refused is not None:
            print(f"error: --plot: {refused}", file=sys.stderr)
            return 1
    try:
        history = read(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        problem = _events_problem(data, event_type) if isinstance(exc, TypeError) else None
        print(f"error: {path}: cannot read a retune {what}: {problem or exc}", file=sys.stderr)
        return 1
    if not events_of(history):
        print(f"{path}: no events in this {what}: nothing to tabulate or plot")
        return 0
    print(table(history))
    if args.no_plot:
        return 0
    png = Path(args.plot) if args.plot else path.parent / png_name  # re-renders a run's own plot
    try:
        plot(png, history)
    except ImportError as exc:
        print(f"error: the plot needs matplotlib ({exc}); pip install matplotlib", file=sys.stderr)
        return 1
    except OSError as exc:
        option = "--plot: " if args.plot else ""
        detail = exc.strerror or str(exc)
        if exc.filename is not None and str(exc.filename) != str(png):
            detail = f"{exc.filename}: {detail}"
        print(f"error: {option}cannot write the plot to {str(png)!r}: {detail}", file=sys.stderr)
        return 1
    print(f"plot: {png}")
    return 0


def _plot_path_problem(png: Path, png_name: str) -> str | None:
    """Why ``--plot`` cannot be written (a folder, or a file where a folder above it should be), or None.

    Missing folders above it are fine: the plot creates them.
    """
    if png.is_dir():
        return f"{str(png)!r} is a folder; give the PNG's file name, such as {str(png / png_name)!r}"
    for folder in png.parents:
        if folder.exists() and not folder.is_dir():
            return f"{str(folder)!r} is a file, not a folder (in {str(png)!r})"
    return None


def _json_or_none(path: Path) -> Any:
    """The parsed JSON, or None where it cannot be read (the reader then reports why, with its own message)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _events_problem(data: Any, event_type: type[Any]) -> str | None:
    """Which entry of a history's events the reader could not turn into an ``event_type``, and why: not an object,
    keys missing or unknown.

    The readers build each event with ``event_type(**entry)``, whose TypeError names a constructor, not the entry
    or its keys. None: no such entry found (the reader's own message says what failed).
    """
    events = data.get("events") if isinstance(data, dict) else data
    if not isinstance(events, list):
        return None
    fields = dataclasses.fields(event_type)
    known = {f.name for f in fields}
    required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for i, entry in enumerate(events):
        if not isinstance(entry, dict):
            return f"events[{i}] is {json.dumps(entry)[:40]}, not an object of an event's fields"
        try:
            event_type.from_dict(dict(entry))  # the reader's own conversion: it fills some keys (an old file's)
            continue
        except (TypeError, ValueError, KeyError):
            pass
        missing = [name for name in required if name not in entry]
        unknown = sorted(str(key) for key in entry if key not in known)
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unknown {'keys' if len(unknown) > 1 else 'key'} {', '.join(map(repr, unknown))}"] if unknown else []
        )
        if parts:
            return f"events[{i}] is not a retune event: {'; '.join(parts)}"
    return None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="retune", description="Re-tune the batch size of a Lightning fine-tuning run when its memory needs change."
    )
    parser.add_argument("--version", action="version", version=f"retune {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check schedule files; exit 1 if any is invalid")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.set_defaults(func=_validate)

    p = sub.add_parser("schema", help="print the JSON Schema of the schedule format")
    p.set_defaults(func=_schema)

    p = sub.add_parser("show", help="print a schedule with every default filled in")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--format", choices=("yaml", "json"), default="yaml")
    p.set_defaults(func=_show)

    # Defaults live in retune.demo.DemoConfig (None here means "the demo's default"); the help
    # repeats them so that `retune --help` does not import torch and Lightning to print them.
    p = sub.add_parser(
        "demo",
        help="fine-tune a small CNN on scikit-learn's digits and watch the batch size change at the unfreeze",
        description="Pretrain a small CNN on handwritten digits 0-4, fine-tune it on 5-9 with BackboneFinetuning "
        "(frozen, then unfrozen) and ScheduledBatchSizeFinder under a memory budget, then print the searches "
        "and the accuracy and write history.json, history.csv and batch_size.png. About 20 seconds on 2 CPU "
        "cores; the data ships with scikit-learn, nothing is downloaded.",
    )
    p.add_argument(
        "--schedule", metavar="FILE", help="schedule file (default: schedules/freeze_unfreeze.yaml)", default=None
    )
    p.add_argument("--epochs", type=_positive, default=None, metavar="N", help="fine-tuning epochs (default: 12)")
    p.add_argument(
        "--budget",
        default=None,
        metavar="SIZE",
        help="memory budget, a size with a unit such as 6MiB (a bare number is a fraction of device memory, "
        "which a CPU has not: refused); written into the schedule's memory.budget (default: the schedule's, "
        "else 2MiB); see --memory for how it is enforced",
    )
    p.add_argument("--out", metavar="DIR", default=None, help="output folder (default: ./retune-demo)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: 0)")
    p.add_argument(
        "--unfreeze-at",
        type=_non_negative,
        default=None,
        metavar="EPOCH",
        help="epoch at which BackboneFinetuning unfreezes the backbone, from 0 (default: 3)",
    )
    p.add_argument(
        "--pretrain-epochs", type=_positive, default=None, metavar="N", help="backbone pretraining epochs (default: 12)"
    )
    p.add_argument(
        "--limit",
        type=_positive,
        default=None,
        metavar="N",
        help="use at most N training images per task, for a quick run (default: all)",
    )
    p.add_argument(
        "--memory",
        choices=("simulated", "measured"),
        default=None,
        help="simulated (default): a simulated device enforces the budget, so sizes are exact and repeatable; "
        "measured: retune holds each probe's measured peak memory to the schedule's budget",
    )
    bar = p.add_mutually_exclusive_group()
    bar.add_argument(
        "--progress-bar",
        dest="progress_bar",
        action="store_true",
        default=None,
        help="show Lightning's progress bar (default: only when stdout is a terminal)",
    )
    bar.add_argument("--no-progress-bar", dest="progress_bar", action="store_false")
    p.set_defaults(func=_demo)

    p = sub.add_parser(
        "report",
        help="print the table of searches from a history.json (or lr_history.json) and redraw its plot",
        description="Re-render the table of re-tune events and the batch-size plot from a history.json "
        "written by a run with ScheduledBatchSizeFinder (or by retune demo), or the table of range tests and "
        "the loss-vs-learning-rate plot from an lr_history.json written by ScheduledLRFinder.",
    )
    p.add_argument("history", metavar="HISTORY_JSON")
    plotting = p.add_mutually_exclusive_group()
    plotting.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help="where to write the plot (default: batch_size.png, or lr_find.png, beside the JSON)",
    )
    plotting.add_argument("--no-plot", action="store_true", help="print the table only")
    p.set_defaults(func=_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status: int = args.func(args)
    except BrokenPipeError:  # `retune schema | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["build_parser", "main"]
