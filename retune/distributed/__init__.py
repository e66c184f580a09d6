"""torch.distributed glue that a rank running out of memory cannot hang (no Lightning here).

* :mod:`~retune.distributed.collective_guard`: every collective during a probe first agrees on failure;
* :mod:`~retune.distributed.fsdp2`: FSDP2 around a probe: guarded trials, a clean state after a failure;
* :mod:`~retune.distributed.grad_sync`: DDP's gradient all-reduce, done after backward;
* :mod:`~retune.distributed.local_shards`: the part of a sharded tensor that lives on this rank.
"""

__all__ = ["collective_guard", "fsdp2", "grad_sync", "local_shards"]
