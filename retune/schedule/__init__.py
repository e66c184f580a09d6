"""The schedule format: what users write in YAML, JSON or TOML, validated (no torch here).

* :mod:`~retune.schedule.models`: the pydantic models, the single source of every field and default;
* :mod:`~retune.schedule.loading`: a path, dict or model into a validated schedule, or a
  :class:`~retune.errors.ScheduleError` naming the file, field and value;
* :mod:`~retune.schedule.triggers`: when to re-run a search, as pure logic over a ``TrainingView``.
"""

__all__ = ["loading", "models", "triggers"]
