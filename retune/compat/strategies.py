"""Lightning's strategies as retune sees them: which it serves, which it refuses, and why.

Which strategies retune serves, and why:

* a single device, and DDP (``ddp``, ``ddp_spawn``): every rank holds the whole model;
* ``ModelParallelStrategy`` with FSDP2 data-parallel sharding (``fully_shard`` in
  ``configure_model``, ``tensor_parallel_size=1``): FSDP2 has no wrapper, the LightningModule is
  sharded in place, so a probe runs it exactly as training does;
* refused: tensor parallelism (``tensor_parallel_size > 1``: the search treats every rank as a
  data-parallel replica, with its own share of the samples and its own probe batches, where the
  ranks of a tensor-parallel group must all see the same batch), ``FSDPStrategy``
  (FSDP1 wraps the model; probes would have to run through the wrapper), ``DeepSpeedStrategy`` (its
  engine owns the optimizer step and the partitioned state). Each error says what works instead.

The FSDP2 side of a probe (guarded trials, the reset after a failure) is torch-only and lives in
:mod:`retune.distributed.fsdp2`.
"""

from __future__ import annotations

from typing import Any

from retune.errors import RetuneError

_DDP = {"DDPStrategy", "DDPSpawnStrategy"}
# FSDP1 under its 2.x name and its 1.9 names (native and fairscale), which subclass DDPStrategy in part
_FSDP1 = {"FSDPStrategy", "DDPFullyShardedNativeStrategy", "DDPFullyShardedStrategy"}
# 1.9's other sharding strategies that subclass DDP(Spawn)Strategy: optimizer state or the model partitioned
_OTHER_SHARDED = {"DDPShardedStrategy", "DDPSpawnShardedStrategy", "ColossalAIStrategy"}
_MODEL_PARALLEL = "ModelParallelStrategy"
_POINT_TO_FSDP2 = (
    "Use Lightning's ModelParallelStrategy with FSDP2 instead: `strategy=ModelParallelStrategy("
    "data_parallel_size=<devices>, tensor_parallel_size=1)` and `fully_shard(...)` in your LightningModule's "
    "`configure_model()` (docs/guides/distributed.md, 'Sharded training (FSDP2)'); or DDP when the model "
    "fits one device."
)


def _class_names(strategy: Any) -> set[str]:
    return {cls.__name__ for cls in type(strategy).__mro__}


def strategy_kind(trainer: Any) -> str:
    """``single``, ``ddp``, ``fsdp2`` (ModelParallelStrategy, any world size), or the class name of
    a strategy retune refuses. DeepSpeed subclasses DDPStrategy, so it is named before DDP is matched."""
    names = _class_names(trainer.strategy)
    if "DeepSpeedStrategy" in names:
        return "DeepSpeedStrategy"
    if names & _FSDP1:
        return "FSDPStrategy"
    if names & _OTHER_SHARDED:
        return type(trainer.strategy).__name__
    if _MODEL_PARALLEL in names:
        return "fsdp2"
    if int(getattr(trainer, "world_size", 1)) <= 1:
        return "single"
    if names & _DDP:
        return "ddp"
    return type(trainer.strategy).__name__


def is_sharded(trainer: Any) -> bool:
    return strategy_kind(trainer) == "fsdp2"


def check_strategy(trainer: Any) -> None:
    """Refuse what retune cannot run correctly, with what to do instead (called at ``setup``)."""
    kind = strategy_kind(trainer)
    if kind in ("single", "ddp"):
        return
    if kind == "fsdp2":
        tp = tensor_parallel_size(trainer)
        if tp > 1:
            raise RetuneError(
                f"ScheduledBatchSizeFinder supports ModelParallelStrategy with FSDP2 data-parallel sharding only; "
                f"this run has tensor_parallel_size={tp}. The search treats every rank as a data-parallel "
                "replica (its own share of the samples, its own probe batches), while the ranks of a "
                "tensor-parallel group must all see the same batch. "
                "Use `ModelParallelStrategy(data_parallel_size=<devices>, tensor_parallel_size=1)` (note: "
                "Lightning's default `tensor_parallel_size='auto'` is tensor parallelism over all devices)."
            )
        return
    if kind == "FSDPStrategy":
        raise RetuneError(
            f"ScheduledBatchSizeFinder does not support {type(trainer.strategy).__name__} (FSDP1, deprecated by "
            "torch): it wraps the model, and probes would have to run through the wrapper. " + _POINT_TO_FSDP2
        )
    if kind == "DeepSpeedStrategy":
        raise RetuneError(
            "ScheduledBatchSizeFinder does not support DeepSpeedStrategy: the DeepSpeed engine owns the "
            "optimizer step and its partitioned state, which a probe cannot snapshot or restore. " + _POINT_TO_FSDP2
        )
    raise RetuneError(
        f"ScheduledBatchSizeFinder supports a single device, DDP (ddp, ddp_spawn) and ModelParallelStrategy "
        f"(FSDP2); {kind} is not supported. " + _POINT_TO_FSDP2
    )


def check_oom_trigger(trainer: Any) -> None:
    """The ``oom`` trigger re-runs a failed real step as micro-batches on the failing rank alone; under
    FSDP2 every micro-batch is a round of collectives all ranks must join, so it is refused."""
    if not is_sharded(trainer):
        return
    raise RetuneError(
        "the `oom` trigger is not supported under ModelParallelStrategy (FSDP2): it recovers a real step by "
        "re-running it as micro-batches on the rank that ran out of memory, but under FSDP2 every forward and "
        "backward is a round of collectives that all ranks must join. Remove `oom` from the schedule's "
        "triggers. What works instead: keep a safety margin below the largest size that fits (`search.margin`, "
        "or a `memory.budget`), probe with the longest samples (`search.probe_samples: largest`) so the size "
        "found fits every batch, and re-search when training changes (trainable_params_changed, epoch "
        "milestones); or train under DDP, where the `oom` trigger is supported."
    )


def tensor_parallel_size(trainer: Any) -> int:
    """The size of the mesh's ``tensor_parallel`` dimension (1 when the mesh has none)."""
    strategy = trainer.strategy
    mesh = getattr(strategy, "_device_mesh", None)
    if mesh is not None and "tensor_parallel" in (mesh.mesh_dim_names or ()):
        return int(mesh["tensor_parallel"].size())
    size = getattr(strategy, "_tensor_parallel_size", 1)
    if size == "auto":  # resolved in setup_environment(); before it, 'auto' means every device of the node
        return int(getattr(strategy, "num_processes", 1) or 1)
    return int(size)


__all__ = [
    "check_oom_trigger",
    "check_strategy",
    "is_sharded",
    "strategy_kind",
    "tensor_parallel_size",
]
