"""``search.batching: buckets``: samples grouped by size, one batch size per bucket.

* :mod:`~retune.buckets.plan`: which samples go together, and each epoch's batches;
* :mod:`~retune.buckets.sizes`: every bucket's largest size from a memory model in batch x sample size;
* :mod:`~retune.buckets.throughput`: ``objective: throughput`` with buckets;
* :mod:`~retune.buckets.loader`: the user's DataLoader reading the batches retune forms per bucket;
* :mod:`~retune.buckets.train_buckets`: what a run keeps between searches, and one bucketed search;
* :mod:`~retune.buckets.batching`: the search's ``Batching`` seam for buckets (what the callback passes
  :func:`~retune.search.stage.search_stage` for the train stage).
"""

__all__ = ["batching", "loader", "plan", "sizes", "throughput", "train_buckets"]
