"""FSDP2 (``fully_shard``) around a probe: guarded trials, and a clean state after a failed step.

Probes under FSDP2 are full of collectives (all-gathers before each sharded module's forward and
backward, reduce-scatters after), so each trial runs inside a :class:`~retune.distributed.collective_guard.
CollectiveGuard` region: a rank that runs out of memory stops the others at their next collective
instead of leaving them waiting. After a failed step FSDP2's per-iteration state (half-unsharded
parameters, a backward callback still queued) is reset with ``reset_iter_state()``. Which strategies
are FSDP2 is Lightning's business and lives in :mod:`retune.compat.strategies`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from retune.distributed.collective_guard import CollectiveGuard
from retune.distributed.local_shards import is_sharded, local


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


def _param_groups(sub: torch.nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of one sharded module (one, or several with a per-parameter mesh)."""
    state = sub._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def unsharded_storages(module: torch.nn.Module) -> Callable[[], dict[int, int]] | None:
    """``current()``: the storages FSDP2 gathers ``module``'s parameters into, by key, with their size now; None
    without FSDP2.

    FSDP2 allocates and frees each parameter's unsharded storage by resizing it in place
    (``UntypedStorage.resize_`` in ``alloc_storage``/``free_storage``), which no dispatch mode sees: a CPU
    tracker counted the storage whole on the step that created it (the first, lazily), freed or not, and
    never on the steps after, which reuse it. :class:`retune.memory.CpuPeakTracker` reads their size at every
    operator instead."""
    params = [
        fsdp_param for sub in fsdp_modules(module) for group in _param_groups(sub) for fsdp_param in group.fsdp_params
    ]
    if not params:
        return None

    def current() -> dict[int, int]:
        sizes: dict[int, int] = {}
        for fsdp_param in params:
            for tensor in (*fsdp_param.all_gather_outputs, *getattr(fsdp_param, "_unsharded_inner_tensors", ())):
                storage = tensor.untyped_storage()
                sizes[storage._cdata] = storage.nbytes()
        return sizes

    return current


def why_not_traced(module: torch.nn.Module) -> str | None:
    """Why a fake trace of ``module``'s FSDP2 step (:func:`hooks_removed`) would not compute as the sharded step
    does (None: it would). A ``MixedPrecisionPolicy`` casts the parameters at each all-gather and the gradients
    at each reduce-scatter, which a trace of the plain module on its stored dtypes does not do."""
    for sub in fsdp_modules(module):
        policy = sub._get_fsdp_state()._mp_policy  # type: ignore[operator]
        casts = {name: getattr(policy, name) for name in ("param_dtype", "reduce_dtype") if getattr(policy, name, None)}
        stored = {p.dtype for p in sub.parameters()}
        if any(dtype not in stored for dtype in casts.values()):
            named = ", ".join(f"{name}={dtype}" for name, dtype in casts.items())
            return (
                f"FSDP2 with a MixedPrecisionPolicy ({named}) casts parameters and gradients at each collective, "
                "which the unsharded fake trace does not model"
            )
    return None


def _hook_ids(handle: Any) -> set[int]:
    """The hook ids behind FSDP2's forward hook handle (one ``RemovableHandle``, or several for grouped modules)."""
    handles = getattr(handle, "handles", None)
    if handles is not None:
        return {h.id for h in handles}
    return {handle.id} if handle is not None else set()


@contextmanager
def hooks_removed(module: torch.nn.Module) -> Iterator[None]:
    """FSDP2's forward hooks off inside the block: every sharded module runs as the plain module it wraps, on
    whatever parameters are in its ``_parameters`` (a fake trace puts whole-tensor fakes there), with no
    all-gather, no reduce-scatter and no FSDP2 state touched. Only FSDP2's own hooks are taken out; the
    user's stay, and every hook table is back as it was, in its order, afterwards (no collective)."""
    saved: list[tuple[dict[int, Any], dict[int, Any]]] = []
    try:
        for sub in fsdp_modules(module):
            state = sub._get_fsdp_state()  # type: ignore[operator]
            ids = _hook_ids(state._pre_forward_hook_handle) | _hook_ids(state._post_forward_hook_handle)
            owners = getattr(state, "_modules", None) or (sub,)  # torch < 2.6 keeps one module per state
            for owner in owners:
                for table in (owner._forward_pre_hooks, owner._forward_hooks):
                    if ids & table.keys():
                        saved.append((table, dict(table)))
                        for key in ids & table.keys():
                            del table[key]
        yield
    finally:
        for table, items in reversed(saved):
            table.clear()
            table.update(items)


@dataclass(frozen=True)
class ShardAccount:
    """What a rank holds of an FSDP2 step's state that does not grow with the batch, next to what a trace of
    the unsharded module (:func:`hooks_removed`) counts for it.

    A trace of the plain module on its per-rank batch counts the activations exactly (FSDP2 computes each
    module with its whole parameters), and the parameters, gradients and optimizer state whole. On a rank the
    parameters and optimizer state are shards (``resident``: read off the real shards), the gradients are
    shards once reduce-scattered (``gradients``), the state the first update creates is this rank's part of it
    (``fraction`` of the whole), and, while a module computes, its parameters are gathered whole and the next
    module's are being prefetched (``gathered``: the two largest groups' parameters). That last part is an
    estimate of what is gathered at the step's peak (where backward starts, every activation alive: the last
    group computing, the one before it prefetched; a group's whole gradients come later, when activations
    have been freed); the verifying probes measure the truth and the calibration corrects the constant.
    """

    resident: int
    gradients: int
    fraction: float
    gathered: int

    @classmethod
    def of(cls, module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer], resident: int) -> ShardAccount:
        params = list(module.parameters())
        whole = sum(p.numel() for p in params)
        shards = sum(local(p).numel() for p in params)
        trainable = [p for p in params if p.requires_grad]
        gradients = sum(local(p).numel() * p.element_size() for p in trainable)
        groups = sorted((_group_bytes(sub) for sub in fsdp_modules(module)), reverse=True)
        return cls(resident, gradients, shards / whole if whole else 1.0, sum(groups[:2]))

    def fixed(self, created_whole: int) -> int:
        """The bytes of a rank's steady step that do not grow with the batch, given the optimizer state the
        traced (unsharded) step created."""
        return self.resident + self.gradients + round(created_whole * self.fraction) + self.gathered


def _group_bytes(sub: torch.nn.Module) -> int:
    """The whole bytes of the parameters ``sub``'s FSDP2 group gathers: its own, less those of sharded modules
    inside it."""
    nested = {id(p) for inner in fsdp_modules(sub) if inner is not sub for p in inner.parameters()}
    return sum(p.numel() * p.element_size() for p in sub.parameters() if id(p) not in nested and is_sharded(p))


__all__ = [
    "ShardAccount",
    "ShardedTrials",
    "fsdp_modules",
    "hooks_removed",
    "reset_after_failure",
    "reshard",
    "unsharded_storages",
    "why_not_traced",
]
