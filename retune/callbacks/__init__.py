"""The Lightning callbacks: thin layers of hooks over the packages below.

A callback decides *when* (its schedule's triggers, read at the hooks Lightning calls) and hands the
*what* to the capability packages: :mod:`retune.search` runs a stage's batch-size search,
:mod:`retune.lr` the learning-rate range test, :mod:`retune.recovery` recovers a step that ran out of
memory, and :mod:`retune.reports` writes what happened.

* :mod:`~retune.callbacks.batch_size_finder`: ``ScheduledBatchSizeFinder``;
* :mod:`~retune.callbacks.lr_finder`: ``ScheduledLRFinder``;
* :mod:`~retune.callbacks.base`: what both callbacks share around their hooks (constructor arguments,
  the start of ``setup``, printing, logging an event, the report at fit end, history and trigger state
  in checkpoints);
* :mod:`~retune.callbacks.oom_recovery`: the ``oom`` trigger's step recovery wired into a fit (owned by
  ``ScheduledBatchSizeFinder``);
* :mod:`~retune.callbacks.stage_attrs`: which attribute holds each stage's batch size;
* :mod:`~retune.callbacks.ordering`: where retune's callbacks run among the others;
* :mod:`~retune.callbacks.trainer_view`: what the callbacks read off the trainer at an epoch start.
"""

__all__ = ["base", "batch_size_finder", "lr_finder", "oom_recovery", "ordering", "stage_attrs", "trainer_view"]
