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


def _states(module: torch.nn.Module) -> list[Any]:
    """Every FSDP2 state under ``module``, once each (``fully_shard([a, b])`` gives two modules one state)."""
    states: dict[int, Any] = {}
    for sub in fsdp_modules(module):
        state = sub._get_fsdp_state()  # type: ignore[operator]
        states.setdefault(id(state), state)
    return list(states.values())


def _param_groups(state: Any) -> list[Any]:
    """The parameter groups of one FSDP2 state (one, or several with a per-parameter mesh)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def _group_params(group: Any) -> list[Any]:
    """The ``FSDPParam`` records of one parameter group."""
    return list(getattr(group, "fsdp_params", ()))


def _state_params(state: Any) -> list[Any]:
    return [fp for group in _param_groups(state) for fp in _group_params(group)]


class _GatheredStorages:
    """``unsharded_storages``' reader: the storages are looked up while some parameter has none yet (FSDP2 makes
    them at its first all-gather and keeps them), then only their sizes are read."""

    def __init__(self, params: list[Any]) -> None:
        self.params = params
        self.storages: list[Any] = []
        self.complete = False

    def __call__(self) -> dict[int, int]:
        if not self.complete:
            tensors = [t for fp in self.params for t in _gathered_tensors(fp)]
            self.storages = list({id(s): s for s in (t.untyped_storage() for t in tensors)}.values())
            self.complete = all(getattr(fp, "all_gather_outputs", ()) for fp in self.params)
        return {storage._cdata: storage.nbytes() for storage in self.storages}


def _gathered_tensors(fsdp_param: Any) -> tuple[torch.Tensor, ...]:
    return (*getattr(fsdp_param, "all_gather_outputs", ()), *getattr(fsdp_param, "_unsharded_inner_tensors", ()))


def unsharded_storages(module: torch.nn.Module) -> Callable[[], dict[int, int]] | None:
    """``current()``: the storages FSDP2 gathers ``module``'s parameters into, by key, with their size now; None
    without FSDP2.

    FSDP2 allocates and frees each parameter's unsharded storage by resizing it in place
    (``UntypedStorage.resize_`` in ``alloc_storage``/``free_storage``), which no dispatch mode sees: a CPU
    tracker counted the storage whole on the step that created it (the first, lazily), freed or not, and
    never on the steps after, which reuse it. :class:`retune.memory.CpuPeakTracker` reads their size at every
    operator instead. Once every parameter has its storages (FSDP2's first all-gather makes them and keeps
    them), an operator pays one ``nbytes()`` per gathered storage."""
    params = [fp for state in _states(module) for fp in _state_params(state)]
    return _GatheredStorages(params) if params else None


def compute_dtypes(module: torch.nn.Module) -> dict[int, torch.dtype]:
    """The dtype FSDP2 gathers and computes each of ``module``'s parameters in, where a ``MixedPrecisionPolicy``
    casts it (its ``param_dtype``, other than the dtype it is stored in), by ``id`` of the sharded parameter."""
    return {
        id(fp.sharded_param): dtype
        for state in _states(module)
        for group in _param_groups(state)
        for fp in _group_params(group)
        if (dtype := _param_dtype(group, fp)) is not None
    }


def _param_dtype(group: Any, fsdp_param: Any) -> torch.dtype | None:
    """The dtype FSDP2 gathers ``fsdp_param`` in when its group's policy casts it, else None. FSDP2 sets
    ``FSDPParam.param_dtype`` at its lazy initialisation (the first forward), which a search at fit start
    precedes: read from the group's policy, with FSDP2's own rule (no cast to the stored dtype, none of a
    non-floating parameter)."""
    stored = fsdp_param.sharded_param.dtype
    policy = getattr(group, "mp_policy", None)
    dtype = getattr(policy, "param_dtype", None) if policy is not None else getattr(fsdp_param, "param_dtype", None)
    if dtype is None or dtype == stored or not stored.is_floating_point:
        return None
    return dtype  # type: ignore[no-any-return]


def gradient_shards(module: torch.nn.Module) -> dict[int, int]:
    """The bytes of each trainable parameter's gradient a rank keeps once FSDP2 reduce-scattered it (its shard, in
    the stored dtype; the whole gradient of a parameter FSDP2 does not shard), by ``id`` of the parameter."""
    return {id(p): local(p).numel() * p.element_size() for p in module.parameters() if p.requires_grad}


def why_not_traced(module: torch.nn.Module) -> str | None:
    """Why a fake trace of ``module``'s FSDP2 step (:func:`hooks_removed`) would not compute as the sharded step
    does (None: it would). The trace runs each sharded module as the plain module with FSDP2's forward hooks
    out of the way and its ``MixedPrecisionPolicy`` casts in their place (inputs to ``param_dtype``, outputs to
    ``output_dtype``: the policy's own methods), and the parameters faked in the dtype FSDP2 computes them in
    (:func:`compute_dtypes`). A torch whose FSDP2 keeps its forward hooks or those casts elsewhere cannot be
    traced. Nor can a group offloaded to the host on a device run (``CPUOffloadPolicy``): its shards, reduced
    gradients and optimizer state live in host memory, the update runs there, and the trace would make the whole
    parameters on the host beside a batch on the device (on a CPU run the host is the device: it traces)."""
    needed = ("_pre_forward_hook_handle", "_post_forward_hook_handle", "_modules")
    casts = ("_cast_forward_inputs", "_cast_output_dtype")
    names = {id(sub): name for name, sub in module.named_modules()}
    for state in _states(module):
        if not all(hasattr(state, name) for name in needed):
            return "this torch's FSDP2 keeps its forward hooks where retune does not look (no _pre_forward_hook_handle)"
        if _casts(state) != (False, False) and not all(callable(getattr(state, name, None)) for name in casts):
            return (
                "this torch's FSDP2 casts for its MixedPrecisionPolicy where retune does not look "
                "(no _cast_forward_inputs)"
            )
        if _offloaded_to_host(state):
            owners = [names.get(id(sub), type(sub).__name__) or "the root" for sub in getattr(state, "_modules", ())]
            return (
                f"FSDP2's CPUOffloadPolicy keeps the shards, reduced gradients and optimizer state of "
                f"{', '.join(owners) or 'a module'} in host memory while it computes on the device: a trace cannot "
                "split the step between the two"
            )
    return None


def _offloaded_to_host(state: Any) -> bool:
    """Whether ``CPUOffloadPolicy`` keeps a parameter of ``state``'s groups on the host while it computes on
    another device."""
    for group in _param_groups(state):
        for fsdp_param in _group_params(group):
            device = getattr(fsdp_param, "device", None)
            if getattr(fsdp_param, "offload_to_cpu", False) and getattr(device, "type", "cpu") != "cpu":
                return True
    return False


def _casts(state: Any) -> tuple[bool, bool]:
    """Whether FSDP2 casts a module's floating-point inputs (to ``param_dtype``) and its outputs (to
    ``output_dtype``) for this state's ``MixedPrecisionPolicy``."""
    policy = getattr(state, "_mp_policy", None)
    if policy is None:
        return False, False
    inputs = bool(getattr(policy, "cast_forward_inputs", False)) and getattr(policy, "param_dtype", None) is not None
    return inputs, getattr(policy, "output_dtype", None) is not None


