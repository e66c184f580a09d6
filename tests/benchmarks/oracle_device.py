"""A "limited device" on CPU: a fixed memory capacity that raises the real CUDA out-of-memory error.

There is no GPU here, so the benchmark runs every training step on CPU inside
:class:`CapacityOracle`, a ``TorchDispatchMode`` that sees every tensor an operator returns while it
is active. Live bytes are

    base  (the model's parameters and buffers, which existed before the mode was entered)
  + every CPU tensor storage created while the mode is active and still alive

counted with the technique of ``retune.memory.CpuPeakTracker``: each new storage once, keyed by
``untyped_storage()._cdata``, and uncounted by a ``weakref.finalize`` when the storage is freed.
The oracle is an independent implementation, so a bug in retune's tracker shows up as a gap
between the two (the benchmark records both peaks for every harness probe).
When an operator's new storages would push live bytes over the capacity, the oracle raises

    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate N bytes (simulated device, ...)")

which both retune and Lightning's ``BatchSizeFinder`` (``is_oom_error``: a one-argument
``RuntimeError`` whose text contains "CUDA" and "out of memory") treat as a device OOM. The
operator's outputs are dropped with the exception, so they are uncounted at once.

Decisions (all apply equally to retune and Lightning; see tests/benchmarks/README.md):

* **Only new storages count.** An output that shares its storage with one of the operator's inputs
  (in-place ops, ``out=`` ops, views) is no new memory. The inputs' storages are read *before*
  the operator runs, so ``t.set_(storage)`` (how ``torch.load`` builds tensors) counts the loaded
  storage. Tensors created before the mode (the dataset, the model) are never counted again when an
  in-place op (an optimizer step) returns them.
* **Host memory is not device memory.** On a GPU some tensors a run creates live in host memory;
  on this CPU they would all be charged, so they are made inside :func:`host_memory`, where no
  dispatch mode sees them:

  - the dataloader's batches: the benchmark's dataset and sampler build them inside
    :func:`host_memory`, and the model's ``transfer_batch_to_device`` hook calls
    :func:`to_device`, which starts charging the batch's storages (without copying them: on a
    real CPU run the transfer is a no-op too, which is what retune's CPU accounting expects).
    From then on the batch is device memory until it is freed, like the device copy of a GPU
    run. Without this, a batch a loop merely holds on to (Lightning's fetcher prefetches the next
    one) would be charged, which on a GPU it is not;
  - retune's snapshot: on a GPU its copies (``retune.probing.snapshot.host_copies``, device to host)
    take no device memory; on CPU they would be CPU tensors, so :func:`host_copies_off_device`
    makes them in :func:`host_memory`, and has gradients copied like the rest rather than held by
    reference (as on a GPU). Restoring writes them back in place (no new storage), except a
    gradient that must be re-created, which is charged.
* **Lightning's checkpoint.** ``torch.save`` writes to disk and allocates nothing. ``torch.load``
  builds new storages, and the oracle charges them: on a GPU Lightning's finder restores with
  ``map_location`` = the strategy's root device, so the loaded checkpoint does occupy device memory
  until ``load_state_dict`` has copied it in (optimizer state loaded that way *becomes* the state).
* **No allocator effects.** No block rounding, caching or fragmentation: the capacity is a sharp
  limit on live tensor bytes, so the true maximum batch size is exact.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves


def resident_storage_bytes(modules: Iterable[nn.Module]) -> tuple[int, set[int]]:
    """Bytes of the parameters and buffers of ``modules``, each storage once, and their storage keys."""
    seen: dict[int, int] = {}
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            storage = tensor.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values()), set(seen)


_ACTIVE: list[CapacityOracle] = []


def to_device(batch: Any) -> Any:
    """The host-to-device transfer of ``batch``, emulated: charge its storages to the active oracle.

    Raises the simulated OOM, and charges nothing, when the batch does not fit.
    """
    tensors = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    for oracle in _ACTIVE:
        oracle.charge(tensors)
    return batch


@contextmanager
def host_memory() -> Iterator[None]:
    """Tensors created in this block are host memory: no dispatch mode sees them.

    Every active mode is set aside, the oracle *and* retune's own ``CpuPeakTracker``: on a GPU
    neither the device nor CUDA's memory statistics see a host tensor.
    """
    with _disable_current_modes():
        yield


class CapacityOracle(TorchDispatchMode):  # type: ignore[misc]
    """Raise ``torch.OutOfMemoryError`` when live tensor bytes would exceed ``capacity_bytes``.

    Enter it around the whole run (``with oracle: trainer.fit(model)``); ``resident`` are the modules
    whose parameters and buffers are already on the simulated device (the fixed base).
    """

    def __init__(self, capacity_bytes: int, resident: Iterable[nn.Module] = ()) -> None:
        super().__init__()
        self.capacity = int(capacity_bytes)
        self.base, self._resident_keys = resident_storage_bytes(resident)
        self.tracked = 0
        self.peak = self.base
        self.ooms = 0
        self._live: dict[int, int] = {}

    def __enter__(self) -> CapacityOracle:
        _ACTIVE.append(self)
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        super().__exit__(*exc)

    @property
    def live_bytes(self) -> int:
        return self.base + self.tracked

    def reset_peak(self) -> None:
        self.peak = self.live_bytes

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        inputs = {
            leaf.untyped_storage()._cdata
            for leaf in tree_leaves((args, kwargs))
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu"
        }
        out = func(*args, **kwargs)
        allocated = sum(
            self._track(leaf, inputs)
            for leaf in tree_leaves(out)
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu"
        )
        if allocated and self.live_bytes > self.capacity:
            self.ooms += 1
            del out  # the new storages die here: uncounted before the caller sees the error
            raise self._error(allocated)
        self.peak = max(self.peak, self.live_bytes)
        return out

    def charge(self, tensors: Iterable[torch.Tensor]) -> None:
        """Start charging existing storages (a batch arriving on the device); OOM if they do not fit."""
        keys = []
        for tensor in tensors:
            if self._track(tensor, set()):
                keys.append(tensor.untyped_storage()._cdata)
        if keys and self.live_bytes > self.capacity:
            allocated = sum(self._live[key] for key in keys)
            for key in keys:
                self._release(key)
            self.ooms += 1
            raise self._error(allocated)
        self.peak = max(self.peak, self.live_bytes)

    def _error(self, allocated: int) -> torch.OutOfMemoryError:
        live = self.live_bytes
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {allocated} bytes (simulated device, capacity "
            f"{self.capacity} bytes, {live} bytes live, {self.capacity - live} bytes free)"
        )

    def _track(self, tensor: torch.Tensor, inputs: set[int]) -> int:
        storage = tensor.untyped_storage()
        key = storage._cdata
        nbytes = storage.nbytes()
        if nbytes == 0 or key in inputs or key in self._live or key in self._resident_keys:
            return 0  # a view, an in-place or out= result, or memory already counted
        self._live[key] = nbytes
        self.tracked += nbytes
        weakref.finalize(storage, self._release, key)
        return nbytes

    def _release(self, key: int) -> None:
        self.tracked -= self._live.pop(key, 0)


@contextmanager
def host_copies_off_device() -> Iterator[None]:
    """Keep retune's snapshot off the simulated device, as it is off a real GPU.

    On a GPU the snapshot copies device tensors into host memory (``retune.probing.snapshot.host_copies``)
    and copies device gradients too, so it takes no device memory. On this CPU-only machine the
    copies would be CPU tensors the oracle charges, and host-resident tensors are held instead of
    copied (``retune.probing.snapshot._host_resident``: gradients set aside, parameters and optimizer state
    moved onto uncharged copies while the charged originals stay alive). The benchmark (and only the
    benchmark) makes both behave as on a GPU: the copies are made with the oracle paused, and every
    tensor is copied off the device and written back in place.
    """
    import retune.probing.snapshot as snapshot

    original = snapshot.host_copies

    def host_copies(tensors: Any) -> list[torch.Tensor]:
        with host_memory():
            return original(tensors)

    original_resident = snapshot._host_resident
    snapshot.host_copies = host_copies  # type: ignore[assignment]
    snapshot._host_resident = lambda tensor: False
    try:
        yield
    finally:
        snapshot.host_copies = original
        snapshot._host_resident = original_resident


@contextmanager
def simulated_device(capacity_bytes: int, resident: Iterable[nn.Module]) -> Iterator[CapacityOracle]:
    """The oracle entered, with retune's host copies kept off it."""
    oracle = CapacityOracle(capacity_bytes, resident)
    with host_copies_off_device(), oracle:
        yield oracle
