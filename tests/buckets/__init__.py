"""``retune.buckets``: ``batching: buckets`` end to end (plans, sizes, samplers, DDP/FSDP2, reports)."""
