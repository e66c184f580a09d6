"""``retune.distributed``: DDP and FSDP2 on gloo ranks in subprocesses with timeouts."""
