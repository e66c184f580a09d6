"""retune: re-run the largest-batch-size search whenever fine-tuning changes the memory a step needs.

>>> from retune import ScheduledBatchSizeFinder
>>> finder = ScheduledBatchSizeFinder("schedules/freeze_unfreeze.yaml")  # doctest: +SKIP
"""

from retune.errors import RetuneError, ScheduleError
from retune.events import RetuneEvent, Trial
from retune.messages import RetuneWarning
from retune.schedule.loading import load_schedule
from retune.schedule.models import RetuneSchedule
from retune.schedule.triggers import TrainingView, Trigger

__version__ = "0.1.0"

__all__ = [
    "RetuneError",
    "RetuneEvent",
    "RetuneSchedule",
    "RetuneWarning",
    "ScheduleError",
    "ScheduledBatchSizeFinder",
    "ScheduledLRFinder",
    "TrainingView",
    "Trial",
    "Trigger",
    "__version__",
    "is_oom_error",
    "load_schedule",
]


def __getattr__(name: str) -> object:
    # The callback imports Lightning and the OOM check torch; keep `retune validate` and schedule
    # tooling free of those imports (seconds at start-up).
    if name == "ScheduledBatchSizeFinder":
        from retune.callbacks.batch_size_finder import ScheduledBatchSizeFinder

        return ScheduledBatchSizeFinder
    if name == "ScheduledLRFinder":
        from retune.callbacks.lr_finder import ScheduledLRFinder

        return ScheduledLRFinder
    if name == "is_oom_error":
        from retune.oom import is_oom_error

        return is_oom_error
    raise AttributeError(f"module 'retune' has no attribute {name!r}")
