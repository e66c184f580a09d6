"""One stage's batch-size search, from a trigger to the applied size.

The algorithms are pure logic over an oracle (``fits(size)``, ``time(size)``), tested without
Lightning; :mod:`~retune.search.stage` connects them to real probes.

* :mod:`~retune.search.largest`: the largest size that fits (power, binsearch, model);
* :mod:`~retune.search.throughput`: the size that trains fastest among those that fit;
* :mod:`~retune.search.stage`: one stage's search, its probes and the applied result;
* :mod:`~retune.search.batching`: the ``Batching`` seam the stage's search calls (one size here; the
  buckets implement it in :mod:`retune.buckets.batching`, so this package never imports them);
* :mod:`~retune.search.policies`: what else changes with the batch size (accumulation, learning rates).
"""

__all__ = ["batching", "largest", "policies", "stage", "throughput"]
