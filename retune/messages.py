"""Where retune's messages go: each one once, on rank zero, where Lightning users look for them.

Two kinds, one channel each:

* **Warnings** (something the user should act on) are Python warnings of category
  :class:`RetuneWarning`, as Lightning's own ``rank_zero_warn`` issues its warnings: printed once
  by Python's warning machinery, whatever the logging setup, ``verbose=False`` or not; filterable
  (``warnings.filterwarnings("ignore", category=RetuneWarning)``), turned into errors by ``-W error``,
  and sent to logging by ``logging.captureWarnings(True)``. A warning is attributed to the first
  frame outside retune, Lightning, torch and the standard library (usually the line that called
  ``trainer.fit``), so the line printed under it is the user's, not retune's internals.
* **Progress lines** (a search starting, its trials, its result; ``verbose``) are printed with a
  ``[retune]`` prefix to stderr above a TQDM progress bar.

Neither also goes through ``logging``: a record on an unconfigured logger reaches Python's
last-resort handler, which printed every warning a second time.

Under DDP every rank runs the same searches; only rank zero prints. The rank is the trainer's
(:func:`set_rank`, from the callback's ``setup``), or before that the launcher's environment, read
as Lightning reads it (``RANK``, ``LOCAL_RANK``, ``SLURM_PROCID``, ``JSM_NAMESPACE_RANK``).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable


class RetuneWarning(UserWarning):
    """Every warning retune issues."""


def _rank_from_environment() -> int:
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        value = os.environ.get(key)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


_rank = _rank_from_environment()


def set_rank(rank: int) -> None:
    """This process's global rank (the callback sets it from the trainer in ``setup``)."""
    global _rank
    _rank = int(rank)


def is_rank_zero() -> bool:
    return _rank == 0


_LIBRARIES = frozenset(
    {
        "retune",
        "lightning",
        "pytorch_lightning",
        "lightning_fabric",
        "lightning_utilities",
        "torch",
        "flash",
        "finetuning_scheduler",
        "jsonargparse",
    }
)


def _user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn`` in :func:`_issue` name the first frame outside retune,
    the Lightning packages, torch and the standard library; 2 (:func:`_issue`'s caller) when there is none."""
    frame = sys._getframe(2)  # the caller of _issue()
    level = 2
    while frame is not None:
        top = str(frame.f_globals.get("__name__", "")).split(".")[0]
        if top not in _LIBRARIES and top not in sys.stdlib_module_names:
            return level
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return 2


def _issue(message: str) -> None:
    if _rank == 0:
        warnings.warn(message, RetuneWarning, stacklevel=_user_stacklevel())


def warn(message: str) -> None:
    """Issue ``message`` as a :class:`RetuneWarning`, on rank zero only."""
    _issue(message)


Say = Callable[..., None]
"""``say(message, warn=False)``: a rank-zero printer, what retune's modules take (a callback's ``_say``,
or :func:`say`)."""


def say(message: str, warn: bool = False, verbose: bool = True) -> None:
    """With ``warn`` a warning (whatever ``verbose`` says), else, when ``verbose``, a progress line; rank zero
    only, each printed once (not also logged, which printed twice): the ``say`` retune's modules take by default."""
    if warn:
        _issue(message)
    elif verbose:
        progress(message)


def progress(message: str) -> None:
    """Print a ``[retune]`` progress line on rank zero."""
    if _rank == 0:
        print_line(f"[retune] {message}")


def print_line(message: str) -> None:
    """Print to stderr above a TQDM progress bar instead of through it."""
    try:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stderr)
    except ImportError:  # pragma: no cover - Lightning depends on tqdm
        print(message, file=sys.stderr)


__all__ = ["RetuneWarning", "Say", "is_rank_zero", "print_line", "progress", "say", "set_rank", "warn"]
