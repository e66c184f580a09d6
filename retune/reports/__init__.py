"""What a run leaves behind: histories as JSON and CSV, a text table and a PNG plot.

* :mod:`~retune.reports.batch_size`: ``ScheduledBatchSizeFinder``'s history and plot;
* :mod:`~retune.reports.lr`: ``ScheduledLRFinder``'s history and plot;
* :mod:`~retune.reports.files`: the JSON and CSV writers both share.
"""

__all__ = ["batch_size", "files", "lr"]