def _inputs_cast(state: Any) -> Callable[..., Any]:
    def cast(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return state._cast_forward_inputs(args, kwargs)

    return cast


def _outputs_cast(state: Any) -> Callable[..., Any]:
    def cast(module: torch.nn.Module, args: Any, output: Any) -> Any:
        return state._cast_output_dtype(output)

    return cast


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
    all-gather, no reduce-scatter and no FSDP2 state touched. Where its ``MixedPrecisionPolicy`` casts the
    module's inputs or outputs in those hooks, the hook is swapped in place for the policy's own cast (no
    collective), so it runs where FSDP2's did, in the same order among the other hooks. Only FSDP2's own hooks
    are taken out or swapped, and only they are put back afterwards, each in its place in its table; a hook the
    block adds or removes stays added or removed."""
    removed: list[tuple[dict[int, Any], list[int], dict[int, Any]]] = []
    try:
        for state in _states(module):
            ids = _hook_ids(state._pre_forward_hook_handle) | _hook_ids(state._post_forward_hook_handle)
            inputs, outputs = _casts(state)
            for owner in getattr(state, "_modules", ()):
                for table, cast in ((owner._forward_pre_hooks, inputs), (owner._forward_hooks, outputs)):
                    keys = ids & table.keys()
                    if not keys:
                        continue
                    removed.append((table, list(table), {key: table[key] for key in keys}))
                    pre = table is owner._forward_pre_hooks
                    for key in keys:
                        if cast:  # FSDP2's hook casts here: the policy's cast, in its place
                            table[key] = _inputs_cast(state) if pre else _outputs_cast(state)
                        else:
                            del table[key]
        yield
    finally:
        for table, order, hooks in reversed(removed):
            now = dict(table)
            table.clear()
            for key in order:  # the order on entry; what the block removed stays out
                if key in hooks:
                    table[key] = hooks[key]
                    now.pop(key, None)  # a cast swapped in under FSDP2's key
                elif key in now:
                    table[key] = now.pop(key)
            table.update(now)  # what the block added, after


@dataclass(frozen=True)
class ShardAccount:
    """What a rank holds of an FSDP2 step's state that does not grow with the batch, next to what a trace of
    the unsharded module (:func:`hooks_removed`) counts for it.

    A trace of the plain module on its per-rank batch counts the activations exactly (FSDP2 computes each
    module with its whole parameters), the parameters (in the dtype FSDP2 computes them in) and optimizer state
    whole, and each gradient whole until it is accumulated, then as the rank's shard. On a rank the
    parameters and optimizer state are shards (``resident``: read off the real shards), the gradients are
    shards once reduce-scattered (``gradients``), the state the first update creates is this rank's part of it
    (``fraction`` of the whole), and, while a module computes, parameters are gathered whole (``gathered``, in
    the dtype FSDP2 gathers them in: a ``MixedPrecisionPolicy``'s ``param_dtype``): every group that is not
    resharded after forward (the root, by default) stays gathered into backward, and of the others the one
    computing and the one prefetched, taken as the two largest. That is an estimate; the verifying probes
    measure the truth and the calibration corrects the constant.
    """

    resident: int
    gradients: int
    fraction: float
    gathered: int
    reducing: int = 0
    """What FSDP2 allocates to reduce a group's gradients (the reduce-scatter's input: the group's whole gradients
    in the dtype it reduces in), for the largest trainable group, counted at the compute peak, where
    the largest group is not always the one reducing. An estimate: it leaves out dim-0 padding, the
    reduce-scatter's output and HSDP's all-reduce buffer."""

    @classmethod
    def of(cls, module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer], resident: int) -> ShardAccount:
        params = list(module.parameters())
        whole = sum(p.numel() for p in params)
        shards = sum(local(p).numel() for p in params)
        trainable = [p for p in params if p.requires_grad]
        gradients = sum(local(p).numel() * p.element_size() for p in trainable)
        kept, others, reducing = 0, [], 0
        for state in _states(module):
            for group in _param_groups(state):
                records = _group_params(group)
                size = sum(_gathered_bytes(group, fp) for fp in records)
                if getattr(group, "post_forward_mesh_info", True) is None:  # not resharded after forward
                    kept += size
                else:
                    others.append(size)
                reducing = max(reducing, sum(_reduced_bytes(group, fp) for fp in records))
        fraction = shards / whole if whole else 1.0
        return cls(resident, gradients, fraction, kept + sum(sorted(others)[-2:]), reducing)

    def fixed(self, created_whole: int) -> int:
        """The bytes of a rank's steady step that do not grow with the batch, given the optimizer state the
        traced (unsharded) step created."""
        return self.resident + self.gradients + round(created_whole * self.fraction) + self.gathered + self.reducing


def _reduced_bytes(group: Any, fsdp_param: Any) -> int:
    """The bytes of a trainable parameter's whole gradient in the dtype FSDP2 reduce-scatters it in (the policy's
    ``reduce_dtype``, else the dtype it is computed in)."""
    tensor = fsdp_param.sharded_param
    if not is_sharded(tensor) or not tensor.requires_grad:
        return 0
    policy = getattr(group, "mp_policy", None)
    dtype = getattr(policy, "reduce_dtype", None) or _param_dtype(group, fsdp_param) or tensor.dtype
    return int(tensor.numel() * dtype.itemsize)


def _gathered_bytes(group: Any, fsdp_param: Any) -> int:
    """The bytes of a parameter gathered whole, in the dtype FSDP2 gathers it in (a ``DTensor``'s ``numel()`` is
    the whole tensor's)."""
    tensor = fsdp_param.sharded_param
    if not is_sharded(tensor):
        return 0
    dtype = _param_dtype(group, fsdp_param) or tensor.dtype
    return int(tensor.numel() * dtype.itemsize)


__all__ = [
    "ShardAccount",
    "ShardedTrials",
    "compute_dtypes",
    "gradient_shards",
    "fsdp_modules",
    "hooks_removed",
    "reset_after_failure",
    "reshard",
    "unsharded_storages",
    "why_not_traced",
]
