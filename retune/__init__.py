"""retune: re-run the largest-batch-size search whenever fine-tuning changes the memory a step needs."""

from retune.errors import RetuneError, ScheduleError
from retune.loading import load_schedule
from retune.schedule import RetuneSchedule

__version__ = "0.1.0"

__all__ = [
    "RetuneError",
    "RetuneSchedule",
    "ScheduleError",
    "__version__",
    "load_schedule",
]
