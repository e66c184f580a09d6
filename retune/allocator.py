"""What a device's caching allocator lets this process have, and whether a probe's peaks fit in it.

A probe's verdict must hold for the real steps that follow it (issue 27: a size that fit in a probe
ran out of memory in training with "1.48 GiB is allocated by PyTorch, and 215.14 MiB is reserved by
PyTorch but unallocated"). On a caching allocator three numbers decide that, not one:

* **allocated** bytes (what tensors use) peak at what the step needs;
* **reserved** bytes (what the allocator holds from the device: allocated plus cached blocks that
  fit no request) peak higher, and it is reserved memory that runs out;
* the **limit** is what this process can really get: the device's free memory plus what this
  process already holds (``mem_get_info``'s free already excludes what other processes and every
  CUDA context hold), capped by the per-process memory fraction
  (``torch.cuda.set_per_process_memory_fraction``), not the device's ``total_memory``.

A size fits only if its peak reserved is within the limit, and its peak allocated leaves room for
the fragmentation this search *measured*: the largest reserved-but-unallocated bytes at the end of
a trial that completed (the blocks the step's pattern left cached and unusable). Training starts
from another allocator state than the probe did (other block sizes cached, the probes' own
leftovers), and that fragmentation is what it costs; it is measured in this process, with this
model's block sizes, not guessed as a percentage. ``expandable_segments`` (PyTorch's allocator
setting, ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) removes most of it; retune detects
it (:func:`expandable_segments`) and advises it at fit start when ``margin: 0`` (or ``mode: power``,
which applies no margin) leaves no other slack, but does not set it: it takes effect only when set
before the process's first CUDA allocation, which a callback cannot guarantee.

The statistics come from a :class:`MemoryStats` provider, so the limit and verdict logic can be
tested with any numbers on a machine without a GPU (:func:`use_memory_stats`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class AllocatorReading:
    """One reading of a caching allocator's counters, in bytes (peaks since the last reset)."""

    allocated: int
    """Bytes held by live tensors now (``memory_allocated``)."""
    reserved: int
    """Bytes the caching allocator holds from the device now, in use or cached (``memory_reserved``)."""
    peak_allocated: int
    """Highest ``allocated`` since the last peak reset (``max_memory_allocated``)."""
    peak_reserved: int
    """Highest ``reserved`` since the last peak reset (``max_memory_reserved``)."""


