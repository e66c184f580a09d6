"""torch's random generators around a training step that runs out of memory (no Lightning here).

A step draws from torch's global generators (a Dropout mask, noise added in ``training_step``). A forward
that runs out of memory after such a draw has moved the generator on for a batch that never trained, so
without a rewind the micro-batches draw other numbers than the run with memory drew, and every later step
of the run draws from a shifted stream (measured: a Dropout model off by 9e-2 in its weights after one
epoch). :class:`StepRng` saves the generators' states before every step and puts them back before each
round of micro-batches, so every attempt at a batch starts from the state the whole batch's step started
from.

What that gives depends on how an operator consumes the generator. Where it draws one number per element,
in order (the CPU's default kernels: ``rand``, and ``bernoulli_``, nn.Dropout's mask, except where torch uses
MKL's on an Intel CPU), micro-batches of a step with one random operator draw the whole batch's numbers in
order: the same masks, and the same stream after the step. Where a call draws a fixed amount whatever its size
(MKL's ``bernoulli_`` takes one seed per call; a CUDA kernel advances the Philox offset by a multiple of 4 per
launch), or where a forward has several random operators (the pieces interleave their draws differently from
the whole batch), the micro-batches draw other masks than the whole batch: the rewind then only keeps the
failed attempt from consuming numbers the run never uses (docs: guides/oom.md, "Dropout and other random
numbers").

Cost per step: one copy of the CPU generator's state (about 5 KB) and, once CUDA is initialised, each CUDA
generator's seed and offset (host-side values: no device sync); :meth:`StepRng.save` measured 1.1 µs on a CPU.
Python's and NumPy's generators are not saved (tens of µs per step); a step that draws from them is not
rewound.
"""

from __future__ import annotations

import torch


class StepRng:
    """The states of torch's CPU and CUDA default generators at the start of the step being trained."""

    def __init__(self) -> None:
        self.start: list[tuple[torch.Generator, torch.Tensor]] = []
        """Each generator and its state when the step started (:meth:`save`)."""

    def save(self) -> None:
        """Note where every generator the step can draw from stands now (before each step: the hot path)."""
        start = [(torch.default_generator, torch.default_generator.get_state())]
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            start += [(g, g.get_state()) for g in torch.cuda.default_generators]
        self.start = start

    def rewind(self) -> None:
        """Back to the step's start: the next attempt at the batch draws what the failed one drew."""
        for generator, state in self.start:
            generator.set_state(state)


__all__ = ["StepRng"]
