"""The ``retune`` command: check, show and publish the schedule format from a shell or CI."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import yaml

from retune import __version__
from retune.errors import ScheduleError
from retune.loading import load_schedule
from retune.schedule import RetuneSchedule


def _validate(args: argparse.Namespace) -> int:
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