class MemoryStats(Protocol):
    """A device allocator's statistics: what :class:`CudaMemoryStats` reads from torch, or a test's numbers."""

    def reset_peaks(self) -> None:
        """Start a new peak measurement (``torch.cuda.reset_peak_memory_stats``)."""

    def read(self) -> AllocatorReading:
        """The allocator's counters now (call after the device finished its queued work)."""

    def device_free_and_total(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the device (``torch.cuda.mem_get_info``): free excludes every process's use."""

    def process_fraction(self) -> float:
        """The share of the device this process may reserve (``set_per_process_memory_fraction``; 1.0 unset)."""


class CudaMemoryStats:
    """:class:`MemoryStats` of one CUDA device, from torch's own counters.

    Args:
        device: the CUDA device whose counters to read.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset_peaks(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> AllocatorReading:
        torch.cuda.synchronize(self.device)
        return AllocatorReading(
            allocated=int(torch.cuda.memory_allocated(self.device)),
            reserved=int(torch.cuda.memory_reserved(self.device)),
            peak_allocated=int(torch.cuda.max_memory_allocated(self.device)),
            peak_reserved=int(torch.cuda.max_memory_reserved(self.device)),
        )

    def device_free_and_total(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def process_fraction(self) -> float:
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.5
        return 1.0 if getter is None else float(getter(self.device))


def _default_stats(device: torch.device) -> MemoryStats | None:
    return CudaMemoryStats(device) if device.type == "cuda" else None


_provider: Callable[[torch.device], MemoryStats | None] = _default_stats


def stats_for(device: torch.device) -> MemoryStats | None:
    """The allocator statistics of ``device``, or None where it has none (CPU: the peak tracker measures there).

    Args:
        device: the device a probe runs on.
    """
    return _provider(device)


@contextmanager
def use_memory_stats(provider: Callable[[torch.device], MemoryStats | None]) -> Iterator[None]:
    """Read allocator statistics from ``provider`` inside the block (tests: a simulated caching allocator).

    Args:
        provider: ``provider(device) -> MemoryStats | None``, used instead of CUDA's counters inside the block.
    """
    global _provider
    previous, _provider = _provider, provider
    try:
        yield
    finally:
        _provider = previous


def process_limit(stats: MemoryStats) -> int:
    """The bytes this process can reserve: free device memory plus its own reserved, within its fraction.

    Args:
        stats: the device allocator's statistics.

    Example (an H200 shared with another process, this one capped at 2 GiB):
        >>> GiB = 2**30
        >>> class Shared:
        ...     def read(self): return AllocatorReading(0, GiB // 4, 0, 0)
        ...     def device_free_and_total(self): return 140 * GiB - 30 * GiB - GiB // 4, 140 * GiB
        ...     def process_fraction(self): return 2 / 140
        ...     def reset_peaks(self): pass
        >>> process_limit(Shared()) / GiB
        2.0
    """
    free, total = stats.device_free_and_total()
    reachable = free + stats.read().reserved  # what other processes and the CUDA contexts hold is not free
    fraction = stats.process_fraction()
    capped = int(total * fraction) if 0.0 < fraction < 1.0 else total
    return min(reachable, capped)


def checked_peak(peak_allocated: int, peak_reserved: int | None, headroom: int) -> int:
    """The bytes a probe's verdict compares with the limit: its allocated peak plus the measured ``headroom``, or
    its reserved peak where that is higher (:func:`fits_within`). A search that draws a line through probes' peaks
    (``mode: model``, ``search.predict``) draws it through this: through the allocated peaks alone, a size can
    fail with a peak far below the limit (fragmentation measured as headroom), and the line keeps proposing
    sizes it says fit (seen on an H100: 23 probes where 5 do).

    Example:
        >>> MiB = 2**20
        >>> checked_peak(1400 * MiB, 1500 * MiB, 215 * MiB) // MiB
        1615
        >>> checked_peak(1400 * MiB, None, 0) // MiB   # no caching allocator (a CPU): the peak itself
        1400
    """
    return max(peak_allocated + headroom, peak_reserved or 0)


def fits_within(peak_allocated: int, peak_reserved: int | None, limit: int, headroom: int) -> bool:
    """Whether a probe's peaks fit: reserved within ``limit``, and allocated leaving ``headroom`` for fragmentation.

    Args:
        peak_allocated: the probe's peak allocated bytes.
        peak_reserved: the probe's peak reserved bytes (None: no caching allocator, as on the CPU).
        limit: the bytes a step may use (the budget, or :func:`process_limit`).
        headroom: bytes kept free for fragmentation, measured after the trials.

    Example (the issue's numbers, 2 GiB limit, 215 MiB measured unusable):
        >>> GiB, MiB = 2**30, 2**20
        >>> fits_within(int(1.9 * GiB), int(1.95 * GiB), 2 * GiB, 215 * MiB)
        False
        >>> fits_within(int(1.7 * GiB), int(1.8 * GiB), 2 * GiB, 215 * MiB)
        True
    """
    return checked_peak(peak_allocated, peak_reserved, headroom) <= limit


def expandable_segments() -> bool:
    """Whether PyTorch's CUDA allocator runs with ``expandable_segments:True`` (read from the environment).

    ``PYTORCH_ALLOC_CONF`` (torch >= 2.9) takes precedence over ``PYTORCH_CUDA_ALLOC_CONF``, as in torch.
    """
    conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    for option in conf.split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() in ("true", "1")
    return False


EXPANDABLE_ADVICE = (
    "search.margin is 0 (or search.mode is power, which applies no margin) on a CUDA device without "
    "PyTorch's expandable_segments: training starts from "
    "another caching-allocator state than the probes (blocks cached at other sizes), and fragmentation "
    "can make a size that fit in a probe run out of memory. retune keeps the fragmentation it measured "
    "as headroom, but to remove most of it set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torch "
    ">= 2.9 also reads PYTORCH_ALLOC_CONF) before the process starts, or give the search a margin (0.05), "
    "or add the `oom` trigger so a step that still runs out of memory is recovered"
)


__all__ = [
    "EXPANDABLE_ADVICE",
    "AllocatorReading",
    "CudaMemoryStats",
    "MemoryStats",
    "expandable_segments",
    "fits_within",
    "process_limit",
    "stats_for",
    "use_memory_stats",
]
