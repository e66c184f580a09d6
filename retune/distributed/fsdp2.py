"""FSDP2 (``fully_shard``) around a probe: guarded trials, and a clean state after a failed step.

Probes under FSDP2 are full of collectives (all-gathers before each sharded module's forward and
backward, reduce-scatters after), so each trial runs inside a :class:`~retune.distributed.collective_guard.
CollectiveGuard` region: a rank that runs out of memory stops the others at their next collective
instead of leaving them waiting. After a failed step FSDP2's per-iteration state (half-unsharded
parameters, a backward callback still queued) is reset with ``reset_iter_state()``. Which strategies
are FSDP2 is Lightning's business and lives in :mod:`retune.compat.strategies`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from retune.distributed.collective_guard import CollectiveGuard


def fsdp_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules ``fully_shard`` was applied to (FSDP2 makes each an ``FSDPModule``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6 or without distributed
        return []
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def reshard(module: torch.nn.Module) -> None:
    """Put every FSDP2 module's parameters back to their shards (no collective).

    A forward without backward (validation) leaves the root's parameters unsharded when the root does
    not reshard after forward; the snapshot must see the sharded parameters, which are the ones the
    optimizer updates.
    """
    for sub in fsdp_modules(module):
        sub.reshard()  # type: ignore[operator]


def reset_after_failure(module: torch.nn.Module) -> None:
    """Bring FSDP2 back to a clean state after a step raised in forward or backward (no collective).

    ``reset_iter_state()`` on the root waits for in-flight all-gathers and reduce-scatters (every
    rank issued them, so they complete), reshards every group and clears the per-iteration state a
    failed backward leaves behind (training states, the queued final callback). Without it the next
    step would train with stale state. Torch builds without it get a reshard of every module.
    """
    modules = fsdp_modules(module)
    roots = [m for m in modules if getattr(m._get_fsdp_state(), "_is_root", None)]  # type: ignore[operator]
    if roots and all(hasattr(m, "reset_iter_state") for m in roots):
        for root in roots:
            root.reset_iter_state()  # type: ignore[operator]
        return
    for sub in modules:
        sub.reshard()  # type: ignore[operator]


class ShardedTrials:
    """What each probe trial under FSDP2 runs inside: see the module docstring.

    ``session()`` once around a search (reshards what validation left unsharded before the snapshot);
    ``trial()`` around each trial: a guarded region on more than one rank, and the FSDP2 reset after
    a failure on every rank.
    """

    def __init__(self, pl_module: torch.nn.Module, world_size: int, device: torch.device) -> None:
        self.pl_module = pl_module
        self.distributed = world_size > 1
        self.device = device

    def prepare(self) -> None:
        reshard(self.pl_module)

    @contextmanager
    def trial(self) -> Iterator[None]:
        def on_failure() -> None:
            reset_after_failure(self.pl_module)

        if not self.distributed:
            try:
                yield
            except BaseException:
                on_failure()
                raise
            return
        with CollectiveGuard(device=self.device).region(on_failure=on_failure):
            yield


__all__ = ["ShardedTrials", "fsdp_modules", "reset_after_failure", "reshard"]
