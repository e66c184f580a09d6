"""The process's global random streams, put back after a block that should not move them.

Reading samples, tracing a step on fake tensors, re-running a forward to check it, or rebuilding a
dataloader all draw from the global generators (a ``DataLoader`` iterator draws its base seed from torch's,
a dataset's ``__getitem__`` or a ``*_dataloader()`` hook may draw from Python's or NumPy's); a run without
retune never makes those draws, so after them every later shuffle and dropout mask would differ.

Example:
    >>> import torch
    >>> with preserved_rng():
    ...     _ = torch.rand(3)
    >>> before = torch.get_rng_state()
    >>> with preserved_rng():
    ...     _ = torch.rand(3)
    >>> torch.equal(before, torch.get_rng_state())
    True
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["RngStates", "keep_run_draw", "preserved_rng", "sampler_generators"]


@dataclass(frozen=True)
class RngStates:
    """Python's, NumPy's, torch's (and CUDA's, once initialised) global RNG states and some generators' states, as
    they were when :meth:`capture` ran; :meth:`restore` sets them back."""

    python: Any
    numpy: Any
    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None
    own: tuple[tuple[torch.Generator, torch.Tensor], ...]

    @classmethod
    def capture(cls, generators: Iterable[torch.Generator] = ()) -> RngStates:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        return cls(
            random.getstate(),
            np.random.get_state(),
            torch.get_rng_state(),
            torch.cuda.get_rng_state_all() if cuda else None,
            tuple((g, g.get_state()) for g in generators),
        )

    def restore(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        for generator, state in self.own:
            generator.set_state(state)


_kept: list[list[RngStates]] = []  # per open preserved_rng block, innermost last: the run's draws made inside it


@contextmanager
def preserved_rng(generators: Iterable[torch.Generator] = ()) -> Iterator[None]:
    """Put back Python's, NumPy's and torch's global RNG (and CUDA's, once initialised) and the given
    generators after the block, so what it drew leaves the run's random streams where they were.

    Except a draw the run itself makes (:func:`keep_run_draw`): the streams are then left where that draw left
    them, in this block and every block around it."""
    before = RngStates.capture(generators)
    _kept.append([])
    try:
        yield
    finally:
        kept = _kept.pop()
        before.restore()
        if kept:
            kept[-1].restore()
            if _kept:
                _kept[-1].append(kept[-1])


def keep_run_draw(generators: Iterable[torch.Generator] = ()) -> None:
    """Say that the draw just made is the run's own, not a probe's or a rebuild's: every :func:`preserved_rng`
    block open now leaves the streams as they are at this call (and ``generators``) when it ends.

    The draw of an epoch's samples from the user's sampler (``retune.buckets.drawn``) is made when Lightning
    first asks the loader's length, and that may be while a dataloader is rebuilt at a new size, inside a block
    that puts the streams back: rolled back, the next epoch would draw the same samples again. A call outside any
    block does nothing (nothing will put the streams back). What ran in the block before the draw (a
    ``*_dataloader()`` hook that draws) is kept with it."""
    if _kept:
        _kept[-1].append(RngStates.capture(generators))


def sampler_generators(loader: Any) -> list[torch.Generator]:
    """Generators a dataloader draws from when iterated (its own, its sampler's, its batch sampler's).

    A datamodule that keeps one generator and hands it to every dataloader it builds would otherwise
    see the probe's draws shift the next epoch's shuffle order.
    """
    found: list[torch.Generator] = []
    candidates = [loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)]
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is not None:
        candidates.append(getattr(batch_sampler, "sampler", None))
    for obj in candidates:
        generator = getattr(obj, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found
