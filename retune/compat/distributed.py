"""Ranks: whether they must agree, how they exchange a decision, and what DDP leaves behind."""

from __future__ import annotations

from typing import Any

import torch

from retune.compat.strategies import check_strategy as check_strategy
from retune.compat.strategies import strategy_kind as _strategy_kind


def is_distributed(trainer: Any) -> bool:
    """More than one rank that must agree on every decision (DDP, or FSDP2 on several devices)."""
    return _strategy_kind(trainer) in ("ddp", "fsdp2") and int(getattr(trainer, "world_size", 1)) > 1


def is_ddp(trainer: Any) -> bool:
    """DDP on several ranks: every rank holds the whole model (a probe may run the unwrapped module)."""
    return _strategy_kind(trainer) == "ddp"


def unshare_spawned_weights(trainer: Any, pl_module: Any) -> bool:
    """Give this rank its own copy of weights that ``ddp_spawn`` left in shared memory; True if any were.

    torch.multiprocessing moves every CPU tensor handed to a spawned process into shared memory, so
    under pytorch-lightning < 2.1 all ranks of a CPU run train *one* set of weights and race on every
    optimizer step (Lightning issue #17399; 2.1 clones them in each process). A probe writes to the
    weights and its snapshot reads them, so a rank could capture another rank's half-finished probe
    and "restore" it. Cloning in ``setup``, before the optimizers and DDP exist, is what Lightning 2.1
    does, under the same conditions: the spawn start method on a CPU accelerator. Elsewhere shared
    memory is the user's choice (``share_memory_()``) or is about to be moved to a GPU, and is left alone.
    """
    strategy = trainer.strategy
    spawned_on_cpu = getattr(strategy, "_start_method", None) == "spawn" and strategy.root_device.type == "cpu"
    if not (is_ddp(trainer) and spawned_on_cpu):
        return False
    tensors = [*pl_module.parameters(), *pl_module.buffers()]
    shared = [t for t in tensors if t.device.type == "cpu" and t.is_shared()]
    with torch.no_grad():
        for tensor in shared:
            tensor.data = tensor.data.clone()
    return bool(shared)


def all_gather_object(trainer: Any, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (just ``[obj]`` on a single device). One collective call."""
    if not is_distributed(trainer):
        return [obj]
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(trainer: Any, obj: Any) -> Any:
    """Rank zero's ``obj`` on every rank (a no-op on a single device)."""
    if not is_distributed(trainer):
        return obj
    return trainer.strategy.broadcast(obj, src=0)


def shares_out_samplers(trainer: Any) -> bool:
    """Whether Lightning shards a train sampler across the ranks (the Trainer's ``use_distributed_sampler``,
    1.9's ``replace_sampler_ddp``, both True by default): under DDP it wraps a sampler that is not a
    ``DistributedSampler`` in a ``DistributedSamplerWrapper``, which gives each rank its share of one pass."""
    connector = trainer._accelerator_connector
    flag = getattr(connector, "use_distributed_sampler", None)
    if flag is None:
        flag = getattr(connector, "replace_sampler_ddp", True)
    return bool(flag)


def sharded_across(trainer: Any) -> int:
    """The ranks Lightning shards a train sampler across: the world size where it injects or wraps a
    ``DistributedSampler`` (:func:`shares_out_samplers`), else 1 (each rank draws the whole epoch)."""
    world_size = int(getattr(trainer, "world_size", 1) or 1)
    if world_size > 1 and hasattr(trainer, "_accelerator_connector") and not shares_out_samplers(trainer):
        return 1
    return world_size


def ddp_wrapper(trainer: Any) -> Any | None:
    """The ``DistributedDataParallel`` module the strategy trains through, or None."""
    model = getattr(trainer.strategy, "model", None)
    return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


__all__ = [
    "all_gather_object",
    "broadcast_object",
    "check_strategy",
    "ddp_wrapper",
    "is_ddp",
    "is_distributed",
    "sharded_across",
    "shares_out_samplers",
    "unshare_spawned_weights",
]
