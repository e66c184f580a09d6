"""The learning-rate range test, re-run on the same triggers as the batch-size search.

* :mod:`~retune.lr.range_test`: the sweep, smoothing, divergence and suggestion as pure logic;
* :mod:`~retune.lr.probe`: the range test on real training steps, the run left as it was;
* :mod:`~retune.lr.apply`: a found rate put on param groups and whatever remembers their rates;
* :mod:`~retune.lr.events`: what a range test did, as a plain record.
"""

__all__ = ["apply", "events", "probe", "range_test"]
