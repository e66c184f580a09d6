"""The two errors users see: a bad schedule, and a search that cannot succeed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FieldProblem:
    """One thing wrong with a schedule, located by its field path (``triggers[1].at``)."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ScheduleError(ValueError):
    """A schedule file or dict that cannot be used.

    Subclasses :class:`ValueError` so code that validates configs generically still catches it.
    The message names the source, the field path, the bad value and what is allowed; ``problems``
    keeps the same information structured for tools.

    Args:
        source: the file path the schedule came from, or ``<dict>``.
        problems: every problem found, each a field path and a message.
    """

    def __init__(self, source: str, problems: list[FieldProblem]) -> None:
        self.source = source
        self.problems = list(problems)
        lines = [str(p) for p in self.problems]
        if len(lines) == 1:
            text = f"{source}: {lines[0]}"
        else:
            text = f"{source}: {len(lines)} problems\n" + "\n".join(f"  {line}" for line in lines)
        super().__init__(text)


class RetuneError(RuntimeError):
    """A batch-size search that cannot produce a usable size, or a trainer setup retune cannot serve."""


__all__ = ["FieldProblem", "RetuneError", "ScheduleError"]
