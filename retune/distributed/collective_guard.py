"""Collectives that a rank failing between them cannot hang: every collective first agrees on failure.

Under FSDP2 a step is full of collectives: each sharded module all-gathers its parameters before
its forward and backward and reduce-scatters its gradients after. When one rank runs out of memory
between two of them, the others wait in the next one for a rank that will never come. A search
provokes exactly that on purpose: its largest trials are meant to fail, on one rank or on all.

So while a trial runs, every collective from ``torch.distributed`` is preceded by a *status
all-reduce*: one float, 0 from every rank that is still running. A rank whose step raises (out of
memory or anything else) leaves the guarded region through :meth:`CollectiveGuard.failed`, which
contributes 1 to the status all-reduce the others are waiting in (or are about to enter); they see
a non-zero sum and raise :class:`PeerFailed` instead of issuing the real collective. A rank that
finishes the region calls :meth:`CollectiveGuard.finished`, one last status all-reduce that matches
a late failure on another rank. Every rank therefore runs the same number of status all-reduces and
leaves the region at the same point, and no real collective is issued unless every rank reached it.

Why this is sound: collectives are matched by order. Until a failure every rank runs the same
collectives in the same order (the same model and batch size everywhere), so each rank's k-th status
all-reduce is every other rank's k-th. A rank that fails does exactly one more, as its k-th; the
others cannot have got past their k-th without it.

What it covers: the collectives issued through the ``torch.distributed`` functions (FSDP2's
all-gathers and reduce-scatters, Lightning's ``sync_dist`` reductions) and through the functional
collectives of ``torch.distributed._functional_collectives``, which DTensor redistributes with (the
all-reduce that turns the partial norms of ``clip_grad_norm_`` over sharded gradients into one norm,
``DTensor.full_tensor()``). Both are module attributes looked up at each call, so swapping them for
the region reaches every caller. A collective issued by C++ directly (none in FSDP2's eager path)
would bypass it.

What it costs: one 4-byte all-reduce per collective, only inside a guarded region (probe steps).
Pure torch; the Lightning side is in :mod:`retune.compat.strategies`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

funcol: Any
try:  # DTensor's collectives (torch >= 2.2); absent from some builds
    import torch.distributed._functional_collectives as funcol
except ImportError:  # pragma: no cover - every supported torch has it
    funcol = None

# the torch.distributed functions FSDP2 and Lightning issue collectives through (those that exist)
GUARDED = (
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
)
# the functional collectives DTensor redistributes with (those that exist in the installed torch)
GUARDED_FUNCTIONAL = (
    "all_gather_into_tensor_coalesced",
    "all_gather_single",
    "all_gather_single_autograd",
    "all_gather_single_coalesced",
    "all_gather_tensor",
    "all_gather_tensor_autograd",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all_single",
    "all_to_all_single_autograd",
    "broadcast",
    "permute_tensor",
    "reduce_scatter_single",
    "reduce_scatter_single_autograd",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd",
    "reduce_scatter_tensor_coalesced",
)


class PeerFailed(RuntimeError):
    """Another rank failed inside the guarded region; this rank stopped with it instead of waiting."""

    def __init__(self, failures: int) -> None:
        super().__init__(
            f"{failures} other rank(s) failed in this step; this rank stopped with them instead of waiting "
            "in a collective"
        )
        self.failures = failures


class CollectiveGuard:
    """Guards the collectives of one region (one trial): see the module docstring.

    Use :meth:`region`; or, by hand, :meth:`enter`, then exactly one of :meth:`finished` (the region
    ended normally) or :meth:`failed` (it raised anything but :class:`PeerFailed`).
    """

    def __init__(self, group: Any = None, device: torch.device | None = None) -> None:
        self.group = group
        self.device = device or torch.device("cpu")
        self.status_calls = 0
        self._originals: dict[tuple[Any, str], Callable[..., Any]] = {}
        self._local = threading.local()  # re-entrancy: a guarded collective may call another one

    def _status(self, value: float) -> int:
        """One status all-reduce through the original function; returns how many ranks failed."""
        self.status_calls += 1
        flag = torch.tensor([value], device=self.device, dtype=torch.float32)
        all_reduce: Callable[..., Any] = self._originals.get((dist, "all_reduce"), dist.all_reduce)
        all_reduce(flag, group=self.group)
        return int(flag.item())

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "inside", False):
                return original(*args, **kwargs)  # the outer collective was agreed already
            failures = self._status(0.0)
            if failures:
                raise PeerFailed(failures)
            self._local.inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self._local.inside = False

        return guarded

    def enter(self) -> None:
        """Route every collective of ``torch.distributed`` and of DTensor through the status check."""
        if self._originals:
            raise RuntimeError("CollectiveGuard.enter() called twice")
        targets = [(dist, GUARDED), *([(funcol, GUARDED_FUNCTIONAL)] if funcol is not None else [])]
        for module, names in targets:
            for name in names:
                original = getattr(module, name, None)
                if original is None:
                    continue
                self._originals[(module, name)] = original
                setattr(module, name, self._wrap(original))

    def _leave(self) -> None:
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        self._originals.clear()

    def finished(self) -> int:
        """The region ended normally here: the closing status all-reduce. Returns how many ranks failed."""
        self._leave()
        return self._status(0.0)

    def failed(self) -> None:
        """The region raised here (not :class:`PeerFailed`): tell the others, in the status all-reduce they wait in."""
        self._leave()
        self._status(1.0)

    @contextmanager
    def region(self, on_failure: Callable[[], None] = lambda: None) -> Iterator[None]:
        """Guard the body; raise :class:`PeerFailed` when another rank failed and this one did not.

        ``on_failure`` runs first on every rank that leaves the region by an exception (its own, or
        :class:`PeerFailed`), before the others are told: it puts the sharded module back in order
        (no collective may run in it).
        """
        self.enter()
        try:
            yield
        except PeerFailed:
            self._leave()
            on_failure()
            raise
        except BaseException:
            try:
                on_failure()
            finally:
                self.failed()
            raise
        failures = self.finished()
        if failures:
            on_failure()
            raise PeerFailed(failures)


__all__ = ["GUARDED", "GUARDED_FUNCTIONAL", "CollectiveGuard", "PeerFailed"]
