"""Wall-clock timing of probe steps (``search.objective: throughput``), with the device synchronised.

Accelerators run kernels asynchronously: a step's Python code returns long before its kernels
finish, so a timer read without synchronising measures how fast work was queued, not done. Each
timed step synchronises the device before it starts the clock and again before it stops it. The
clock is injectable so that tests (and simulations) can give every step a known duration.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

Clock = Callable[[], float]
"""Seconds as a float, monotonic: ``time.perf_counter`` unless a test injects its own."""

default_clock: Clock = time.perf_counter


def synchronize(device: torch.device) -> None:
    """Wait for every kernel queued on ``device`` (nothing to wait for on a CPU)."""
    if device.type == "cpu":
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6: mps, xpu and others
    if accelerator is not None and callable(getattr(accelerator, "synchronize", None)):
        accelerator.synchronize(device)
        return
    backend = getattr(torch, device.type, None)
    sync = getattr(backend, "synchronize", None)
    if callable(sync):
        sync()


@contextmanager
def timed(device: torch.device, clock: Clock, into: list[float]) -> Iterator[None]:
    """Append the seconds the block took to ``into``; nothing when it raises (an out-of-memory step)."""
    synchronize(device)
    started = clock()
    yield
    synchronize(device)
    into.append(clock() - started)


def steady(step_seconds: Sequence[float] | None) -> list[float]:
    """The steps of a trial that count: all but the first, which warms up."""
    return list(step_seconds[1:]) if step_seconds else []


def samples_per_second(size: int, step_seconds: Sequence[float]) -> float | None:
    """``size`` over the median step time (None without a positive timing)."""
    if not step_seconds:
        return None
    median = statistics.median(step_seconds)
    return size / median if median > 0 else None


__all__ = ["Clock", "default_clock", "samples_per_second", "steady", "synchronize", "timed"]
