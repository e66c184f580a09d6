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
from typing import Any

import numpy as np
import torch

__all__ = ["preserved_rng", "sampler_generators"]


@contextmanager
def preserved_rng(generators: Iterable[torch.Generator] = ()) -> Iterator[None]:
    """Put back Python's, NumPy's and torch's global RNG (and CUDA's, once initialised) and the given
    generators after the block, so what it drew leaves the run's random streams where they were."""
    py_state = random.getstate()
    np_state = np.random.get_state()
    torch_state = torch.get_rng_state()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    cuda_states = torch.cuda.get_rng_state_all() if cuda else None
    own = [(g, g.get_state()) for g in generators]
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        for generator, state in own:
            generator.set_state(state)


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
